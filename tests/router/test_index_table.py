"""The flat uint64 hash table (probed by the compiled kernels) behaves like a dict under any mix
of put / pop / get, through growth, tombstones and rebuilds."""

from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamograph.router.table import MISSING, REBUILD_ROOM, U64Table

pytestmark = pytest.mark.unit

# A small key space forces collisions, repeats within a batch, reuse of tombstones.
keys_st = st.lists(st.integers(2, 40) | st.integers(2, (1 << 64) - 1), max_size=40)
ops_st = st.lists(st.tuples(st.sampled_from(["put", "pop", "get"]), keys_st), max_size=30)


@settings(max_examples=80, deadline=None)
@given(ops_st)
def test_matches_a_dict(ops):
    table, model = U64Table(capacity=8), {}
    for n, (op, keys) in enumerate(ops):
        arr = np.array(keys, dtype=np.uint64)
        if op == "put":  # in order: a repeated key sees its own earlier write
            vals = np.arange(arr.size, dtype=np.int32) + 100 * n
            expected = []
            for k, v in zip(keys, vals.tolist(), strict=True):
                expected.append(model.get(k, MISSING))
                model[k] = v
            assert table.put(arr, vals).tolist() == expected
        elif op == "pop":
            assert table.pop(arr).tolist() == [model.pop(k, MISSING) for k in keys]
        else:
            assert table.get(arr).tolist() == [model.get(k, MISSING) for k in keys]
        assert len(table) == len(model)
    k, v = table.items()
    assert dict(zip(k.tolist(), v.tolist(), strict=True)) == model
    assert sorted(table.live_keys().tolist()) == sorted(model)


def test_grows_shrinks_and_survives_heavy_churn():
    rng = np.random.default_rng(0)
    table, model = U64Table(), {}
    cells = {table.keys.size}
    for round_ in range(30):
        keys = rng.integers(2, 5000, 400, dtype=np.uint64)
        if round_ % 3 == 2:
            table.pop(keys)
            for k in keys.tolist():
                model.pop(k, None)
        else:
            table.put(keys, np.full(keys.size, round_, np.int32))
            model.update(dict.fromkeys(keys.tolist(), round_))
        cells.add(table.keys.size)
        # tombstones count against the load: a rebuild keeps cells in use ≤ max_load
        assert table.meta[1] <= 0.8 * table.keys.size
    assert len(cells) > 2  # it really was rebuilt
    probe = np.arange(2, 5000, dtype=np.uint64)
    assert table.get(probe).tolist() == [model.get(k, MISSING) for k in probe.tolist()]


def test_reserve_makes_room_and_says_when_it_rebuilt():
    table = U64Table(capacity=8)  # 16 cells, 12 of them usable
    table.put(np.arange(2, 12, dtype=np.uint64), np.arange(10, dtype=np.int32))
    assert table.keys.size == 16
    assert not table.reserve(2)
    assert table.reserve(3)  # 10 + 3 > 0.8 · 16
    assert table.keys.size == 32
    assert table.get(np.arange(2, 12, dtype=np.uint64)).tolist() == list(range(10))


def test_a_table_full_of_tombstones_is_rebuilt_without_growing():
    table = U64Table(capacity=8)  # 16 cells, 12 of them usable
    keys = np.arange(2, 14, dtype=np.uint64)
    table.put(keys, np.zeros(12, np.int32))
    assert table.pop(keys).tolist() == [0] * 12 and len(table) == 0
    assert table.reserve(1)  # 12 tombstones + 1 > 12: rebuilt for the one live key to come
    assert table.keys.size == 8 and table.meta[1] == 0
    assert table.put(np.array([99], np.uint64), np.array([7], np.int32)).tolist() == [MISSING]
    assert table.get(keys).tolist() == [MISSING] * 12


def test_a_table_whose_keys_come_and_go_is_rebuilt_once_per_quarter_of_its_room():
    # 2,000 live keys at load 0.5 fit 4,096 cells (2,048 usable) with 48 to spare: rebuilt to
    # that size, a cache storing as it evicts would fill it again every 6 batches of 8
    table = U64Table(capacity=8, max_load=0.5)
    live = np.arange(2, 2002, dtype=np.uint64)
    table.put(live, np.zeros(live.size, np.int32))
    arrays, inserted, rebuilds = table.keys, 0, [(0, int(table.meta[3]))]
    end = 2002 + 600 * 8
    for start in range(2002, end, 8):
        new = np.arange(start, start + 8, dtype=np.uint64)
        table.put(new, np.ones(8, np.int32))
        inserted += 8
        table.pop(np.arange(start - 2000, start - 1992, dtype=np.uint64))  # the oldest 8
        if table.keys is not arrays:
            rebuilds.append((inserted, int(table.meta[3])))  # inserts so far, its new limit
            arrays = table.keys
        assert len(table) == 2000
    assert len(rebuilds) >= 2, "tombstones never filled the table"
    for (at, limit), (next_at, _) in pairwise(rebuilds):
        assert next_at - at >= REBUILD_ROOM * limit - 8
    assert len(rebuilds) <= 4  # 4,800 inserts, each rebuild leaving ≥ 1,024 cells to spare
    assert table.get(np.arange(end - 2000, end, dtype=np.uint64)).tolist() == [1] * 2000


def test_reserved_keys_are_refused():
    with pytest.raises(ValueError, match="reserved"):
        U64Table().put(np.array([5, 1], np.uint64), np.array([1, 2], np.int32))


def test_reserve_moving_says_where_every_cell_went():
    table = U64Table(capacity=8)  # 16 cells, 12 usable
    keys = np.arange(2, 14, dtype=np.uint64)
    table.put(keys, np.arange(12, dtype=np.int32) + 50)
    table.pop(keys[:3])  # tombstones are not carried over
    old_cells = {int(k): int(c) for c, k in enumerate(table.keys.tolist()) if k >= 2}
    assert table.reserve_moving(0) is None  # 12 cells used of 12: room for nothing more
    moved = table.reserve_moving(20)
    assert moved is not None and moved.size == 16
    for key, cell in old_cells.items():
        assert table.keys[moved[cell]] == key
    assert table.get(keys).tolist() == [MISSING] * 3 + list(range(53, 62))
