"""KV block hashing: the router's own content hash of each full block of token ids.

DESIGN §3.5: per full block of `block_size` ids, XXH3-64 with seed 1337 over the ids as u32
little-endian, bit-exact with Dynamo's `compute_block_hash_for_seq`. A LoRA adapter name moves
the seed (1337 + XXH3-64 of the name, wrapping), so equal tokens under different adapters never
share a block. The hashes are per block, not chained: position comes from the index's path.
"""

import array
import sys
from collections.abc import Sequence
from itertools import repeat

import numpy as np
import xxhash

BLOCK_HASH_SEED = 1337
_U64 = (1 << 64) - 1

_xxh3 = xxhash.xxh3_64_intdigest
_NATIVE_U32 = sys.byteorder == "little" and array.array("I").itemsize == 4


def block_hash_seed(lora_name: str | None = None) -> int:
    """The XXH3 seed for blocks of this adapter (the base model when None or empty)."""
    if not lora_name:
        return BLOCK_HASH_SEED
    return (BLOCK_HASH_SEED + _xxh3(lora_name.encode())) & _U64


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian u32 array (no copy when it already is one)."""
    if _NATIVE_U32 and not isinstance(token_ids, np.ndarray):
        # the stdlib converts a list of small ints ~3× faster than numpy does
        return np.frombuffer(array.array("I", token_ids), dtype="<u4")
    return np.ascontiguousarray(token_ids, dtype="<u4")


def block_hash_array(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> np.ndarray:
    """Hash every full block of `block_size` token ids into a uint64 array (what the router's
    index takes without conversion); a partial tail block is dropped."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    data = as_token_array(token_ids).tobytes()
    step = block_size * 4
    count = len(data) // step
    seed = block_hash_seed(lora_name)
    chunks = (data[i : i + step] for i in range(0, count * step, step))
    return np.fromiter(map(_xxh3, chunks, repeat(seed)), np.uint64, count)


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> list[int]:
    """`block_hash_array` as a list of Python ints."""
    return block_hash_array(token_ids, block_size, lora_name).tolist()
