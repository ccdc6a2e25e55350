"""Keeping a running stack running: restart what dies, with bounded exponential back-off.

`dynamograph up` (foreground or `--detach`) calls `Supervisor.tick` a few times a second. A
process that exits is restarted with the same command line, ports and log file (appended) after
a delay that doubles with each failure in a row (`RestartPolicy`); a process that ran
`stable_after` seconds before dying starts a new series. After `give_up_after` failures in a
row it is left down ("given-up"): a component that fails at once every time (a port taken, a
bad flag) costs a handful of restarts, not a storm. An engine given up takes its sidecars with
it (the pod is gone); the rest of the graph keeps running, so `--status` can show what happened.

Every death, restart and give-up is one JSON line in `<run dir>/logs/supervisor.log`; the
returned events are the human lines `up` prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from .stack import BACKING_OFF, GIVEN_UP, RUNNING, STARTING, Running, Stack, probe

LOG_NAME = "supervisor.log"


@dataclass(frozen=True)
class RestartPolicy:
    first_delay: float = 0.5  # seconds before the first restart of a series
    max_delay: float = 30.0
    stable_after: float = 30.0  # a process that ran this long before dying starts a new series
    give_up_after: int = 5  # failures in a row (each within stable_after of its start)

    def delay(self, failures: int) -> float:
        return min(self.first_delay * 2 ** (failures - 1), self.max_delay)


class Supervisor:
    """Restarts the processes of one stack; `tick` does one round of watching."""

    def __init__(self, stack: Stack, policy: RestartPolicy | None = None):
        self.stack = stack
        self.policy = policy or RestartPolicy()
        self.log_path: Path = stack.run_dir / "logs" / LOG_NAME
        self.events: list[str] = []  # every event `run` saw, oldest first

    async def run(
        self,
        stop: asyncio.Event,
        each_round: Callable[[list[str]], Awaitable[None]] | None = None,
        interval: float = 0.25,
    ) -> None:
        """Tick until `stop` is set; `each_round` gets every round's events (maybe none)."""
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                events = await self.tick(session)
                self.events.extend(events)
                if each_round is not None:
                    await each_round(events)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=interval)

    async def tick(self, session: aiohttp.ClientSession) -> list[str]:
        """Notice deaths, start what is due, mark restarted processes ready; the events."""
        now = time.monotonic()
        events = [await self._died(proc, now) for proc in self.stack.reap() if not proc.stopped]
        for proc in self.stack.running:
            if proc.state == BACKING_OFF and proc.restart_at is not None and proc.restart_at <= now:
                self.stack.respawn(proc)
                proc.restarts += 1
                proc.state = STARTING
                # An event of its own: the state file must name the new pid at once.
                events.append(f"{_stamp()} {proc.spec.name} starting (restart {proc.restarts})")
        starting = [p for p in self.stack.running if p.state == STARTING]
        ready = await asyncio.gather(*(probe(session, p.spec.ready) for p in starting))
        for proc, ok in zip(starting, ready, strict=True):
            if ok and proc.poll() is None:
                proc.state = RUNNING
                self._log("info", proc, "ready again")
                events.append(f"{_stamp()} {proc.spec.name} is back (restart {proc.restarts})")
        return events

    async def _died(self, proc: Running, now: float) -> str:
        proc.last_exit = proc.describe_exit()
        if now - proc.spawned >= self.policy.stable_after:
            proc.failures = 0
        proc.failures += 1
        what = f"{_stamp()} {proc.spec.name} {proc.last_exit}"
        if proc.failures >= self.policy.give_up_after:
            proc.state, proc.restart_at = GIVEN_UP, None
            message = (
                f"gave up after {proc.failures} failures in a row "
                f"(each within {self.policy.stable_after:.0f}s of its start); "
                f"see its log {proc.log}, fix the cause and run `dynamograph up` again"
            )
            self._log("error", proc, message)
            if proc.spec.kind == "engine":
                # The pod is gone for good: its sidecars go with it, as in Kubernetes.
                for sidecar in self.stack.sidecars_of(proc):
                    await asyncio.to_thread(self.stack.stop_one, sidecar, "with its engine")
            return f"{what}; {message}"
        delay = self.policy.delay(proc.failures)
        proc.state, proc.restart_at = BACKING_OFF, now + delay
        self._log("warning", proc, f"restarting in {delay:g}s", delay_s=delay)
        return f"{what}; restarting in {delay:g}s (log: {proc.log})"

    def _log(self, level: str, proc: Running, message: str, **extra: float) -> None:
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "level": level,
            "message": message,
            "process": proc.spec.name,
            "kind": proc.spec.kind,
            "state": proc.state,
            "restarts": proc.restarts,
            "failures_in_a_row": proc.failures,
            "last_exit": proc.last_exit,
            "pid": proc.pid,
            **extra,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as out:
            out.write(json.dumps(line) + "\n")


@contextlib.asynccontextmanager
async def supervised(
    stack: Stack, policy: RestartPolicy | None = None, ready_within: float = 180.0
) -> AsyncIterator[Supervisor]:
    """Start `stack`, keep it running while the block runs, stop it all after: `up` embedded in
    another program (the soak benchmark, the fault-injection suite)."""
    supervisor = Supervisor(stack, policy)
    stop = asyncio.Event()
    try:
        await stack.start(ready_within)
        task = asyncio.create_task(supervisor.run(stop))
        try:
            yield supervisor
        finally:
            stop.set()
            await task
    finally:
        await asyncio.to_thread(stack.stop)


def _stamp() -> str:
    return time.strftime("%H:%M:%S")
