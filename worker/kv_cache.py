"""Paged KV cache with prefix caching: block pool, reference counts, LRU eviction, KV events.

Modelled on vLLM V1's `BlockPool` / `KVCacheManager`:
- `num_blocks` blocks of `block_size` token slots; a sequence holds a list of block ids.
- A full block is *cached* under its engine hash, a chain over the router's per-block content
  hashes (`protocol.hashing.block_hashes`): equal content after an equal prefix
  gives an equal key, so a later request with the same prefix reuses the block.
- Reference counts: a block is shared by every sequence (and session pin) using it; at zero it
  goes to the free queue but stays cached until the allocator reuses it (LRU: the least
  recently freed block is evicted first; blocks holding nothing cached are reused before any
  cached one).
- Every change to the cached set is recorded as a vLLM KV event (BlockStored / BlockRemoved /
  AllBlocksCleared) the way vLLM records it (a BlockStored per request and step, a
  BlockRemoved per evicted block); the engine drains them once per step into one EventBatch.
"""

import struct
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KvEvent,
)

_PAIR = struct.Struct("<QQ")


def chain_hash(parent: int | None, content_hash: int) -> int:
    """Engine block hash: XXH3-64 over (parent engine hash, content hash), like vLLM's chain."""
    return xxhash.xxh3_64_intdigest(_PAIR.pack(parent or 0, content_hash))


def chained_hashes(
    token_ids: np.ndarray, block_size: int, lora_name: str | None = None
) -> list[int]:
    """Engine hashes of every full block of a token sequence."""
    out: list[int] = []
    parent = None
    for content in block_hashes(token_ids, block_size, lora_name):
        parent = chain_hash(parent, content)
        out.append(parent)
    return out


class CacheFull(Exception):
    pass


class KvCache:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # engine hash -> block id
        # Free blocks (ref 0) in eviction order: first = next to be reused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.events: list[KvEvent] = []

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: fraction of blocks not in the free queue."""
        return 1.0 - len(self.free) / self.num_blocks

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest prefix of `hashes` that is cached (stops at the first miss)."""
        blocks = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def blocks_needed(self, held: int, total_tokens: int) -> int:
        return max(0, -(-total_tokens // self.block_size) - held)

    def can_allocate(self, new_blocks: int, reused: Sequence[int] = ()) -> bool:
        # Reusing a cached block that is free takes it out of the free queue too.
        taken_from_free = sum(1 for b in reused if self.ref_count[b] == 0)
        return new_blocks + taken_from_free <= len(self.free)

    # -- mutations ---------------------------------------------------------------------------

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on already-cached blocks (prefix hits, session pins)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Fresh blocks for new tokens, evicting the least recently freed cached blocks."""
        if count > len(self.free):
            raise CacheFull(f"need {count} blocks, {len(self.free)} free")
        out = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            old = self.block_hash[block]
            if old is not None:
                del self.cached[old]
                self.block_hash[block] = None
                # one event per evicted block, as vLLM's BlockPool sends them
                self.events.append(BlockRemoved(block_hashes=[old]))
            self.ref_count[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; tail blocks first, so prefixes outlive their suffixes."""
        for b in reversed(blocks):
            self.ref_count[b] -= 1
            if self.ref_count[b] < 0:
                raise RuntimeError(f"block {b} released more often than referenced")
            if self.ref_count[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    # Holds nothing worth keeping: reuse it before any cached block.
                    self.free.move_to_end(b, last=False)

    def commit(
        self,
        blocks: list[int],
        hashes: Sequence[int],
        token_ids: np.ndarray,
        start: int,
        parent: int | None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Cache full blocks `start..len(hashes)` of a sequence (its `blocks`, edited in place).

        A block another block already caches under the same hash (two equal prompts prefilled
        at the same time) is not cached twice: the sequence switches to the cached copy and its
        own is freed. (vLLM keeps such duplicates and may then announce a block removed while a
        copy survives; sharing keeps the events an exact description of the cache.)
        """
        stored_hashes: list[EngineHash] = []
        stored_tokens: list[int] = []
        first_parent = parent
        bs = self.block_size
        for i in range(start, len(hashes)):
            h = hashes[i]
            b = blocks[i]
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
                stored_hashes.append(h)
                stored_tokens.extend(token_ids[i * bs : (i + 1) * bs].tolist())
                continue
            if self.block_hash[b] is None:  # a twin computed it first: share the cached copy
                twin = self.cached[h]
                self.touch([twin])
                blocks[i] = twin
                self.release([b])
            if stored_hashes:  # keep each event's blocks one contiguous chain
                self._stored(stored_hashes, first_parent, stored_tokens, lora_id, lora_name)
                stored_hashes, stored_tokens = [], []
            first_parent = h
        if stored_hashes:
            self._stored(stored_hashes, first_parent, stored_tokens, lora_id, lora_name)

    def _stored(
        self,
        hashes: list[EngineHash],
        parent: int | None,
        tokens: list[int],
        lora_id: int | None,
        lora_name: str | None,
    ) -> None:
        self.events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=lora_id,
                lora_name=lora_name,
            )
        )

    def reset(self) -> bool:
        """Drop every cached block that no one references (vLLM's reset_prefix_cache).

        Refused (False) while any block is in use, as vLLM refuses it with running requests.
        """
        if len(self.free) != self.num_blocks:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.free = OrderedDict((b, None) for b in range(self.num_blocks))
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
