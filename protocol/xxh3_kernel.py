"""The compiled loop behind `hashing.warm_up()`: XXH3-64 of every block of a token array.

xxHash's `XXH3_len_17to128_64b` over each block of 5..32 u32 ids (20..128 bytes), with the
per-length lane offsets and seeded secret words precomputed by `hashing.kernel_constants`.
Imported only by `hashing.warm_up()` (it imports numba); tested bit-exact against xxhash.
"""

import numba
import numpy as np

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_S37 = np.uint64(37)
_PRIME_MX1 = np.uint64(0x165667919E3779F9)

SIGNATURE = "void(u4[::1], i8, i8[::1], u8[::1], u8[::1], u8, u8[::1])"


@numba.njit(inline="always")
def _mul128_fold64(a, b):
    """The 128-bit product's halves xor-ed, built from 32-bit pieces (no 128-bit integers)."""
    al, ah, bl, bh = a & _M32, a >> _S32, b & _M32, b >> _S32
    ll, hl, lh, hh = al * bl, ah * bl, al * bh, ah * bh
    cross = (ll >> _S32) + (hl & _M32) + lh
    upper = (hl >> _S32) + (cross >> _S32) + hh
    return ((cross << _S32) | (ll & _M32)) ^ upper


@numba.njit(inline="always")
def block_hash(ids, first, offsets, low, high, start):
    """XXH3-64 of the block of ids from `first` as bytes: `start` is length × PRIME64_1; lane k
    mixes the 16 bytes at u32 offset `offsets[k]` with the secret words `low[k]` (+ seed) and
    `high[k]` (− seed). Also what the router's index kernels hash an event's blocks with."""
    acc = start
    for k in range(offsets.shape[0]):
        i = first + offsets[k]
        lo = (np.uint64(ids[i]) | (np.uint64(ids[i + 1]) << _S32)) ^ low[k]
        hi = (np.uint64(ids[i + 2]) | (np.uint64(ids[i + 3]) << _S32)) ^ high[k]
        acc += _mul128_fold64(lo, hi)
    acc ^= acc >> _S37  # XXH3_avalanche
    acc *= _PRIME_MX1
    acc ^= acc >> _S32
    return acc


@numba.njit(nogil=True)
def hash_blocks(ids, block_size, offsets, low, high, start, out):
    """out[b] = XXH3-64 of ids[b*block_size : (b+1)*block_size] as bytes (`block_hash`)."""
    for b in range(out.shape[0]):
        out[b] = block_hash(ids, b * block_size, offsets, low, high, start)
