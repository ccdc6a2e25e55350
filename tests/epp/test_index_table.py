"""The flat uint64 hash table behaves like a dict under any mix of put / pop / get."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamograph.epp.table import MISSING, U64Table

pytestmark = pytest.mark.unit

# A small key space forces collisions, duplicates within a batch, reuse of tombstones.
keys_st = st.lists(st.integers(2, 40) | st.integers(2, (1 << 64) - 1), max_size=40)
ops_st = st.lists(st.tuples(st.sampled_from(["put", "pop", "get"]), keys_st), max_size=30)


@settings(max_examples=80, deadline=None)
@given(ops_st)
def test_matches_a_dict(ops):
    table, model = U64Table(capacity=8), {}
    for n, (op, keys) in enumerate(ops):
        arr = np.array(keys, dtype=np.uint64)
        if op == "put":  # batch writes take distinct keys
            arr = np.array(list(dict.fromkeys(keys)), dtype=np.uint64)
            vals = np.arange(arr.size, dtype=np.int32) + 100 * n
            old = table.put(arr, vals)
            assert old.tolist() == [model.get(k, MISSING) for k in arr.tolist()]
            model.update(zip(arr.tolist(), vals.tolist(), strict=True))
        elif op == "pop":
            got = table.pop(arr)
            distinct = sorted(set(keys)) if len(set(keys)) != len(keys) else keys
            assert got.tolist() == [model.pop(k, MISSING) for k in distinct]
        else:
            assert table.get(arr).tolist() == [model.get(k, MISSING) for k in keys]
        assert len(table) == len(model)
    k, v = table.items()
    assert dict(zip(k.tolist(), v.tolist(), strict=True)) == model


def test_add_inserts_only_the_absent_keys():
    table = U64Table()
    table.put(np.array([5, 6], np.uint64), np.array([50, 60], np.int32))
    vals, new = table.add(np.array([6, 7, 8], np.uint64), lambda n: np.arange(n) + 70)
    assert vals.tolist() == [60, 70, 71] and new.tolist() == [False, True, True]
    assert table.add(np.array([5, 7], np.uint64), lambda n: 1 / 0)[1] is None
    assert table.get(np.array([5, 6, 7, 8, 9], np.uint64)).tolist() == [50, 60, 70, 71, MISSING]


def test_grows_and_survives_heavy_churn():
    rng = np.random.default_rng(0)
    table, model = U64Table(), {}
    for round_ in range(30):
        keys = rng.integers(2, 5000, 400, dtype=np.uint64)
        if round_ % 3 == 2:
            table.pop(keys)
            for k in set(keys.tolist()):
                model.pop(k, None)
        else:
            keys = np.unique(keys)
            table.put(keys, np.full(keys.size, round_, np.int32))
            model.update(dict.fromkeys(keys.tolist(), round_))
    probe = np.arange(2, 5000, dtype=np.uint64)
    assert table.get(probe).tolist() == [model.get(k, MISSING) for k in probe.tolist()]


@settings(max_examples=80, deadline=None)
@given(ops_st)
def test_scalar_and_batch_operations_agree(ops):
    """put1/get1/pop1 on the same table as the batch operations, against a dict."""
    table, model = U64Table(capacity=8), {}
    for n, (op, keys) in enumerate(ops):
        for i, k in enumerate(keys):
            if op == "put":
                assert table.put1(k, n * 100 + i) == model.get(k, MISSING)
                model[k] = n * 100 + i
            elif op == "pop":
                assert table.pop1(k) == model.pop(k, MISSING)
            else:
                assert table.get1(k) == model.get(k, MISSING)
        arr = np.array(list(model) + keys, dtype=np.uint64)
        assert table.get(arr).tolist() == [model.get(k, MISSING) for k in arr.tolist()]
        assert len(table) == len(model)
