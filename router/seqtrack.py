"""Sequence tracking of KV event batches per (worker, dp_rank): in order, duplicate or gap.

vLLM numbers every published batch per publisher (one per DP rank). A subscriber that missed
batches (slow joiner, dropped frames, EPP restart) asks the replay socket for everything from the
first missing number; a batch that arrives out of that order is held back (not applied) until the
replay has filled the gap. A publisher restart shows as the sequence starting over at 0.
"""

from dataclasses import dataclass
from enum import Enum

Slot = tuple[int, int]


@dataclass(frozen=True, slots=True)
class GapInfo:
    """Batches `start_seq .. got_seq - 1` of this slot were missed: replay from `start_seq`."""

    worker_id: int
    dp_rank: int
    start_seq: int
    got_seq: int


class Verdict(Enum):
    APPLY = "apply"  # next in order (or the first one seen): apply it
    DUPLICATE = "duplicate"  # already applied (replay overlap): skip
    RESTART = "restart"  # the publisher started over: clear the slot, then apply
    GAP = "gap"  # batches were missed: hold this one back, replay


class SequenceTracker:
    def __init__(self) -> None:
        self._last: dict[Slot, int] = {}

    def check(self, slot: Slot, seq: int) -> Verdict:
        """Classify `seq` for `slot`; APPLY and RESTART advance the slot's last sequence."""
        last = self._last.get(slot)
        if last is None or seq == last + 1:
            self._last[slot] = seq
            return Verdict.APPLY
        if seq == 0 and last > 0:
            self._last[slot] = seq
            return Verdict.RESTART
        if seq <= last:
            return Verdict.DUPLICATE
        return Verdict.GAP

    def expected(self, slot: Slot) -> int | None:
        last = self._last.get(slot)
        return None if last is None else last + 1

    def forget(self, slot: Slot) -> None:
        """Start over: the next batch of this slot is accepted whatever its number."""
        self._last.pop(slot, None)
