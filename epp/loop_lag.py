"""How far behind the EPP's event loop runs: its own saturation signal, for admission.

Admission by count (`extproc.Admission`, `--max-pending-picks`) bounds the requests waiting
to be routed, but not the rest of what the loop owes: when the EPP gets more CPU work than it
has CPU (ext_proc messages of every request in flight, the response headers and stream ends
included, KV-event batches, picks), everything that is ready waits its turn, and a request's
answer can come seconds late while few requests are "pending". How late the loop runs its
timers measures exactly that wait, whatever the work is.

`LoopLag` sleeps `interval_s` at a time and notes how late it woke; `behind()` is an
exponentially weighted mean of those delays (each new one weighs `weight`), so one long pause
(a collection, a slow import) reads as behind for a few ticks only, while a backlog, which
makes every tick late, keeps it up.
"""

import asyncio
import time

from dynamograph.router.tasks import cancel_all

INTERVAL_S = 0.1  # ~10 wake-ups a second: noise next to the EPP's own when idle
WEIGHT = 0.5  # of the newest delay in the mean


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S, weight: float = WEIGHT):
        self.interval_s = interval_s
        self.weight = weight
        self._behind = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    def behind(self) -> float:
        """Seconds the loop runs late (the weighted mean of its timers' recent delays)."""
        return self._behind

    async def _run(self) -> None:
        while True:
            due = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            late = max(0.0, time.monotonic() - due)
            self._behind += self.weight * (late - self._behind)

    async def close(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None
