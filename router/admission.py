"""What a router process (the EPP, a kv-mode frontend) admits: overload is a fast answer.

`Admission` bounds the requests admitted and not yet routed (`--max-pending-picks`) and admits
none while the event loop runs behind (`--max-loop-lag`); past either, a new request is refused
at once with 429 and Retry-After instead of queueing seconds of work.

The count bounds the requests waiting to be routed, but not the rest of what the loop owes: when
the process gets more CPU work than it has CPU (for the EPP: ext_proc messages of every request
in flight, the response headers and stream ends included, KV-event batches, picks; for a
frontend: the responses it relays too), everything that is ready waits its turn, and a request's
answer can come seconds late while few requests are "pending". How late the loop runs its
timers (`LoopLag`) measures exactly that wait, whatever the work is.

`LoopLag` sleeps `interval_s` at a time and notes how late it woke. A backlog makes every
wake-up late; one long pause (a collection, a slow import) makes one late, and the loop keeps
time again right after it, when the requests that waited through the pause are finally
served. So a delay counts only as far as the wake-up before it was late too (the smaller of
the two), and after a late wake-up the next comes after `recheck_s` instead of `interval_s`:
a pause is told from a backlog within milliseconds, not by refusing requests for several
ticks. `behind()` is an exponentially weighted mean of the counted delays (each new one weighs
`weight`).
"""

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from dynamograph.protocol.openai import OpenAIError

from .tasks import cancel_all

INTERVAL_S = 0.1  # ~10 wake-ups a second: noise next to the EPP's own when idle
RECHECK_S = 0.01  # after a late wake-up: is the loop still behind, or was it one pause?
LATE_S = 0.005  # a wake-up later than this is late (timers are a fraction of a ms off when idle)
WEIGHT = 0.5  # of the newest delay in the mean
# Requests admitted and not yet routed, at most: ~0.25 s of picks at 1 ms each, so a client
# refused with 429 learns it at once instead of after seconds of queueing behind the others.
DEFAULT_MAX_PENDING_PICKS = 256
# A loop this far behind answers everything it owes that late: refuse new requests
DEFAULT_MAX_LOOP_LAG_S = 0.5


class LoopLag:
    def __init__(
        self, interval_s: float = INTERVAL_S, weight: float = WEIGHT, recheck_s: float = RECHECK_S
    ):
        self.interval_s = interval_s
        self.recheck_s = recheck_s
        self.weight = weight
        self._behind = 0.0
        self._task: asyncio.Task[None] | None = None

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


@dataclass(frozen=True)
class AdmissionLimits:
    """`--max-pending-picks` and `--max-loop-lag` (seconds; 0: the loop's lag not checked)."""

    max_pending_picks: int = DEFAULT_MAX_PENDING_PICKS
    max_loop_lag_s: float = DEFAULT_MAX_LOOP_LAG_S


class Admission:
    """Bounds the requests admitted and not yet routed (for the EPP: their body still arriving,
    their prompt being tokenized, or waiting for the event loop) to `limits.max_pending_picks`,
    and admits none while the loop runs more than `limits.max_loop_lag_s` behind (`lag`; a
    limit of 0 or no `lag`: not checked). Past either, a new request is refused at once with
    429 and Retry-After, naming `who` is saturated."""

    __slots__ = ("lag", "max_lag_s", "max_pending", "pending", "retry_after_s", "who")

    def __init__(
        self,
        limits: AdmissionLimits,
        retry_after_s: float = 1.0,
        lag: LoopLag | None = None,
        who: str = "the endpoint picker",
    ):
        self.max_pending = limits.max_pending_picks
        self.retry_after_s = retry_after_s
        self.lag = lag
        self.max_lag_s = limits.max_loop_lag_s
        self.who = who
        self.pending = 0

    def enter(self) -> None:
        if self.pending >= self.max_pending:
            self._refuse(f"{self.pending} requests waiting to be routed")
        if self.lag is not None and self.max_lag_s > 0:
            behind = self.lag.behind()
            if behind > self.max_lag_s:
                self._refuse(f"its event loop runs {behind * 1e3:.0f} ms behind")
        self.pending += 1

    def _refuse(self, why: str) -> None:
        raise OpenAIError(
            429,
            f"{self.who} is saturated ({why}); retry after {self.retry_after_s:g} s",
            retry_after_s=self.retry_after_s,
        )

    def leave(self) -> None:
        self.pending -= 1


def export_admission(
    admission: Admission, lag: LoopLag, prefix: str, registry: CollectorRegistry
) -> None:
    """`<prefix>loop_lag_seconds` and `<prefix>pending_picks`, read at each scrape."""
    Gauge(
        prefix + "loop_lag_seconds",
        "how late the event loop runs its timers (weighted mean): past --max-loop-lag, new "
        "requests get 429",
        registry=registry,
    ).set_function(lag.behind)
    Gauge(
        prefix + "pending_picks",
        "requests admitted and not yet routed: at --max-pending-picks, new ones get 429",
        registry=registry,
    ).set_function(lambda: admission.pending)


def add_admission_arguments(parser: argparse.ArgumentParser, *, who: str, env_prefix: str) -> None:
    """The admission flags of a router process (`who`: the EPP, a kv-mode frontend), their
    environment variables `<env_prefix>_MAX_PENDING_PICKS` and `<env_prefix>_MAX_LOOP_LAG`."""
    group = parser.add_argument_group(
        f"overload: what {who} admits; past it a new request gets 429 with Retry-After at once"
    )
    group.add_argument(
        "--max-pending-picks",
        type=int,
        default=None,
        help="requests admitted and not yet routed, at most; past it a new request gets 429 "
        f"with Retry-After at once instead of queueing (default ${env_prefix}_MAX_PENDING_PICKS, "
        f"else {DEFAULT_MAX_PENDING_PICKS})",
    )
    group.add_argument(
        "--max-loop-lag",
        type=float,
        default=None,
        help="seconds the event loop may run behind (a weighted mean of its timers' delays: "
        f"{who} short of CPU); past it a new request gets 429 with Retry-After at once; 0: off "
        f"(default ${env_prefix}_MAX_LOOP_LAG, else {DEFAULT_MAX_LOOP_LAG_S:g})",
    )


def admission_given(args: argparse.Namespace) -> bool:
    """Whether the admission flags were given on the command line."""
    return args.max_pending_picks is not None or args.max_loop_lag is not None


def admission_limits(args: argparse.Namespace, *, env_prefix: str) -> AdmissionLimits:
    """The flags of `add_admission_arguments`, else their environment variables, else the
    defaults; ValueError naming the flag for a value that cannot be a limit."""
    pending = args.max_pending_picks
    if pending is None:
        pending = int(os.environ.get(f"{env_prefix}_MAX_PENDING_PICKS", DEFAULT_MAX_PENDING_PICKS))
    lag = args.max_loop_lag
    if lag is None:
        lag = float(os.environ.get(f"{env_prefix}_MAX_LOOP_LAG", DEFAULT_MAX_LOOP_LAG_S))
    if pending < 1:
        raise ValueError(f"--max-pending-picks must be at least 1, not {pending}")
    if not lag >= 0:  # NaN too
        raise ValueError(f"--max-loop-lag must be a number of seconds ≥ 0, not {lag}")
    return AdmissionLimits(pending, lag)
