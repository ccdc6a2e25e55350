"""Session KV pinning (`nvext.session_control`): a session's blocks stay cached between turns.

`action: open` (or any request naming a known session) pins the blocks of the turn that just
finished, replacing the previous turn's pin; `action: close` releases them after that request;
a session idle for `timeout` seconds (wall clock) is closed by the engine's sweep.
"""

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Pin:
    blocks: list[int]
    timeout: float
    last_used: float


class SessionPins:
    def __init__(self) -> None:
        self._pins: dict[str, Pin] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    def pin(self, session_id: str, blocks: list[int], timeout: float) -> list[int]:
        """Pin `blocks` (references already taken); returns the previous pin's blocks to release."""
        old = self._pins.get(session_id)
        self._pins[session_id] = Pin(list(blocks), timeout, time.monotonic())
        return old.blocks if old else []

    def close(self, session_id: str) -> list[int]:
        pin = self._pins.pop(session_id, None)
        return pin.blocks if pin else []

    def expired(self) -> list[list[int]]:
        now = time.monotonic()
        gone = [sid for sid, p in self._pins.items() if now - p.last_used >= p.timeout]
        return [self._pins.pop(sid).blocks for sid in gone]

    def evict_oldest(self) -> list[int]:
        """Give up the least recently used pin (when pins alone keep a request from running)."""
        if not self._pins:
            return []
        sid = min(self._pins, key=lambda s: self._pins[s].last_used)
        return self._pins.pop(sid).blocks

    def drain_all(self) -> list[list[int]]:
        pins, self._pins = [p.blocks for p in self._pins.values()], {}
        return pins
