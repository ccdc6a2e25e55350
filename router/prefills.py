"""Pending prefills, settled by the engine's KV events.

Prefill completion has two witnesses: the first output token (the caller's
`RequestGuard.mark_prefill_done`) and, with KV events on, the engine storing the prompt's blocks
on the booked slot (chunk by chunk, so a long prefill's booked load shrinks as it progresses).
The second matters behind a gateway: for a non-streaming answer the EPP sees no output before
the whole answer, and would otherwise count the prefill as pending until the end.
"""

import numpy as np

from .active import ActiveRequests, Booking
from .index import KvIndex

Slot = tuple[int, int]

# freed bookings leave a slot's list only when its events come; past this many, prune it
_PRUNE_AT = 64


class PendingPrefills:
    def __init__(self, index: KvIndex, active: ActiveRequests) -> None:
        self.index = index
        self.active = active
        # per slot, bookings whose prefill is pending, with their prompt hashes and blocks
        self._pending: dict[Slot, list[tuple[Booking, np.ndarray, int]]] = {}

    def watch(self, booking: Booking, hashes: np.ndarray, prompt_blocks: int) -> None:
        entries = self._pending.setdefault(booking.slot, [])
        entries.append((booking, hashes, prompt_blocks))
        if len(entries) > _PRUNE_AT:
            entries[:] = [e for e in entries if e[0].live and e[0].prefill]

    def waiting_on(self, slot: Slot) -> bool:
        return slot in self._pending

    def settle(self, slot: Slot) -> None:
        """Pending prefills on `slot` shrink to the prompt blocks its engine hasn't stored yet
        (a chunked prefill stores each chunk's blocks as it goes); all stored = done."""
        pending = []
        for entry in self._pending[slot]:
            booking, hashes, prompt_blocks = entry
            if not booking.live or booking.prefill == 0:
                continue
            stored = self.index.find_matches(hashes).get(slot, 0)
            if stored >= len(hashes):
                self.active.prefill_done(booking)
            else:
                self.active.prefill_progress(booking, prompt_blocks - stored)
                pending.append(entry)
        if pending:
            self._pending[slot] = pending
        else:
            del self._pending[slot]

    def forget(self, slot: Slot) -> None:
        self._pending.pop(slot, None)
