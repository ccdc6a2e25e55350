"""How far behind the EPP's event loop runs: its own saturation signal, for admission.

Admission by count (`extproc.Admission`, `--max-pending-picks`) bounds the requests waiting
to be routed, but not the rest of what the loop owes: when the EPP gets more CPU work than it
has CPU (ext_proc messages of every request in flight, the response headers and stream ends
included, KV-event batches, picks), everything that is ready waits its turn, and a request's
answer can come seconds late while few requests are "pending". How late the loop runs its
timers measures exactly that wait, whatever the work is.

`LoopLag` sleeps `interval_s` at a time and notes how late it woke. A backlog makes every
wake-up late; one long pause (a collection, a slow import) makes one late, and the loop keeps
time again right after it, when the requests that waited through the pause are finally
served. So a delay counts only as far as the wake-up before it was late too (the smaller of
the two), and after a late wake-up the next comes after `recheck_s` instead of `interval_s`:
a pause is told from a backlog within milliseconds, not by refusing requests for several
ticks. `behind()` is an exponentially weighted mean of the counted delays (each new one weighs
`weight`).
"""

import asyncio
import time

from dynamograph.router.tasks import cancel_all

INTERVAL_S = 0.1  # ~10 wake-ups a second: noise next to the EPP's own when idle
RECHECK_S = 0.01  # after a late wake-up: is the loop still behind, or was it one pause?
LATE_S = 0.005  # a wake-up later than this is late (timers are a fraction of a ms off when idle)
WEIGHT = 0.5  # of the newest delay in the mean


class LoopLag:
    def __init__(
        self, interval_s: float = INTERVAL_S, weight: float = WEIGHT, recheck_s: float = RECHECK_S
    ):
        self.interval_s = interval_s
        self.recheck_s = recheck_s
        self.weight = weight
        self._behind = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    def behind(self) -> float:
        """Seconds the loop runs late (the weighted mean of its timers' recent delays, each
        counted as far as the one before it was late too)."""
        return self._behind

    async def _run(self) -> None:
        previous = 0.0
        while True:
            pause = self.recheck_s if previous > LATE_S else self.interval_s
            due = time.monotonic() + pause
            await asyncio.sleep(pause)
            late = max(0.0, time.monotonic() - due)
            self._behind += self.weight * (min(late, previous) - self._behind)
            previous = late

    async def close(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None
