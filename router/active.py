"""Active-request tracking: what every (worker, dp_rank) slot is busy with, and the guard that frees it.

The seed is Dynamo's ActiveSequences + RequestGuard. A slot's load, in KV blocks:
- prefill: blocks the slot still has to compute (uncached prompt blocks of its requests),
  each request's part dropped when its prefill is done;
- decode: blocks the slot's live requests occupy. Prompt blocks are counted once per slot
  however many requests share them (a system prompt held by ten requests is one copy in the
  engine's paged cache), as Dynamo counts unique blocks; blocks nobody else can share (a
  prompt's partial last block, output blocks when output tracking is on) are counted per
  request.
Shared prompt blocks are named by prefix keys (`index.chain_keys`): key i names blocks 0..i, so
a slot that holds key i holds every key before it, and "how much of this prompt does the slot
already hold" is a bisection, not a scan. Per slot a `U64Table` counts the live bookings
holding each key; a booking adds or drops its whole chain in one compiled call
(`kernels.count_up` / `count_down`, ~10 ns a key; a Python Counter took ~100), and the slot's
last booking leaving empties it at once (the emptied sums and table wait for the slot's next
booking).

Every booking remembers exactly what it added, so freeing always returns a slot to zero:
nothing drifts, whatever order book / prefill-done / free / cancel arrive in.

Each slot also has a *column*: its row in `sums`, a small int64 matrix (prefill, decode,
requests per slot) kept equal to its `SlotLoad` on every change, so the scheduler reads every
slot's load with one numpy index instead of one Python object per slot per request. `progress`,
by the same column, is when the slot last showed progress (monotonic seconds): a first booking
waiting for the engine, a first output, prefill progress, output tokens, or a KV event
(`progressed`); the `stalled` filter leaves out slots with bookings waiting for the engine
(UNANSWERED) that have shown none for a while.

A `RequestGuard` owns the bookings of one routed request (a prefill slot and/or a decode slot).
Every exit path frees: `free()`, the context manager, cancellation, and garbage collection (with
a warning, since a collected booked guard means a caller forgot to free it).
"""

import functools
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, Self

import numpy as np

from . import kernels
from .prefills import Mark, PendingPrefills
from .table import U64Table

log = logging.getLogger(__name__)

Slot = tuple[int, int]  # (worker_id, dp_rank)

# the columns of `ActiveRequests.sums`; UNANSWERED: bookings whose prefill has not ended yet
# (no first output, not all prompt blocks stored): what the `stalled` filter waits on
PREFILL, DECODE, REQUESTS, UNANSWERED = 0, 1, 2, 3


_NO_KEYS = np.zeros(0, np.uint64)


def as_keys(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    """Prefix keys as the uint64 array the count kernels take (no copy when they are one)."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64 and keys.flags.c_contiguous:
        return keys
    return np.ascontiguousarray(keys, np.uint64) if len(keys) else _NO_KEYS


@dataclass(slots=True, eq=False)
class SlotLoad:
    """Booked load of one slot, the sums of its live bookings."""

    prefill_blocks: int = 0
    private_blocks: int = 0  # decode blocks no other request can share (partial, output)
    requests: int = 0
    # prompt prefix key → bookings holding it (keys ≥ 2, as `index.chain_keys` makes them)
    shared: U64Table = field(default_factory=lambda: U64Table(1024))
    firsts: Counter[int] = field(default_factory=Counter)  # bookings' first keys: a quick test
    column: int = -1  # the slot's row of `ActiveRequests.sums` (-1: a copy, or idle)
    pending: PendingPrefills = field(default_factory=PendingPrefills)  # marks awaited (prefills)
    unanswered: int = 0  # bookings whose prefill has not ended (`Booking.answered`)

    @property
    def decode_blocks(self) -> int:
        return len(self.shared) + self.private_blocks

    def held_prefix(self, keys: Sequence[int] | np.ndarray) -> int:
        """How many leading prompt blocks (prefix `keys`) live requests here already hold."""
        if not len(keys) or int(keys[0]) not in self.firsts:
            return 0
        return kernels.held_prefix(as_keys(keys), *self.shared.parts)

    def copy(self) -> "SlotLoad":
        return SlotLoad(
            self.prefill_blocks,
            self.private_blocks,
            self.requests,
            self.shared.copy(),
            Counter(self.firsts),
            unanswered=self.unanswered,
        )


@dataclass(slots=True)
class Booking:
    """One request's load on one slot; `prefill`/`keys`/`private` are exactly what it added."""

    slot: Slot
    load: "SlotLoad"  # the slot's sums this booking added to (a dropped slot's are orphaned)
    prefill: int
    keys: np.ndarray  # the prompt's prefix keys (uint64), held in `load.shared`
    private: int
    unshared_prompt: int  # prompt blocks without a key (the partial last one, or no keys given)
    expected_output_tokens: int | None
    generated_tokens: int = 0
    live: bool = True
    marks: tuple[Mark, ...] = ()  # the prefill's marks `load.pending` waits on (`prefills`)
    answered: bool = False  # its prefill ended: the engine showed it took the request

    def current(self, loads: dict[Slot, "SlotLoad"]) -> "SlotLoad | None":
        """The sums to update, or None when the booking is freed or its slot was dropped."""
        return self.load if self.live and loads.get(self.slot) is self.load else None


class BookingObserver(Protocol):
    """Told of every booking's lifecycle (replica sync: `replicas.ReplicaSync`)."""

    def booked(self, booking: Booking) -> None: ...

    def changed(self, booking: Booking) -> None: ...  # prefill progress or output tokens

    def freed(self, booking: Booking) -> None: ...


@dataclass
class ActiveRequests:
    """Per-slot booked load. Pure bookkeeping; the scheduler reads `load(slot)` for its cost."""

    block_size: int = 16
    track_output_blocks: bool = False
    # called after a booking is freed (room on a worker: the router's queue tries again)
    on_free: Callable[[], None] | None = field(default=None, compare=False, repr=False)
    observer: BookingObserver | None = field(default=None, compare=False, repr=False)
    _loads: dict[Slot, SlotLoad] = field(default_factory=dict)
    # Guards collected while booked push their bookings here (an atomic deque append) instead
    # of freeing inside __del__, which may run in the middle of another update.
    _orphans: deque[Booking] = field(default_factory=deque)
    # (prefill, decode, requests) per slot column; a slot without live bookings has zeros
    sums: np.ndarray = field(
        default_factory=lambda: np.zeros((64, 4), np.int64), compare=False, repr=False
    )
    # when each slot column last showed progress (monotonic seconds; see the module docstring)
    progress: np.ndarray = field(
        default_factory=lambda: np.zeros(64, np.float64), compare=False, repr=False
    )
    _columns: dict[Slot, int] = field(default_factory=dict, repr=False)
    _free_columns: list[int] = field(default_factory=list, repr=False)
    # the emptied sums of slots that went idle, reused when the slot gets busy again (making
    # one, with its key table, costs more than booking a 512-block prompt)
    _idle_loads: dict[Slot, SlotLoad] = field(default_factory=dict, repr=False)

    def column(self, slot: Slot) -> int:
        """The slot's row of `sums` (assigned on first use; kept until `drop_slot`)."""
        col = self._columns.get(slot)
        if col is None:
            if self._free_columns:
                col = self._free_columns.pop()
            else:
                col = len(self._columns)
                if col == len(self.sums):
                    self.sums = np.concatenate([self.sums, np.zeros_like(self.sums)])
                    self.progress = np.concatenate([self.progress, np.zeros_like(self.progress)])
            self._columns[slot] = col
        return col

    def reap(self) -> None:
        """Free the bookings of guards collected since the last operation (read `sums` after)."""
        self._reap()

    def held_prefixes(self, keys: np.ndarray) -> list[tuple[int, int]]:
        """(column, held) for every slot whose live requests hold a leading part of the prompt
        with prefix `keys` (uint64; `SlotLoad.held_prefix`); other slots hold none of it."""
        if not len(keys):
            return []
        first = int(keys[0])
        held = kernels.held_prefix
        return [
            (load.column, held(keys, *load.shared.parts))
            for load in self._loads.values()
            if first in load.firsts
        ]

    def load(self, slot: Slot) -> SlotLoad:
        """The slot's sums (read-only: an idle slot shares one empty SlotLoad)."""
        self._reap()
        load = self._loads.get(slot)
        return load if load is not None else _idle()

    def loads(self) -> dict[Slot, SlotLoad]:
        """Every slot with a live booking (a copy)."""
        self._reap()
        return {s: v.copy() for s, v in self._loads.items()}

    def total_requests(self) -> int:
        self._reap()
        return sum(v.requests for v in self._loads.values())

    def book(
        self,
        slot: Slot,
        *,
        prompt_blocks: int,
        prefill_blocks: int,
        prompt_keys: Sequence[int] | np.ndarray = (),
        decode: bool = True,
        expected_output_tokens: int | None = None,
    ) -> Booking:
        """Add a request to `slot`: `prefill_blocks` to compute, and (if `decode`) its KV blocks.

        `prompt_keys` are the prefix keys of the prompt's full blocks (`index.chain_keys`,
        shared with other requests on the slot); the other `prompt_blocks` count for this
        request alone."""
        self._reap()
        if prompt_blocks < 0 or prefill_blocks < 0:
            raise ValueError("block counts must be non-negative")
        if len(prompt_keys) > prompt_blocks:
            raise ValueError("more prompt keys than prompt blocks")
        keys = as_keys(prompt_keys) if decode else _NO_KEYS
        load = self._loads.get(slot)
        if load is None:
            load = self._idle_loads.pop(slot, None) or SlotLoad(column=self.column(slot))
            self._loads[slot] = load
        booking = Booking(
            slot=slot,
            load=load,
            prefill=prefill_blocks,
            keys=keys,
            private=0,
            unshared_prompt=prompt_blocks - len(keys) if decode else 0,
            expected_output_tokens=expected_output_tokens if decode else None,
        )
        booking.private = self._private_load(booking)
        load.prefill_blocks += booking.prefill
        load.private_blocks += booking.private
        if keys.size:
            if kernels.count_up(keys, *load.shared.parts) == kernels.NO_ROOM:
                load.shared.reserve(keys.size)
                kernels.count_up(keys, *load.shared.parts)
            load.firsts[int(keys[0])] += 1
        if not load.unanswered:  # a request waits for the engine from now: the stall clock starts
            self.progress[load.column] = time.monotonic()
        load.unanswered += 1
        load.requests += 1
        self._sync(load)
        if self.observer is not None:
            self.observer.booked(booking)
        return booking

    def prefill_done(self, booking: Booking) -> None:
        """The slot finished computing the prompt: drop the prefill part (idempotent)."""
        self.prefill_progress(booking, 0)

    def prefill_progress(self, booking: Booking, remaining: int) -> None:
        """The slot computed part of the prompt: `remaining` blocks are left (never grows)."""
        self._reap()
        remaining = max(0, min(remaining, booking.prefill))
        load = booking.current(self._loads)
        if load is not None:
            load.prefill_blocks -= booking.prefill - remaining
            self.sums[load.column, PREFILL] = load.prefill_blocks
            self.progress[load.column] = time.monotonic()
        changed = remaining != booking.prefill
        booking.prefill = remaining
        if not remaining and not booking.answered:
            booking.answered = True
            if load is not None:
                load.unanswered -= 1
                self.sums[load.column, UNANSWERED] = load.unanswered
        if changed and booking.live and self.observer is not None:
            self.observer.changed(booking)
        if booking.marks:  # marks at or past this point are passed: stop waiting on them
            passed = [mark for mark in booking.marks if mark[1] >= remaining]
            booking.marks = tuple(mark for mark in booking.marks if mark[1] < remaining)
            if load is not None:
                load.pending.unwatch(booking, passed)

    def watch_prefill(self, booking: Booking, marks: tuple[Mark, ...]) -> None:
        """Let the slot's KV events settle the booking's prefill (`prefills.prefill_marks`)."""
        self._reap()
        load = booking.current(self._loads)
        if load is None or not booking.prefill or not marks or booking.marks:
            return
        booking.marks = marks
        load.pending.watch(booking)

    def awaits_stored_blocks(self, slot: Slot) -> bool:
        """Whether a prefill on `slot` waits for its engine to store blocks."""
        load = self._loads.get(slot)
        return load is not None and bool(load.pending)

    def blocks_stored(self, slot: Slot, keys: np.ndarray) -> None:
        """The slot's engine stored blocks with these prefix keys (`KvIndex.apply_batch`): the
        prefills waiting on them progress, or end."""
        self._reap()
        load = self._loads.get(slot)
        if load is None or not load.pending:
            return
        for booking, remaining in load.pending.stored(keys):
            self.prefill_progress(booking, remaining)

    def add_output_tokens(self, booking: Booking, tokens: int) -> None:
        """Account generated tokens: they decay an expected output (`agent_hints.osl`), and
        count as generated blocks when output tracking is on."""
        self._reap()
        if not booking.live or tokens <= 0:
            return
        booking.generated_tokens += tokens
        value = self._private_load(booking)
        load = booking.current(self._loads)
        if load is not None:
            load.private_blocks += value - booking.private
            self.sums[load.column, DECODE] = len(load.shared) + load.private_blocks
            self.progress[load.column] = time.monotonic()
        booking.private = value
        if self.observer is not None:
            self.observer.changed(booking)

    def progressed(self, slot: Slot) -> None:
        """The slot's engine showed it is working (a KV event): not stalled."""
        col = self._columns.get(slot)
        if col is not None:
            self.progress[col] = time.monotonic()

    def free(self, booking: Booking) -> None:
        """Remove the booking entirely (idempotent)."""
        self._reap()
        self._free(booking)
        if self.on_free is not None:
            self.on_free()

    def orphaned(self, booking: Booking) -> None:
        """Called from a guard's finaliser: free at the next operation, not inside __del__."""
        self._orphans.append(booking)

    def drop_slot(self, slot: Slot) -> None:
        """Forget a removed slot's load; its bookings' later updates become no-ops, even if
        the slot comes back."""
        self._reap()
        self._loads.pop(slot, None)
        self._idle_loads.pop(slot, None)
        col = self._columns.pop(slot, None)
        if col is not None:
            self.sums[col] = 0
            self._free_columns.append(col)

    def _free(self, booking: Booking) -> None:
        load = booking.current(self._loads)
        if booking.live and self.observer is not None:
            self.observer.freed(booking)
        booking.live = False
        marks, booking.marks = booking.marks, ()
        if load is None:
            return
        if load.requests == 1:  # the slot's last booking: its sums empty at once
            del self._loads[booking.slot]
            self.sums[load.column] = 0
            load.prefill_blocks = load.private_blocks = load.requests = load.unanswered = 0
            load.shared.clear()
            load.firsts.clear()
            load.pending.clear()
            self._idle_loads[booking.slot] = load  # freed bookings of it are not `live`
            return
        load.requests -= 1
        load.unanswered -= not booking.answered
        load.prefill_blocks -= booking.prefill
        load.private_blocks -= booking.private
        if marks:
            load.pending.unwatch(booking, marks)
        keys = booking.keys
        if keys.size:
            kernels.count_down(keys, *load.shared.parts)
            first = int(keys[0])
            if load.firsts[first] == 1:
                del load.firsts[first]
            else:
                load.firsts[first] -= 1
        self._sync(load)

    def _sync(self, load: SlotLoad) -> None:
        row = self.sums[load.column]
        row[PREFILL] = load.prefill_blocks
        row[DECODE] = len(load.shared) + load.private_blocks
        row[REQUESTS] = load.requests
        row[UNANSWERED] = load.unanswered

    def _private_load(self, booking: Booking) -> int:
        """Unshared prompt blocks, plus the output blocks.

        With an expected output length (`agent_hints.osl`) its blocks are booked from the start,
        whether or not output is tracked, and weigh by the fraction of output still to come as
        tokens are reported (`add_output_tokens`): a request about to finish is about to free
        its blocks. Without one, output tracking counts the generated blocks at full weight.
        """
        base = booking.unshared_prompt
        expected = booking.expected_output_tokens
        if expected:
            remaining = max(0.0, 1.0 - booking.generated_tokens / expected)
            return base + round(math.ceil(expected / self.block_size) * remaining)
        if not self.track_output_blocks or (base == 0 and not booking.keys.size):
            return base
        return base + math.ceil(booking.generated_tokens / self.block_size)

    def _reap(self) -> None:
        while self._orphans:
            self._free(self._orphans.popleft())


@functools.cache
def _idle() -> SlotLoad:
    """The load of every idle slot (one shared, read-only; made on first use, not at import:
    its table would compile the kernels)."""
    return SlotLoad()


class RequestGuard:
    """The bookings of one routed request; every exit path frees them.

    - `mark_prefill_done()`: the first output arrived; the prefill slot (disaggregated) is
      released and the decode slot's prefill part dropped. Idempotent.
    - `awaits_stored_blocks`: the engine's KV events will end the prefill (`prefills`): a
      caller without a sign of the first token (an EPP not reading the response body) leaves
      it to them instead of marking it done at the response headers.
    - `add_output_tokens(n)`: generated tokens, for output-block tracking.
    - `free()`: release everything. Idempotent; also on `with` exit and on garbage collection.
    - `accepted()`: the engine answered the request with a success status (an `open` session
      binds then: `Decision.confirm_session`). Idempotent.
    """

    __slots__ = ("__weakref__", "_active", "_decode", "_prefill", "on_accepted", "request_id")

    def __init__(
        self,
        active: ActiveRequests,
        request_id: str,
        decode: Booking,
        prefill: Booking | None = None,
    ) -> None:
        self._active = active
        self.request_id = request_id
        self._decode = decode
        self._prefill = prefill
        self.on_accepted: Callable[[], None] | None = None

    def accepted(self) -> None:
        callback, self.on_accepted = self.on_accepted, None
        if callback is not None:
            callback()

    @property
    def booked(self) -> bool:
        return self._decode.live or (self._prefill is not None and self._prefill.live)

    @property
    def prefill_done(self) -> bool:
        return self._decode.prefill == 0 and (self._prefill is None or not self._prefill.live)

    @property
    def awaits_stored_blocks(self) -> bool:
        return bool((self._prefill or self._decode).marks)

    def mark_prefill_done(self) -> None:
        if self._prefill is not None:
            self._active.free(self._prefill)
        self._active.prefill_done(self._decode)

    def add_output_tokens(self, tokens: int) -> None:
        self._active.add_output_tokens(self._decode, tokens)

    def free(self) -> None:
        if not self.booked:
            return
        if self._prefill is not None:
            self._active.free(self._prefill)
        self._active.free(self._decode)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            booked = self.booked
        except AttributeError:  # half-built guard
            return
        if booked:
            log.warning("request %s: guard collected while still booked; freeing", self.request_id)
            if self._prefill is not None:
                self._active.orphaned(self._prefill)
            self._active.orphaned(self._decode)
