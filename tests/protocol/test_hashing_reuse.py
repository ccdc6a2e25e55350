"""Hashes copied from an earlier sequence (`PrefixReuse`) are exactly the hashes of every block.

The oracle is XXH3-64 of each block computed here directly (test_hashing.py anchors that to
Dynamo). Sequences share prefixes of every awkward length: inside a block, on a boundary, the
whole sequence, longer and shorter than the stored one.
"""

import numpy as np
import pytest
import xxhash

from dynamograph.protocol.hashing import PrefixReuse, block_hash_array, block_hash_seed

pytestmark = pytest.mark.unit


def _oracle(tokens: np.ndarray, block_size: int, seed: int) -> list[int]:
    data = tokens.astype("<u4").tobytes()
    step = block_size * 4
    return [
        xxhash.xxh3_64_intdigest(data[i : i + step], seed)
        for i in range(0, len(data) // step * step, step)
    ]


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_reused_hashes_equal_hashing_every_block(block_size):
    rng = np.random.default_rng(block_size)
    reuse = PrefixReuse(max_entries=8)
    seed = block_hash_seed(None)
    bases = [rng.integers(0, 1 << 32, 40 * block_size, dtype=np.uint64).astype("<u4")]
    bases.append(bases[0].copy())
    for _ in range(400):
        base = bases[int(rng.integers(len(bases)))]
        # share a prefix of any length (0 .. all, boundary ±1), then diverge or stop
        cut = int(rng.choice([rng.integers(0, len(base) + 1), block_size * rng.integers(0, 40)]))
        cut = max(0, min(len(base), cut + int(rng.integers(-1, 2))))
        tail = rng.integers(0, 1 << 32, int(rng.integers(0, 20 * block_size)), dtype=np.uint64)
        tokens = np.concatenate((base[:cut], tail.astype("<u4")))
        assert reuse.hash(tokens, block_size, seed).tolist() == _oracle(tokens, block_size, seed)
        if rng.random() < 0.3:
            bases.append(tokens)
    assert reuse.reused_blocks > reuse.hashed_blocks // 4  # the copies were actually taken


def test_changing_an_array_after_hashing_it_changes_nothing():
    reuse = PrefixReuse()
    tokens = np.arange(64 * 16, dtype="<u4")
    first = reuse.hash(tokens, 16, 1337)
    first[:] = 0  # the caller's result is its own
    tokens[500] = 7  # and so is its input
    assert reuse.hash(tokens, 16, 1337).tolist() == _oracle(tokens, 16, 1337)
    tokens[500] = 500
    assert reuse.hash(tokens, 16, 1337).tolist() == _oracle(tokens, 16, 1337)


def test_block_size_and_seed_are_part_of_the_key():
    tokens = np.arange(32 * 16, dtype="<u4")
    for block_size, lora in [(16, None), (16, "adapter"), (8, None), (16, None)]:
        seed = block_hash_seed(lora)
        got = block_hash_array(tokens, block_size, lora).tolist()
        assert got == _oracle(tokens, block_size, seed)


def test_bounded_by_entries_and_tokens():
    reuse = PrefixReuse(max_entries=4, max_tokens=3000)
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(0, 1 << 32, 800, dtype=np.uint64).astype("<u4")
        reuse.hash(tokens, 16, 1337)
        assert len(reuse) <= 3  # 4 entries would be 3200 tokens
        assert reuse._tokens <= 3000
    big = rng.integers(0, 1 << 32, 4000, dtype=np.uint64).astype("<u4")
    assert reuse.hash(big, 16, 1337).tolist() == _oracle(big, 16, 1337)  # too big to keep
    assert reuse._tokens <= 3000


def test_short_sequences_are_hashed_outright():
    reuse = PrefixReuse()
    tokens = np.arange(16 * (PrefixReuse.MIN_BLOCKS - 1) + 5, dtype="<u4")
    assert reuse.hash(tokens, 16, 1337).tolist() == _oracle(tokens, 16, 1337)
    assert len(reuse) == 0
