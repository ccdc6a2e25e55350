"""Pending prefills, settled by the engine's KV events.

Prefill completion has two witnesses: the first output token (the caller's
`RequestGuard.mark_prefill_done`) and, with KV events on, the engine storing the prompt's blocks
on the booked slot. The second needs nothing from the response: an EPP that does not read the
response body (the cheap ext_proc mode) learns it as precisely as from the first chunk, since an
engine publishes a step's stored blocks as that step's tokens go out; and for a non-streaming
answer it is the only early sign at all.

A pending prefill waits on *marks*: prefix keys (`index.chain_keys`, the name the index gives a
block at its position in its prompt) of some of its uncached full blocks, each with the prefill
blocks left once the engine has stored it. The last full block's mark leaves nothing (the
partial block after it is computed in the same step); a few evenly spaced marks before it let a
long chunked prefill's booked load shrink as it goes. At most `MAX_MARKS` per request: matching
costs a dict look-up per stored block, watching a few dict entries per request, whatever the
prompt's length.

`PendingPrefills` is one slot's marks. It lives in the slot's `active.SlotLoad` and is changed
only by `active.ActiveRequests`, together with the booking that owns the marks: freeing a
booking (end, error, disconnect, a collected guard) or its prefill ending drops them, so they
cannot outlive it.
"""

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .active import Booking

MAX_MARKS = 16

Mark = tuple[int, int]  # (prefix key of a prompt block, prefill blocks left once it is stored)


def prefill_marks(
    prompt_keys: np.ndarray, cached_blocks: int, prompt_blocks: int
) -> tuple[Mark, ...]:
    """The marks of a prompt whose first `cached_blocks` the slot holds already: its last full
    block and up to `MAX_MARKS - 1` evenly spaced uncached ones before it (none when every
    full block is cached: no event would come)."""
    full = len(prompt_keys)
    if full <= cached_blocks:
        return ()
    step = -(-(full - cached_blocks) // MAX_MARKS)  # ceil
    positions = [*range(cached_blocks + step - 1, full - 1, step), full - 1]
    keys = prompt_keys[positions].tolist()
    return tuple(
        (key, 0 if pos == full - 1 else prompt_blocks - pos - 1)
        for key, pos in zip(keys, positions, strict=True)
    )


class PendingPrefills:
    """One slot's bookings with a pending prefill, by the prefix keys of their marks."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[int, list[Booking]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        """Marks waited on (for tests and leak checks)."""
        return sum(map(len, self._waiting.values()))

    def watch(self, booking: "Booking") -> None:
        for key, _ in booking.marks:
            self._waiting.setdefault(key, []).append(booking)

    def unwatch(self, booking: "Booking", marks: Iterable[Mark]) -> None:
        for key, _ in marks:
            waiting = self._waiting.get(key)
            if waiting is None:
                continue
            waiting[:] = [b for b in waiting if b is not booking]
            if not waiting:
                del self._waiting[key]

    def stored(self, keys: np.ndarray) -> list[tuple["Booking", int]]:
        """Bookings a mark of which is among these just-stored prefix keys, each with the
        prefill blocks it has left (a booking several of whose marks matched: the least)."""
        waiting = self._waiting
        left: dict[int, tuple[Booking, int]] = {}
        for key in keys.tolist():
            bookings = waiting.get(key)
            if bookings is None:
                continue
            for booking in bookings:
                for mark_key, remaining in booking.marks:
                    if mark_key == key:
                        best = left.get(id(booking))
                        if best is None or remaining < best[1]:
                            left[id(booking)] = (booking, remaining)
        return list(left.values())

    def clear(self) -> None:
        self._waiting.clear()
