"""Edge cases of the index's compiled kernels: growth in the middle of an event, rows recycled,
more than 64 slots, a block removed from the middle of a chain, engine hashes reused."""

import numpy as np
import pytest

from dynamograph.router import index as index_module
from dynamograph.router.index import KvIndex

pytestmark = pytest.mark.unit


def chain(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 1 << 63, n, dtype=np.uint64).tolist()


def engine_of(hashes: list[int], salt: int = 0) -> list[int]:
    """Engine hashes as vLLM's: a function of the prefix (here of the position and content)."""
    return [(h * 31 + i * 7 + salt) % (1 << 64) or 5 for i, h in enumerate(hashes)]


def test_one_event_larger_than_every_table_grows_them_all():
    index = KvIndex()
    blocks = chain(5000, 1)  # > the initial 1,024 rows, key and slot tables
    assert index.store((1, 0), engine_of(blocks), None, blocks) is not None
    assert index.block_count((1, 0)) == 5000 and index.distinct_blocks() == 5000
    assert index.find_matches(blocks + chain(10, 2)) == {(1, 0): 5000}
    assert index.find_matches(np.array(blocks[:4321], np.uint64)) == {(1, 0): 4321}
    # a second slot continues the same prefix in small events (parent linkage across events)
    engine = engine_of(blocks, salt=1)
    for i in range(0, 3000, 7):
        parent = engine[i - 1] if i else None
        assert index.store((2, 0), engine[i : i + 7], parent, blocks[i : i + 7]) is not None
    assert index.find_matches(blocks) == {(1, 0): 5000, (2, 0): 3003}
    assert index.distinct_blocks() == 5000 and index.total_blocks() == 8003


def test_rows_renumbered_when_the_key_table_grows_keep_every_slot_right():
    """A row is its key's cell: a rebuild moves rows under slots that hold them."""
    index = KvIndex()
    a, b = chain(800, 20), chain(6000, 21)
    ea, eb = engine_of(a), engine_of(b)
    index.store((1, 0), ea, None, a)
    index.store((2, 0), engine_of(a[:300], 1), None, a[:300])
    cells = index._keys.keys.size
    for i in range(0, 6000, 50):  # grows the key table several times under slots 1 and 2
        index.store((3, 0), eb[i : i + 50], eb[i - 1] if i else None, b[i : i + 50])
    assert index._keys.keys.size >= 4 * cells
    assert index.find_matches(a) == {(1, 0): 800, (2, 0): 300}
    assert index.find_matches(b) == {(3, 0): 6000}
    index.remove((1, 0), [ea[400]])  # removal and parent lookups go through renumbered rows
    index.store((1, 0), [ea[400]], ea[399], [a[400]])
    index.store((1, 0), [7777], ea[799], chain(1, 22))
    assert index.find_matches(a + chain(1, 22)) == {(1, 0): 801, (2, 0): 300}
    index.remove_slot((3, 0))
    assert index.distinct_blocks() == 801 and index.find_matches(b) == {}


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 319, 320, 321, 1999, 2000])
def test_query_stages_end_anywhere(length):
    index = KvIndex()
    blocks = chain(2000, 3)
    index.store((1, 0), engine_of(blocks), None, blocks)
    index.store((2, 0), engine_of(blocks[:70], 9), None, blocks[:70])
    query = blocks[:length] + chain(50, 4)
    expected = {(1, 0): length, (2, 0): min(length, 70)} if length else {}
    assert index.find_matches(query) == expected
    assert index.find_matches(blocks[:length]) == expected


def test_rows_are_recycled():
    index = KvIndex()
    cells = []
    for round_ in range(20):
        blocks = chain(900, 100 + round_)
        engine = engine_of(blocks)
        index.store((1, 0), engine, None, blocks)
        assert index.distinct_blocks() == 900
        index.remove((1, 0), engine[::-1])
        assert index.distinct_blocks() == 0 and index.total_blocks() == 0
        cells.append(index._keys.keys.size)
    # the tombstones' first rebuild sized the table with room to spare; the next 16,200 blocks
    # went through the same cells
    assert len(set(cells[2:])) == 1


def test_more_than_64_slots_share_rows():
    index = KvIndex()
    blocks = chain(300, 5)
    slots = [(w, r) for w in range(50) for r in range(3)]  # 150 slots: three mask words
    for i, slot in enumerate(slots):
        depth = 1 + (i * 37) % 300
        index.store(slot, engine_of(blocks[:depth], i), None, blocks[:depth])
    expected = {slot: 1 + (i * 37) % 300 for i, slot in enumerate(slots)}
    assert index.find_matches(blocks) == expected
    assert index.distinct_blocks() == max(expected.values())
    # slots leave one by one (bits cleared in every word); the rows go with the last holder
    for i, slot in enumerate(slots):
        index.remove_slot(slot)
        del expected[slot]
        if i % 25 == 0:
            assert index.find_matches(blocks) == expected
    assert index.distinct_blocks() == 0 and index._holders.shared_rows() == 0
    # columns are reused by new slots
    index.store((99, 0), engine_of(blocks[:3]), None, blocks[:3])
    assert index.find_matches(blocks) == {(99, 0): 3}


def test_removing_a_middle_block_cuts_the_match_there():
    index = KvIndex()
    blocks = chain(10, 6)
    mine, other = engine_of(blocks), engine_of(blocks, 1)
    index.store((1, 0), mine, None, blocks)
    index.store((2, 0), other, None, blocks)
    index.remove((1, 0), [mine[5]])
    assert index.find_matches(blocks) == {(1, 0): 5, (2, 0): 10}
    assert index.block_count((1, 0)) == 9
    index.store((1, 0), [mine[5]], mine[4], [blocks[5]])  # stored again: the rest counts again
    assert index.find_matches(blocks) == {(1, 0): 10, (2, 0): 10}
    index.remove((2, 0), [other[0]])
    assert index.find_matches(blocks) == {(1, 0): 10}
    assert index.distinct_blocks() == 10


def test_an_engine_hash_reused_for_other_content_drops_the_old_block():
    index = KvIndex()
    a, b = chain(4, 7), chain(4, 8)
    index.store((1, 0), [11, 12, 13, 14], None, a)
    index.store((1, 0), [21, 12], None, b[:2])  # engine hash 12 now names b[:2]
    assert index.find_matches(a) == {(1, 0): 1}
    assert index.find_matches(b) == {(1, 0): 2}
    # repeated within one event: the last block with the hash wins
    index.store((2, 0), [31, 31], None, a[:2])
    assert index.find_matches(a) == {(1, 0): 1}
    assert index.block_count((2, 0)) == 1
    index.remove((2, 0), [31])
    assert index.block_count((2, 0)) == 0


def test_odd_engine_hashes():
    index = KvIndex()
    blocks = chain(5, 9)
    engine = [0, 7, -3, b"\x01\x02", (1 << 70) + 3]  # reserved, negative, bytes, > 64 bits
    index.store((1, 0), engine, None, blocks)
    assert index.find_matches(blocks) == {(1, 0): 5}
    index.store((1, 0), [77], (1 << 70) + 3, chain(1, 10))
    assert index.find_matches(blocks + chain(1, 10)) == {(1, 0): 6}
    index.remove((1, 0), [b"\x01\x02"])
    assert index.find_matches(blocks) == {(1, 0): 3}


def test_unknown_parent_stores_nothing():
    index = KvIndex()
    blocks = chain(3, 11)
    assert index.store((1, 0), [5, 6, 7], 12345, blocks) is None
    assert index.total_blocks() == 0 and index.find_matches(blocks) == {}


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="engine block hashes"):
        KvIndex().store((1, 0), [5, 6], None, [7])


def test_first_stage_size_does_not_change_answers(monkeypatch):
    blocks = chain(700, 12)
    index = KvIndex()
    index.store((1, 0), engine_of(blocks), None, blocks)
    index.store((2, 0), engine_of(blocks[:333], 1), None, blocks[:333])
    answers = []
    for first in (1, 5, 64, 4096):
        monkeypatch.setattr(index_module, "FIRST_STAGE", first)
        answers.append(index.find_matches(blocks + chain(100, 13)))
    assert answers == [{(1, 0): 700, (2, 0): 333}] * 4


def test_kernels_compile_without_a_writable_cache(monkeypatch, recwarn):
    """A read-only install (no __pycache__, no user cache dir) compiles in memory, silently,
    and the kernel then refuses other types instead of compiling again."""
    import numba
    from numba.core import caching

    from dynamograph.protocol.compiled import compile_ahead

    def read_only(self):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(caching._CacheLocator, "ensure_cache_path", read_only)
    disp = compile_ahead(numba.njit(lambda x: x + 1), "i8(i8)", "test")
    assert disp(41) == 42
    with pytest.raises(TypeError):
        disp(1.5j)
    assert not [w for w in recwarn if issubclass(w.category, numba.NumbaWarning)]
