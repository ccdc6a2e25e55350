"""KV block hashing: the router's own content hash of each full block of token ids.

Per full block of `block_size` ids, XXH3-64 with seed 1337 over the ids as u32
little-endian, bit-exact with Dynamo's `compute_block_hash_for_seq`. A LoRA adapter name moves
the seed (1337 + XXH3-64 of the name, wrapping), so equal tokens under different adapters never
share a block. The hashes are per block, not chained: position comes from the index's path.

Processes that run numba anyway (the EPP, the frontend's kv mode) call `warm_up()` once: from
then on blocks of 5..32 ids (XXH3's 17-128-byte case) are hashed by one compiled loop over the
whole array, ~10x less CPU than a Python call per block, and with no cache needed. numba is
imported there and only there, so other processes (the direct-mode frontend, workers) never
load it.
"""

import array
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from itertools import repeat

import numpy as np
import xxhash
from numpy.typing import NDArray

from .compiled import compile_ahead

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


def _hash_blocks(data: bytes, step: int, count: int, seed: int) -> np.ndarray:
    """XXH3 of the first `count` blocks of `data` (`step` bytes each), one call per block."""
    chunks = (data[i : i + step] for i in range(0, count * step, step))
    return np.fromiter(map(_xxh3, chunks, repeat(seed)), np.uint64, count)


# ---- XXH3-64 of 17..128-byte inputs, compiled (xxHash's XXH3_len_17to128_64b) -----------------

# The first 128 bytes of XXH3's default secret (`kSecret`): all that inputs of ≤ 128 bytes read.
_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
)
_PRIME64_1 = 0x9E3779B185EBCA87
KERNEL_BLOCK_SIZES = range(5, 33)  # 20..128 bytes of ids: XXH3's 17-128-byte case
# xxh3_kernel.hash_blocks (ids, block_size, offsets, low, high, start, out), compiled
_HashKernel = Callable[
    [
        np.ndarray,
        int,
        NDArray[np.int64],
        NDArray[np.uint64],
        NDArray[np.uint64],
        np.uint64,
        np.ndarray,
    ],
    None,
]
_kernel: _HashKernel | None = None  # set by warm_up()
_kernel_lock = threading.Lock()


@functools.lru_cache(maxsize=64)
def kernel_constants(
    block_size: int, seed: int
) -> tuple[NDArray[np.int64], NDArray[np.uint64], NDArray[np.uint64], np.uint64]:
    """Per 16-byte lane XXH3 mixes for this length: the lane's u32 offset in the block and the
    secret's two words with the seed added / subtracted; then the accumulator's start."""
    length = 4 * block_size
    lanes = [(0, 0), (length - 16, 16)]  # (offset in the block, offset in the secret)
    for k in range(1, 4):
        if length > 32 * k:
            lanes += [(16 * k, 32 * k), (length - 16 * (k + 1), 32 * k + 16)]

    def word(offset: int) -> int:
        return int.from_bytes(_SECRET[offset : offset + 8], "little")

    offsets = np.array([lane // 4 for lane, _ in lanes], np.int64)
    low = np.array([(word(sec) + seed) & _U64 for _, sec in lanes], np.uint64)
    high = np.array([(word(sec + 8) - seed) & _U64 for _, sec in lanes], np.uint64)
    return offsets, low, high, np.uint64(length * _PRIME64_1 & _U64)


def _compile_kernel() -> _HashKernel:
    from . import xxh3_kernel

    kernel: _HashKernel = compile_ahead(
        xxh3_kernel.hash_blocks, xxh3_kernel.SIGNATURE, "block-hash"
    )
    return kernel


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) the block-hash kernel and use it from now
    on in this process. Imports numba: for processes that already run it."""
    global _kernel
    if _kernel is None and _NATIVE_U32:
        with _kernel_lock:
            if _kernel is None:
                _kernel = _compile_kernel()


def _kernel_hash(tokens: np.ndarray, block_size: int, seed: int) -> np.ndarray:
    kernel = _kernel
    if kernel is None:
        raise RuntimeError("the block-hash kernel is not compiled: call hashing.warm_up() first")
    if not tokens.flags.writeable:  # numba types read-only arrays apart; compiled for one
        tokens = tokens.copy()
    out = np.empty(len(tokens) // block_size, np.uint64)
    kernel(tokens, block_size, *kernel_constants(block_size, seed), out)
    return out


def block_hash_array(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> np.ndarray:
    """Hash every full block of `block_size` token ids into a uint64 array (what the router's
    index takes without conversion); a partial tail block is dropped. After `warm_up` the
    compiled kernel hashes block sizes 5..32; otherwise each block is one xxhash call."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    tokens = as_token_array(token_ids)
    seed = block_hash_seed(lora_name)
    if _kernel is not None and block_size in KERNEL_BLOCK_SIZES:
        return _kernel_hash(tokens, block_size, seed)
    return _hash_blocks(tokens.tobytes(), block_size * 4, len(tokens) // block_size, seed)


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> list[int]:
    """`block_hash_array` as a list of Python ints."""
    hashes: list[int] = block_hash_array(token_ids, block_size, lora_name).tolist()
    return hashes
