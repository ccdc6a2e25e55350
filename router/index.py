"""KV index: which (worker, dp_rank) slot holds which prefix of blocks.

Identity of a block. The router hashes each block's tokens itself (`protocol.hashing`, not
chained). The index turns a sequence of those per-block hashes into *prefix keys*: key i
identifies blocks 0..i as a whole, so a block is named by its position in its sequence, the
role the path plays in Dynamo's radix tree. The chaining is a polynomial over Z/2^64,
key_i = P · key_{i-1} + h_i with key_{-1} = 0 (`chain_keys`; keys 0 and 1 are reserved by the
hash tables and map to 2).

Storage, for speed and memory (256 workers × 100k blocks):
- one global hash table prefix key → the slots holding it (one int32: the one holder's column,
  or a shared bitmask in `holders.py` with one bit per slot column). A block's *row* is its
  key's cell in that table, so one probe gives both; a cell nobody holds any more becomes a
  tombstone, and a rebuild of the table (growth) moves rows, renumbered in every slot's table;
- per slot a table engine block hash → row, for BlockRemoved and for finding a BlockStored's
  parent (the engine's hashes are opaque: we never compute them).

The work per message runs in compiled kernels (`kernels.py`, numba) over those arrays: an event
is one kernel call whatever its size (this class makes room in the tables first), and
`find_matches` walks the query's prefix keys, ANDing the slots' bits block by block, until the
first block nobody holds. A query given as a Python list is converted to an array in stages as
the walk goes on (converting a Python int costs more than probing for it).

Semantics versus Dynamo's RadixTree (the differential oracle): equal on event streams a vLLM
engine produces — blocks stored under a parent the engine holds, evicted leaves first; a
BlockStored whose parent is unknown is skipped in both. Differences, on purpose: a BlockRemoved
of a block whose descendants the slot still holds removes just that block here (Dynamo drops
the whole subtree), so if the engine stores it again the descendants count again, as they do in
the engine's own prefix cache; and engine hashes are kept per slot, so two workers may name the
same prefix differently (Dynamo 1.6.1 keeps one engine hash per tree node).
"""

import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dynamograph.protocol.hashing import (
    BLOCK_HASH_SEED,
    KERNEL_BLOCK_SIZES,
    block_hash_array,
    kernel_constants,
)
from dynamograph.protocol.kv_events import (
    HASH_END,
    HASH_START,
    AllBlocksCleared,
    Batch,
    BlockRemoved,
    BlockStored,
    KvEvent,
    ParsedBatch,
    engine_hash_key,
)

from . import kernels
from .holders import Holders
from .table import U64Table

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (worker_id, dp_rank)

_U64 = (1 << 64) - 1
# find_matches converts a query given as a list in stages of this many blocks, then 4× more
# each time, until a block nobody holds ends the walk (a typical query stops long before its
# end, and converting Python ints costs ~30 ns each; a stage costs a kernel call, ~3 µs).
FIRST_STAGE = 64
_STAGE_GROWTH = 4
# A slot's engine-hash table starts this big (24 KB): engines cache thousands of blocks, and each
# doubling on the way there re-inserts every key.
_SLOT_CAPACITY = 1024
_NO_MATCH = np.zeros(0, np.int64)
_NO_MATCH.flags.writeable = False


def as_u64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Block hashes as a contiguous uint64 array (no copy when they already are one)."""
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, np.uint64)
    return np.fromiter(values, np.uint64, len(values))


def chain_keys(parent_key: int, hashes: np.ndarray) -> np.ndarray:
    """Prefix keys of `hashes` (uint64) continuing the prefix whose key is `parent_key` (0:
    none), as the index names blocks (reserved values clamped to 2)."""
    return kernels.prefix_keys(parent_key, as_u64(hashes))


def engine_keys(hashes: Sequence[int | bytes] | np.ndarray) -> np.ndarray:
    """Engine block hashes (ints, possibly negative or wider than 64 bits, or bytes) as uint64
    (the kernels map the reserved values 0 and 1 to 2)."""
    try:
        return np.ascontiguousarray(hashes, np.uint64)
    except (OverflowError, TypeError, ValueError):
        return np.array([_fold64(engine_hash_key(h)) for h in hashes], dtype=np.uint64)


def engine_key(value: int | bytes) -> int:
    """One engine block hash as an int in [0, 2^64) (the scalar twin of `engine_keys`; the
    kernels take Python ints for uint64 arguments, cheaper than building a numpy scalar)."""
    if isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or not 0 <= value <= _U64:
        value = _fold64(engine_hash_key(value))
    return value


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
        # prefix key → which slots hold it; a key's cell number is its row (see kernels.py)
        self._keys = U64Table(capacity=1024, max_load=0.5)
        self._holders = Holders()
        self._slots: dict[Slot, _SlotState] = {}
        self._col_slot: list[Slot | None] = []
        self._free_cols: list[int] = []
        self._approx: deque[tuple[float, Slot, np.ndarray]] = deque()
        self._parts()

    def _parts(self) -> None:
        """The kernels' bitmask arguments and find_matches' scratch (the slots' bits still
        alive, (column, depth) pairs found); renewed whenever the bitmask matrix is replaced.
        The key table's arrays are not kept here: its rebuild frees them before allocating."""
        self._holder_parts = self._holders.parts
        words = self._holders.words
        self._alive = np.empty(words, np.uint64)
        self._found = np.empty(128 * words, np.int64)

    # -- slots -----------------------------------------------------------------------------
    def _slot(self, slot: Slot) -> _SlotState:
        state = self._slots.get(slot)
        if state is None:
            if self._free_cols:
                col = self._free_cols.pop()
                self._col_slot[col] = slot
            else:
                col = len(self._col_slot)
                if self._holders.ensure_columns(col + 1):
                    self._parts()
                self._col_slot.append(slot)
            state = self._slots[slot] = _SlotState(col)
        return state

    def column(self, slot: Slot) -> int:
        """The slot's column (its bit in the holder bitmasks; registers the slot if new). It
        stays the slot's until `remove_slot`."""
        return self._slot(slot).column

    @property
    def column_count(self) -> int:
        """Columns handed out so far (a freed column is reused before a new one is made)."""
        return len(self._col_slot)

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
            + self._holders.nbytes
            + sum(s.blocks.nbytes for s in self._slots.values())
        )

    # -- room ------------------------------------------------------------------------------
    def _reserve(self, state: _SlotState, n: int) -> None:
        """Room for `n` new blocks on `state`'s slot: keys and bitmask rows (the kernels never
        allocate; the store kernel says when it lacks room)."""
        state.blocks.reserve(n)
        moved = self._keys.reserve_moving(n)
        if moved is not None:  # rows are key cells, and the cells moved: renumber every slot
            for other in self._slots.values():
                kernels.renumber(other.blocks.keys, other.blocks.vals, moved)
        if self._holders.reserve(n):
            self._parts()

    # -- events ----------------------------------------------------------------------------
    def apply_batch(
        self,
        slot: Slot,
        batch: Batch,
        block_size: int,
        lora_names: Mapping[int, str] | None = None,
        *,
        want_stored: bool = True,
    ) -> list[np.ndarray]:
        """`apply_events` of a batch's events; a batch the compiled parser read, of a pool whose
        blocks the compiled hasher takes, in one kernel call (`kernels.apply_rows`) instead of
        a few per event. The rows it leaves (AllBlocksCleared, LoRA blocks, another block
        size, counts that disagree) go through `apply_events`, in their place in the order.
        Without `want_stored` (no prefill on the slot waits for blocks) no keys are returned
        (an empty list), and the kernel's are not sliced out of its output."""
        if not isinstance(batch, ParsedBatch) or block_size not in KERNEL_BLOCK_SIZES:
            kept = self.apply_events(slot, batch.events, lora_names)
            return kept if want_stored else []
        meta = batch.meta
        rows = len(meta)
        state = self._slot(slot)
        keys = np.empty(batch.hashes.size, np.uint64)
        codes = np.zeros(rows, np.int64)
        hashing = (block_size, *kernel_constants(block_size, BLOCK_HASH_SEED))
        stored: list[np.ndarray] = []
        row = 0
        while row < rows:
            row = kernels.apply_rows(
                row, meta, batch.hashes, batch.tokens, *hashing, state.column, keys, codes,
                *state.blocks.parts, *self._keys.parts, *self._holder_parts,
            )  # fmt: skip
            if row == rows:
                break
            if codes[row] == kernels.NO_ROOM:  # now and then: grow, and go on from that row
                self._reserve(state, int(meta[row, HASH_END] - meta[row, HASH_START]))
                continue
            kept = self.apply_events(slot, [batch.event(row)], lora_names)
            stored += kept if want_stored else []
            row += 1
        if want_stored:
            for row in np.flatnonzero(codes == kernels.STORED).tolist():
                stored.append(keys[meta[row, HASH_START] : meta[row, HASH_END]])
        return stored

    def apply_events(
        self, slot: Slot, events: Sequence[KvEvent], lora_names: Mapping[int, str] | None = None
    ) -> list[np.ndarray]:
        """Apply vLLM events of one slot, in order. A BlockStored's blocks hash under its
        `lora_name`; from engines that send only `lora_id`, under the name `lora_names` maps it
        to (an id missing there hashes as `lora-<id>`, so it matches no request). Returns the
        prefix keys of each BlockStored the slot now holds, as requests name them (what the
        prefills waiting on those blocks need, without looking the engine hashes up again)."""
        stored: list[np.ndarray] = []
        for event in events:
            if isinstance(event, BlockStored):
                lora = event.lora_name  # the engine's own name for the adapter, when it sends one
                if lora is None and event.lora_id:
                    lora = (lora_names or {}).get(event.lora_id) or f"lora-{event.lora_id}"
                hashes = block_hash_array(event.token_ids, event.block_size, lora)
                engine = event.block_hashes
                if hashes.size != len(engine):
                    log.warning(
                        "slot %s: BlockStored with %d block hashes but %d full blocks of tokens",
                        slot,
                        len(engine),
                        hashes.size,
                    )
                    n = min(hashes.size, len(engine))
                    engine, hashes = engine[:n], hashes[:n]
                keys = self.store(slot, engine, event.parent_block_hash, hashes)
                if keys is not None and keys.size:
                    stored.append(keys)
            elif isinstance(event, BlockRemoved):
                self.remove(slot, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.clear(slot)
        return stored

    def store(
        self,
        slot: Slot,
        engine_hashes: Sequence[int | bytes] | np.ndarray,
        parent_engine_hash: int | bytes | None,
        local_hashes: Sequence[int] | np.ndarray,
    ) -> np.ndarray | None:
        """Record blocks stored on `slot` (our per-block hashes given): the prefix keys of the
        blocks stored; None when the parent is unknown to this slot (the event is skipped, as
        Dynamo does)."""
        n = len(engine_hashes)
        if n != len(local_hashes):
            raise ValueError(f"{n} engine block hashes for {len(local_hashes)} block hashes")
        keys = np.empty(n, np.uint64)
        if n == 0:
            return keys
        state = self._slot(slot)
        if parent_engine_hash is None:
            parent, has_parent = 0, False
        else:
            parent, has_parent = engine_key(parent_engine_hash), True
        args = (engine_keys(engine_hashes), as_u64(local_hashes), parent, has_parent)
        code = kernels.store_blocks(
            *args, state.column, keys, *state.blocks.parts, *self._keys.parts, *self._holder_parts
        )
        if code == kernels.NO_ROOM:  # now and then: grow what could run out, and again
            self._reserve(state, n)
            code = kernels.store_blocks(
                *args, state.column, keys, *state.blocks.parts, *self._keys.parts,
                *self._holder_parts,
            )  # fmt: skip
        if code != kernels.STORED:
            log.debug("slot %s: BlockStored parent unknown; skipped", slot)
            return None
        return keys

    def remove(self, slot: Slot, engine_hashes: Sequence[int | bytes] | np.ndarray) -> None:
        state = self._slots.get(slot)
        if state is None or len(engine_hashes) == 0:
            return
        self._remove(state, engine_keys(engine_hashes))

    def _remove(self, state: _SlotState, engine: np.ndarray) -> None:
        kernels.remove_blocks(
            engine, state.column, *state.blocks.parts, *self._keys.parts, *self._holder_parts
        )

    def clear(self, slot: Slot) -> None:
        """AllBlocksCleared: the slot holds nothing (it stays known)."""
        state = self._slots.get(slot)
        if state is None:
            return
        self._remove(state, state.blocks.live_keys())
        state.blocks = U64Table(_SLOT_CAPACITY)
        state.expiry.clear()

    def remove_slot(self, slot: Slot) -> None:
        state = self._slots.get(slot)
        if state is None:
            return
        self._remove(state, state.blocks.live_keys())
        del self._slots[slot]
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
        keys = chain_keys(0, hashes)
        self.store(slot, keys, None, hashes)  # the key doubles as engine hash
        state = self._slots[slot]
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
        """{slot: number of leading blocks of the request the slot holds}, for slots with > 0.

        The kernel walks the request's prefix keys, ANDing each slot's bit with the holders of
        each block, and stops at the first block nobody holds. A list is converted to an array
        in stages (64 blocks, then 256, 1,024 …) as the walk goes on."""
        found = iter(self._match(local_hashes).tolist())  # column, depth, column, depth …
        col_slot = self._col_slot
        return {col_slot[col]: next(found) for col in found}

    def match_columns(self, local_hashes: Sequence[int] | np.ndarray) -> np.ndarray:
        """`find_matches` by slot column (`column(slot)`): an int64 array of (column, depth)
        pairs, for slots with depth > 0 — what the scheduler scatters into its columns."""
        return self._match(local_hashes).reshape(-1, 2)

    def _match(self, local_hashes: Sequence[int] | np.ndarray) -> np.ndarray:
        n = len(local_hashes)
        if n == 0 or not self._slots:
            return _NO_MATCH
        alive, out, parts = self._alive, self._found, (*self._keys.parts, self._holders.shared)
        match = kernels.match_prefix
        if isinstance(local_hashes, np.ndarray):
            hashes = np.ascontiguousarray(local_hashes, np.uint64)
            _, _, nout = match(hashes, 0, 0, True, alive, out, 0, *parts)
        else:
            it = iter(local_hashes)
            depth, size, key, nout = 0, FIRST_STAGE, 0, 0
            while True:
                count = min(size, n - depth)
                part = np.fromiter(it, np.uint64, count)
                last = depth + count == n
                done, key, nout = match(part, depth, key, last, alive, out, nout, *parts)
                if done:
                    break
                depth += count
                size *= _STAGE_GROWTH
        return out[: 2 * nout].copy() if nout else _NO_MATCH
