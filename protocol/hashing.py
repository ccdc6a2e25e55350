"""KV block hashing: the router's own content hash of each full block of token ids.

DESIGN §3.5: per full block of `block_size` ids, XXH3-64 with seed 1337 over the ids as u32
little-endian, bit-exact with Dynamo's `compute_block_hash_for_seq`. A LoRA adapter name moves
the seed (1337 + XXH3-64 of the name, wrapping), so equal tokens under different adapters never
share a block. The hashes are per block, not chained: position comes from the index's path.

Because they are per block, a block's hash depends on its 16-ish token ids alone, so the hashes
of the blocks a request shares with an earlier one (a system prompt, a conversation's history)
can be copied rather than recomputed: `PrefixReuse` keeps the last token array seen per first
block and finds the common prefix with one numpy comparison. Only blocks whose ids are equal
are copied, so the result is always what hashing every block gives.
"""

import array
import sys
import threading
from collections import OrderedDict
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


def _hash_blocks(data: bytes, step: int, first: int, count: int, seed: int) -> np.ndarray:
    """XXH3 of blocks first..count-1 of `data` (`step` bytes each)."""
    chunks = (data[i : i + step] for i in range(first * step, count * step, step))
    return np.fromiter(map(_xxh3, chunks, repeat(seed)), np.uint64, count - first)


class PrefixReuse:
    """The last token array hashed per (first block's hash, block size, seed), with its hashes:
    what a request sharing a prefix with an earlier one copies instead of rehashing.

    Bounded by entries and by stored tokens (least recently used out first). Entries hold
    private copies, so callers may change their arrays afterwards. Thread-safe.
    """

    MIN_BLOCKS = 8  # shorter sequences are hashed outright: the lookup would cost more

    def __init__(self, max_entries: int = 256, max_tokens: int = 4 << 20):
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = (
            OrderedDict()
        )
        self._tokens = 0
        self._lock = threading.Lock()
        self.reused_blocks = 0
        self.hashed_blocks = 0

    def hash(self, tokens: np.ndarray, block_size: int, seed: int) -> np.ndarray:
        count = len(tokens) // block_size
        data = tokens.tobytes()
        step = block_size * 4
        if count < self.MIN_BLOCKS:
            return _hash_blocks(data, step, 0, count, seed)
        key = (_xxh3(data[:step], seed), block_size, seed)
        with self._lock:
            entry = self._entries.get(key)
        reuse = 0
        if entry is not None:
            old_tokens, old_hashes = entry
            n = min(len(old_tokens), count * block_size)
            differ = np.flatnonzero(old_tokens[:n] != tokens[:n])
            reuse = (int(differ[0]) if differ.size else n) // block_size
        if reuse == count:
            hashes = old_hashes[:count].copy()
        else:
            hashes = _hash_blocks(data, step, reuse, count, seed)
            if reuse:
                hashes = np.concatenate((old_hashes[:reuse], hashes))
        self.reused_blocks += reuse
        self.hashed_blocks += count - reuse
        if reuse == count:  # nothing new: keep the (maybe longer) entry, mark it recent
            with self._lock:
                if key in self._entries:
                    self._entries.move_to_end(key)
        else:
            self._store(key, tokens[: count * block_size].copy(), hashes.copy())
        return hashes

    def _store(self, key: tuple[int, int, int], tokens: np.ndarray, hashes: np.ndarray) -> None:
        if len(tokens) > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old[0])
            self._entries[key] = (tokens, hashes)
            self._tokens += len(tokens)
            while len(self._entries) > self.max_entries or self._tokens > self.max_tokens:
                _, (dropped, _) = self._entries.popitem(last=False)
                self._tokens -= len(dropped)

    def __len__(self) -> int:
        return len(self._entries)


_REUSE = PrefixReuse()


def block_hash_array(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> np.ndarray:
    """Hash every full block of `block_size` token ids into a uint64 array (what the router's
    index takes without conversion); a partial tail block is dropped. Blocks shared with a
    recent sequence are copied from it (`PrefixReuse`)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
    return _REUSE.hash(as_token_array(token_ids), block_size, block_hash_seed(lora_name))


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None
) -> list[int]:
    """`block_hash_array` as a list of Python ints."""
    return block_hash_array(token_ids, block_size, lora_name).tolist()
