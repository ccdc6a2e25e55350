"""KV index: which (worker, dp_rank) slot holds which prefix of blocks (DESIGN §3.5).

Identity of a block. The router hashes each block's tokens itself (`protocol.hashing`, not
chained). The index turns a sequence of those per-block hashes into *prefix keys*: key i
identifies blocks 0..i as a whole, so a block is named by its position in its sequence, the
role the path plays in Dynamo's radix tree. The chaining is a polynomial over Z/2^64,

    key_i = P · key_{i-1} + h_i,   key_{-1} = 0,

computed for a whole run of blocks at once with numpy (a cumulative sum of h_j · P^-j scaled by
P^i; uint64 arithmetic wraps, P is odd so P^-1 exists). Keys 0 and 1 are reserved by the hash
table and map to 2.

Storage, for speed and memory (256 workers × 100k blocks):
- one global table prefix key → row; per row the key and the slots holding it (`holders.py`:
  the one owner's column, or a shared bitmask with one bit per slot column);
- per slot a table engine block hash → row, for BlockRemoved and for finding a BlockStored's
  parent (the engine's hashes are opaque: we never compute them);
- rows nobody holds any more are recycled.

`find_matches` looks the first block up alone (a miss costs one lookup), then converts and
chains the rest in stages (512, then 2048 … blocks) until a stage's last key is absent — nobody
holds that prefix, so no score goes past it — and bisects with single lookups to tighten that
bound. Every key up to it is then looked up in one vectorized probe and the slots' bitmasks are
ANDed cumulatively: a slot's score, the length of the prefix it holds *contiguously*, is the
number of rows in which its bit survives. Events work the same way: up to 64 blocks go one by
one through the tables' scalar operations, more as whole arrays (a numpy call costs
microseconds before it does anything).

Semantics versus Dynamo's RadixTree (the differential oracle): equal on event streams a vLLM
engine produces — blocks stored under a parent the engine holds, evicted leaves first; a
BlockStored whose parent is unknown is skipped in both. Differences, on purpose: a BlockRemoved
of a block whose descendants the slot still holds removes just that block here (Dynamo drops
the whole subtree), so if the engine stores it again the descendants count again, as they do in
the engine's own prefix cache; and engine hashes are kept per slot, so two workers may name the
same prefix differently (Dynamo 1.6.1 keeps one engine hash per tree node).
"""

import itertools
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    engine_hash_key,
)

from .holders import Holders
from .table import MIN_KEY, MISSING, U64Table

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (worker_id, dp_rank)

_P = 0xC2B2AE3D27D4EB4F  # odd: invertible mod 2^64
_P_INV = pow(_P, -1, 1 << 64)
_U64 = (1 << 64) - 1
_MIN_KEY = np.uint64(MIN_KEY)
# Work done one block at a time (Python ints through memoryviews) instead of as numpy arrays:
# events of up to this many blocks (measured here: 128-block events go 20% faster as arrays),
# and the first block of a query (a miss then costs no numpy call at all).
SCALAR_EVENT_BLOCKS = 64
SCALAR_QUERY_BLOCKS = 1
# The vectorized rest of a query: stages of keys (512, 2048 … blocks) until one ends absent, then
# bisection down to this many blocks (a lookup one by one costs about as much as 50 in bulk).
_FIRST_STAGE = 512
_STAGE_GROWTH = 4
_BISECT_STOP = 64
# A slot's engine-hash table starts this big (24 KB): engines cache thousands of blocks, and each
# doubling on the way there re-inserts every key.
_SLOT_CAPACITY = 1024
_COUNT = np.uint32  # a query's blocks per slot (uint16 would sum faster but caps at 65,535)


class _Powers:
    """P^i and P^-i mod 2^64 as uint64 arrays, grown on demand."""

    def __init__(self) -> None:
        self.pow = np.empty(0, np.uint64)
        self.inv = np.empty(0, np.uint64)
        self._grow(1024)

    def _grow(self, n: int) -> None:
        pw, iv, p, q = [], [], 1, 1
        for _ in range(n):
            pw.append(p)
            iv.append(q)
            p = p * _P & _U64
            q = q * _P_INV & _U64
        self.pow = np.array(pw, np.uint64)
        self.inv = np.array(iv, np.uint64)

    def ensure(self, n: int) -> None:
        if n > self.pow.size:
            self._grow(max(n, 2 * self.pow.size))


_POWERS = _Powers()


def as_u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a uint64 array (no copy when they already are one)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.uint64, copy=False)
    return np.fromiter(values, np.uint64, len(values))


def chain_keys(parent_key: int, hashes: np.ndarray, clamp: bool = True) -> np.ndarray:
    """Prefix keys of `hashes` continuing the prefix whose key is `parent_key` (0: none);
    `clamp=False` leaves the two reserved values (keys 0 and 1, 2 once clamped) in place."""
    n = hashes.size
    _POWERS.ensure(n + 1)
    # uint64 array arithmetic wraps silently (mod 2^64), which is the arithmetic wanted
    keys = np.multiply(hashes, _POWERS.inv[:n])
    if parent_key:  # P^i · (P · parent) = P^(i+1) · parent, added once before the sum
        keys[0] = (keys.item(0) + _P * parent_key) & _U64
    np.add.accumulate(keys, out=keys)
    np.multiply(keys, _POWERS.pow[:n], out=keys)
    return np.maximum(keys, _MIN_KEY, out=keys) if clamp else keys


def engine_keys(hashes: Sequence[int | bytes]) -> np.ndarray:
    """Engine block hashes (ints, possibly negative or wider than 64 bits, or bytes) as uint64."""
    try:
        keys = np.array(hashes, dtype=np.uint64)
    except (OverflowError, TypeError, ValueError):
        keys = np.array([_fold64(engine_hash_key(h)) for h in hashes], dtype=np.uint64)
    return np.maximum(keys, np.uint64(MIN_KEY))


def engine_key(value: int | bytes) -> int:
    """One engine block hash as a table key (the scalar twin of `engine_keys`)."""
    if isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or not 0 <= value <= _U64:
        value = _fold64(engine_hash_key(value))
    return value if value >= MIN_KEY else MIN_KEY


def _fold64(value: int) -> int:
    out = 0
    while value:
        out ^= value & _U64
        value >>= 64
    return out


@dataclass(slots=True)
class _SlotState:
    column: int
    blocks: U64Table = field(default_factory=lambda: U64Table(_SLOT_CAPACITY))  # engine hash → row
    expiry: dict[int, float] = field(default_factory=dict)  # approximate mode: key → deadline


class KvIndex:
    """Prefix keys per slot, from KV events or (approximate mode) from routing decisions."""

    def __init__(self) -> None:
        self._keys = U64Table(capacity=1024, max_load=0.5)
        self._row_key = np.zeros(1024, np.uint64)
        self._holders = Holders(1024)
        self._free_rows = np.arange(1023, 0, -1, dtype=np.int32)  # row 0 = "nobody", never used
        self._nfree = self._free_rows.size
        self._slots: dict[Slot, _SlotState] = {}
        self._col_slot: list[Slot | None] = []
        self._free_cols: list[int] = []
        self._approx: deque[tuple[float, Slot, np.ndarray]] = deque()
        self._views()

    def _views(self) -> None:
        """Memoryviews for the scalar paths; renewed whenever an array is reallocated."""
        self._row_key_mv = memoryview(self._row_key)
        self._free_mv = memoryview(self._free_rows)

    # -- slots -----------------------------------------------------------------------------
    def _slot(self, slot: Slot) -> _SlotState:
        state = self._slots.get(slot)
        if state is None:
            if self._free_cols:
                col = self._free_cols.pop()
                self._col_slot[col] = slot
            else:
                col = len(self._col_slot)
                self._col_slot.append(slot)
                self._holders.ensure_columns(col + 1)
            state = self._slots[slot] = _SlotState(col)
        return state

    def slots(self) -> list[Slot]:
        return list(self._slots)

    def block_count(self, slot: Slot) -> int:
        state = self._slots.get(slot)
        return 0 if state is None else len(state.blocks)

    def total_blocks(self) -> int:
        """(slot, block) pairs held."""
        return sum(len(s.blocks) for s in self._slots.values())

    def distinct_blocks(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the index's arrays (the Python objects around them are small and few)."""
        return (
            self._keys.nbytes
            + self._row_key.nbytes
            + self._holders.nbytes
            + self._free_rows.nbytes
            + sum(s.blocks.nbytes for s in self._slots.values())
        )

    # -- rows ------------------------------------------------------------------------------
    def _rows_for(self, keys: np.ndarray) -> np.ndarray:
        """Rows of `keys` (distinct), allocating rows for keys not yet indexed."""
        rows, new = self._keys.add(keys, self._alloc_rows)
        if new is not None:
            self._row_key[rows[new]] = keys[new]
        return rows

    def _new_row(self, key: int) -> int:
        """Allocate a row for a key not yet indexed."""
        if self._nfree == 0:
            self._grow_rows(1)
        self._nfree -= 1
        row = self._free_mv[self._nfree]
        self._row_key_mv[row] = key
        self._keys.put1(key, row)
        return row

    def _grow_rows(self, n: int) -> None:
        old = self._row_key.size
        size = max(2 * old, old + n)
        self._row_key = np.concatenate([self._row_key, np.zeros(size - old, np.uint64)])
        self._holders.grow_rows(size)
        added = np.arange(size - 1, old - 1, -1, dtype=np.int32)
        self._free_rows = np.concatenate([self._free_rows[: self._nfree], added])
        self._nfree = self._free_rows.size
        self._views()

    def _alloc_rows(self, n: int) -> np.ndarray:
        if n > self._nfree:
            self._grow_rows(n)
        self._nfree -= n
        return self._free_rows[self._nfree : self._nfree + n][::-1].copy()

    def _release_rows(self, rows: np.ndarray) -> None:
        self._keys.pop(self._row_key[rows])
        if self._nfree + rows.size > self._free_rows.size:
            grown = np.empty(max(2 * self._free_rows.size, self._nfree + rows.size), np.int32)
            grown[: self._nfree] = self._free_rows[: self._nfree]
            self._free_rows = grown
            self._free_mv = memoryview(self._free_rows)
        self._free_rows[self._nfree : self._nfree + rows.size] = rows
        self._nfree += rows.size

    def _drop_bits(self, rows: np.ndarray, column: int) -> None:
        """Take `column` off `rows`; rows nobody holds any more are recycled."""
        rows = np.unique(rows[rows > 0])
        if rows.size:
            empty = self._holders.drop(rows, column)
            if empty.size:
                self._release_rows(empty)

    def _drop_bit(self, row: int, column: int) -> None:
        """`_drop_bits` for one row."""
        if self._holders.drop1(row, column):
            self._keys.pop1(self._row_key_mv[row])
            if self._nfree == self._free_rows.size:
                self._release_rows(np.array([row], np.int32))
                return
            self._free_mv[self._nfree] = row
            self._nfree += 1

    # -- events ----------------------------------------------------------------------------
    def apply_events(
        self, slot: Slot, events: Sequence[KvEvent], lora_names: Mapping[int, str] | None = None
    ) -> None:
        """Apply vLLM events of one slot, in order. `lora_names` maps vLLM lora ids to adapter
        names (an id missing there hashes as `lora-<id>`, so it matches no request)."""
        for event in events:
            if isinstance(event, BlockStored):
                lora = None
                if event.lora_id:
                    lora = (lora_names or {}).get(event.lora_id) or f"lora-{event.lora_id}"
                hashes = block_hashes(event.token_ids, event.block_size, lora)
                n = min(len(hashes), len(event.block_hashes))
                if n != len(event.block_hashes):
                    log.warning(
                        "slot %s: BlockStored with %d block hashes but %d full blocks of tokens",
                        slot,
                        len(event.block_hashes),
                        len(hashes),
                    )
                self.store(slot, event.block_hashes[:n], event.parent_block_hash, hashes[:n])
            elif isinstance(event, BlockRemoved):
                self.remove(slot, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(slot)

    def store(
        self,
        slot: Slot,
        engine_hashes: Sequence[int | bytes],
        parent_engine_hash: int | bytes | None,
        local_hashes: Sequence[int] | np.ndarray,
    ) -> bool:
        """Record blocks stored on `slot` (our per-block hashes given); False when the parent is
        unknown to this slot (the event is skipped, as Dynamo does)."""
        n = len(engine_hashes)
        if n == 0:
            return True
        state = self._slot(slot)
        parent_key = 0
        if parent_engine_hash is not None:
            row = state.blocks.get1(engine_key(parent_engine_hash))
            if row == MISSING:
                log.debug("slot %s: BlockStored parent unknown; skipped", slot)
                return False
            parent_key = self._row_key_mv[row]
        if n > SCALAR_EVENT_BLOCKS:
            keys = chain_keys(parent_key, as_u64(local_hashes))
            engine = engine_keys(engine_hashes)
            ordered = np.sort(engine)
            if (ordered[1:] == ordered[:-1]).any():  # malformed: the last one of a hash wins
                _, last = np.unique(engine[::-1], return_index=True)
                keep = np.sort(n - 1 - last)
                engine, keys = engine[keep], keys[keep]
            self._hold(state, engine, keys)
            return True
        if isinstance(local_hashes, np.ndarray):
            local_hashes = local_hashes.tolist()
        if isinstance(engine_hashes, np.ndarray):
            engine_hashes = engine_hashes.tolist()
        column, blocks, holders = state.column, state.blocks, self._holders
        key, get1 = parent_key, self._keys.get1
        for engine, local in zip(engine_hashes, local_hashes, strict=True):
            key = (key * _P + local) & _U64
            row = get1(key if key >= MIN_KEY else MIN_KEY)
            if row == MISSING:
                row = self._new_row(key if key >= MIN_KEY else MIN_KEY)
            if type(engine) is not int or not MIN_KEY <= engine <= _U64:
                engine = engine_key(engine)
            old = blocks.put1(engine, row)
            if old != MISSING and old != row:
                self._drop_bit(old, column)
            holders.add1(row, column)
        return True

    def _hold(self, state: _SlotState, engine: np.ndarray, keys: np.ndarray) -> None:
        rows = self._rows_for(keys)
        old = state.blocks.put(engine, rows)
        self._holders.add(rows, state.column)
        moved = old[(old != MISSING) & (old != rows)]
        if moved.size:  # an engine hash reused for other content: its old block is gone
            self._drop_bits(moved, state.column)

    def remove(self, slot: Slot, engine_hashes: Sequence[int | bytes]) -> None:
        state = self._slots.get(slot)
        if state is None or len(engine_hashes) == 0:
            return
        if len(engine_hashes) > SCALAR_EVENT_BLOCKS:
            rows = state.blocks.pop(engine_keys(engine_hashes))
            self._drop_bits(rows[rows != MISSING], state.column)
            return
        if isinstance(engine_hashes, np.ndarray):
            engine_hashes = engine_hashes.tolist()
        pop1, column = state.blocks.pop1, state.column
        for engine in engine_hashes:
            if type(engine) is not int or not MIN_KEY <= engine <= _U64:
                engine = engine_key(engine)
            row = pop1(engine)
            if row != MISSING:
                self._drop_bit(row, column)

    def clear(self, slot: Slot) -> None:
        """AllBlocksCleared: the slot holds nothing (it stays known)."""
        state = self._slots.get(slot)
        if state is None:
            return
        self._drop_bits(state.blocks.values(), state.column)
        state.blocks = U64Table(_SLOT_CAPACITY)
        state.expiry.clear()

    def remove_slot(self, slot: Slot) -> None:
        state = self._slots.pop(slot, None)
        if state is None:
            return
        self._drop_bits(state.blocks.values(), state.column)
        self._col_slot[state.column] = None
        self._free_cols.append(state.column)

    def remove_worker(self, worker_id: int) -> None:
        for slot in [s for s in self._slots if s[0] == worker_id]:
            self.remove_slot(slot)

    # -- approximate mode ------------------------------------------------------------------
    def record(
        self, slot: Slot, local_hashes: Sequence[int] | np.ndarray, expires_at: float
    ) -> None:
        """Approximate mode: count these blocks as cached on `slot` until `expires_at`."""
        hashes = as_u64(local_hashes)
        if hashes.size == 0:
            return
        state = self._slot(slot)
        keys = chain_keys(0, hashes)
        self._hold(state, keys, keys)  # the prefix key doubles as the "engine hash"
        for key in keys.tolist():
            state.expiry[key] = expires_at
        self._approx.append((expires_at, slot, keys))

    def expire(self, now: float) -> None:
        """Drop recorded blocks whose deadline passed (and was not extended by a later record)."""
        while self._approx and self._approx[0][0] <= now:
            _, slot, keys = self._approx.popleft()
            state = self._slots.get(slot)
            if state is None:
                continue
            gone = [k for k in keys.tolist() if state.expiry.get(k, now + 1) <= now]
            for key in gone:
                del state.expiry[key]
            if gone:
                self.remove(slot, gone)

    # -- queries ---------------------------------------------------------------------------
    def find_matches(self, local_hashes: Sequence[int] | np.ndarray) -> dict[Slot, int]:
        """{slot: number of leading blocks of the request the slot holds}, for slots with > 0."""
        n = len(local_hashes)
        scores: dict[Slot, int] = {}
        if n == 0 or not self._slots:
            return scores
        # The first blocks one by one: masks as Python ints over all words.
        head = local_hashes[:SCALAR_QUERY_BLOCKS]
        if isinstance(head, np.ndarray):
            head = head.tolist()
        bits1, get1 = self._holders.bits1, self._keys.get1
        key, alive = 0, -1
        for depth, local in enumerate(head):
            key = (key * _P + local) & _U64
            row = get1(key if key >= MIN_KEY else MIN_KEY)
            held = 0 if row == MISSING else bits1(row)
            dropped = alive & ~held
            alive &= held
            if dropped and depth:
                self._credit_int(scores, dropped, depth)
            if not alive:
                return scores
        pos = len(head)
        if pos == n:
            self._credit_int(scores, alive, n)
            return scores
        # The rest vectorized. Its keys are chained in growing stages (512, 2048 … blocks) until
        # a stage's last key is absent: nobody holds that prefix, so no score goes past it.
        # Bisecting with single lookups tightens that bound; then every key up to it is looked
        # up at once (an absent key gives row 0, held by nobody) and the holder masks are
        # ANDed cumulatively.
        alive &= (1 << len(self._col_slot)) - 1  # -1 ("everyone") when no block went one by one
        keys = self._bounded_keys(local_hashes, pos, max(key, MIN_KEY) if pos else 0)
        masks = self._holders.words_of(self._keys.get(keys, default=0))
        # Each slot's bit evolves on its own under the cumulative AND, set on a prefix of the
        # rows: the slot's contiguous match is the number of rows with its bit set.
        held = np.bitwise_and.accumulate(masks, axis=0).view(np.uint8)
        bits = np.unpackbits(held, axis=1, bitorder="little")
        counts = np.add.reduce(bits, axis=0, dtype=_COUNT).tolist()
        col_slot = self._col_slot
        while alive:
            low = alive & -alive
            col = low.bit_length() - 1
            depth = pos + counts[col]
            slot = col_slot[col]
            if depth and slot is not None:
                scores[slot] = depth
            alive ^= low
        return scores

    def _bounded_keys(self, local_hashes: Sequence[int] | np.ndarray, pos: int, parent: int):
        """Prefix keys of `local_hashes[pos:]` (continuing `parent`) up to and including the
        first one found absent, or all of them."""
        n, get1, size = len(local_hashes), self._keys.get1, _FIRST_STAGE
        stages = []
        hashes, it = None, None
        if isinstance(local_hashes, np.ndarray):
            hashes = local_hashes.astype(np.uint64, copy=False)
        else:  # a list: converted stage by stage, through one iterator (no slices)
            it = iter(local_hashes)
            next(itertools.islice(it, pos, pos), None)  # skip the blocks done one by one
        while pos < n:
            count = min(size, n - pos)
            part = (
                hashes[pos : pos + count]
                if hashes is not None
                else np.fromiter(it, np.uint64, count)
            )
            keys = chain_keys(parent, part, clamp=False)
            stages.append(keys)
            parent = keys.item(-1)
            if get1(max(parent, MIN_KEY)) == MISSING:
                lo, hi = -1, keys.size - 1  # keys[lo] present (or the parent), keys[hi] absent
                while hi - lo > _BISECT_STOP:
                    mid = (lo + hi) // 2
                    if get1(max(keys.item(mid), MIN_KEY)) == MISSING:
                        hi = mid
                    else:
                        lo = mid
                stages[-1] = keys[: hi + 1]
                break
            pos += count
            size *= _STAGE_GROWTH
        keys = stages[0] if len(stages) == 1 else np.concatenate(stages)
        return np.maximum(keys, _MIN_KEY, out=keys)

    def _credit_int(self, scores: dict[Slot, int], bits: int, depth: int) -> None:
        col_slot = self._col_slot
        while bits:
            low = bits & -bits
            slot = col_slot[low.bit_length() - 1]
            if slot is not None:
                scores[slot] = depth
            bits ^= low
