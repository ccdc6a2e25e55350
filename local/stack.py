"""The local process supervisor: start a plan's processes, wait until ready, watch, stop.

Each process runs in its own session (its own process group), with stdout and stderr in
`<run dir>/logs/<name>.log`, so it outlives `up --detach` and is stopped as a group. Start is by
stage (engines, then frontends and the EPP, then Envoy), each stage waiting for its readiness
probes with bounded polling; a process that exits while starting fails the start with the tail
of its log, after everything already started is stopped. The run directory's `state.json`
records every pid with its kernel start time: `dynamograph down` and `up --status` work from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from . import procs
from .spec import Plan, Probe, ProcessSpec

STATE_FILE = "state.json"

# Supervision states of a process (`local/supervisor.py` moves them; `up --status` shows them).
STARTING, RUNNING, BACKING_OFF, GIVEN_UP = "starting", "running", "backing-off", "given-up"


class StackError(RuntimeError):
    """The stack could not start (a process exited or never became ready)."""


@dataclass
class Running:
    spec: ProcessSpec
    pid: int
    started: int | None  # kernel start time: proves a pid is still ours
    log: Path
    popen: subprocess.Popen | None = None  # only in the process that started it
    exit_code: int | None = None
    stopped: str | None = None  # why the supervisor stopped it on purpose, if it did
    recorded_exit: str | None = None  # how it ended, as the supervisor wrote in the state file
    state: str = RUNNING  # supervision state (STARTING, RUNNING, BACKING_OFF, GIVEN_UP)
    restarts: int = 0
    last_exit: str | None = None  # how its previous run ended (describe_exit), once it died
    failures: int = 0  # deaths in a row, each soon after its start (the back-off's exponent)
    restart_at: float | None = None  # monotonic time of the next start while backing off
    spawned: float = field(default_factory=time.monotonic)
    reaped: bool = False  # reap() has reported this run's end (poll() alone does not count)

    def poll(self) -> int | None:
        """Exit code once the process has ended (negative: killed by that signal)."""
        if self.exit_code is None:
            if self.popen is not None:
                if self.popen.returncode is None and procs.is_live(self.pid):
                    return None
                self.exit_code = self._reap()
            elif not (procs.same_process(self.pid, self.started) and procs.is_live(self.pid)):
                self.exit_code = -1  # ended while nobody was waiting for it; code unknown
        return self.exit_code

    def _reap(self) -> int:
        """Reap a process that ended, after killing what it left in its process group.

        A helper the process forked (vLLM's engine core and workers, a tokenizer pool) outlives
        it otherwise, holding GPU memory and ports its restart needs; in Kubernetes a container's
        other processes die with its main one too. Signalled while the process is a zombie: its
        pid, which is its group's id, cannot be reused before it is reaped.
        """
        assert self.popen is not None
        if self.popen.returncode is None:
            procs.signal_group(self.pid, signal.SIGKILL)
        return self.popen.wait()

    def describe_exit(self) -> str:
        code = self.exit_code
        if code is None:
            return "running"
        if self.stopped:
            return f"stopped {self.stopped}"
        if self.recorded_exit:
            return self.recorded_exit
        if code < 0 and self.popen is not None:
            return f"killed by signal {-code}"
        return "exited" if self.popen is None else f"exited with code {code}"


class Stack:
    """The processes of one plan, started from this process or re-attached from a state file."""

    def __init__(self, plan: Plan, run_dir: Path):
        self.plan = plan
        self.run_dir = run_dir
        self.running: list[Running] = []

    # --- starting -------------------------------------------------------------------------

    def _spawn(self, spec: ProcessSpec, append: bool = False) -> Running:
        log = self.run_dir / "logs" / f"{spec.name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        popen = procs.spawn(spec.argv, log, env, append=append)  # survives the terminal and `up`
        return Running(spec, popen.pid, procs.start_time(popen.pid), log, popen)

    def respawn(self, proc: Running) -> None:
        """Start a process that ended again, in place: same command line, ports and log (the
        new run's output is appended after the old one's)."""
        if proc.poll() is None:  # the supervisor restarts only what it saw end
            raise StackError(f"{proc.spec.name} is still running: not started again")
        fresh = self._spawn(proc.spec, append=True)
        proc.pid, proc.started, proc.popen = fresh.pid, fresh.started, fresh.popen
        proc.exit_code = proc.recorded_exit = proc.restart_at = None
        proc.spawned, proc.reaped = fresh.spawned, False

    def prepare(self) -> None:
        """Create the run directory and write the plan's files (Envoy's config)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path, content in self.plan.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # the KV-event key folder
            Path(path).write_text(content)

    async def start(self, ready_within: float = 120.0) -> None:
        """Start every stage in order; on failure stop what started and raise StackError."""
        self.prepare()  # a few small files, before any process exists
        try:
            deadline = time.monotonic() + ready_within
            async with aiohttp.ClientSession() as session:
                for stage in sorted({p.stage for p in self.plan.processes}):
                    batch = [self._spawn(p) for p in self.plan.processes if p.stage == stage]
                    self.running.extend(batch)
                    self.save_state()
                    await self._wait_ready(session, batch, deadline)
                await self._wait_serving(session, deadline)
        except BaseException:
            self.stop()
            raise

    async def _wait_ready(
        self, session: aiohttp.ClientSession, batch: list[Running], deadline: float
    ) -> None:
        pending = list(batch)
        while pending:
            for proc in pending:
                if proc.poll() is not None:
                    raise StackError(
                        f"{proc.spec.name} {proc.describe_exit()} while starting; "
                        f"last lines of {proc.log}:\n{procs.log_tail(proc.log)}"
                    )
            ready = await asyncio.gather(*(probe(session, p.spec.ready) for p in pending))
            pending = [p for p, ok in zip(pending, ready, strict=True) if not ok]
            if pending and time.monotonic() > deadline:
                names = ", ".join(p.spec.name for p in pending)
                raise StackError(
                    f"not ready in time: {names}; see the logs in {self.run_dir / 'logs'}"
                )
            if pending:
                await asyncio.sleep(0.2)

    async def _wait_serving(self, session: aiohttp.ClientSession, deadline: float) -> None:
        """Envoy is up and the EPP answers: `GET /v1/models` through the gateway succeeds."""
        url = f"{self.plan.base_url}/models"
        while not await probe(session, Probe("http", url)):
            for proc in self.running:
                if proc.poll() is not None:
                    raise StackError(
                        f"{proc.spec.name} {proc.describe_exit()}; last lines of {proc.log}:\n"
                        f"{procs.log_tail(proc.log)}"
                    )
            if time.monotonic() > deadline:
                raise StackError(f"{url} did not answer 200 in time; logs in {self.run_dir}")
            await asyncio.sleep(0.2)

    # --- watching and stopping ------------------------------------------------------------

    def reap(self) -> list[Running]:
        """Processes that ended since the last call (also when someone else polled them)."""
        ended = [p for p in self.running if not p.reaped and p.poll() is not None]
        for proc in ended:
            proc.reaped = True
        return ended

    def stop(self, grace: float = 10.0) -> list[str]:
        """Stop every process group (Envoy first); names of any that would not die."""
        order = sorted(self.running, key=lambda p: -p.spec.stage)
        mine = [p for p in order if p.popen is not None or procs.same_process(p.pid, p.started)]
        left = set(procs.stop_groups([p.pid for p in mine], grace=grace))
        for proc in mine:
            if proc.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=1.0)  # reap: no zombies left behind
        return [p.spec.name for p in mine if p.pid in left]

    def stop_one(self, proc: Running, reason: str, grace: float = 5.0) -> None:
        """Stop one process group on purpose (a sidecar whose engine died: the pod is gone)."""
        proc.stopped = reason
        procs.stop_groups([proc.pid], grace=grace)
        if proc.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(timeout=1.0)
        proc.poll()

    def sidecars_of(self, engine: Running) -> list[Running]:
        """The frontend sidecars forwarding to this engine (its pod mates)."""
        url = engine.spec.engine_url
        return [
            p
            for p in self.running
            if p.spec.kind == "frontend"
            and "--engine-url" in p.spec.argv
            and p.spec.argv[p.spec.argv.index("--engine-url") + 1] == url
        ]

    def ports(self) -> list[int]:
        return sorted(
            port + rank
            for p in self.running
            for key, port in p.spec.ports.items()
            for rank in range(_port_span(p.spec, key))
        )

    # --- state file -----------------------------------------------------------------------

    def state(self, supervisor: int | None) -> dict:
        return {
            "graph": self.plan.graph,
            "model": self.plan.model,
            "base_url": self.plan.base_url,
            "run_dir": str(self.run_dir),
            "notes": self.plan.notes,
            "supervisor": None
            if supervisor is None
            else {"pid": supervisor, "started": procs.start_time(supervisor)},
            "processes": [
                {
                    "spec": {**asdict(p.spec), "argv": list(p.spec.argv)},
                    "pid": p.pid,
                    "started": p.started,
                    "log": str(p.log),
                    "exit": None if p.exit_code is None else p.describe_exit(),
                    "state": p.state,
                    "restarts": p.restarts,
                    "last_exit": p.last_exit,
                }
                for p in self.running
            ],
        }

    def save_state(self, supervisor: int | None = None) -> Path:
        path = self.run_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state(supervisor), indent=2))
        tmp.replace(path)
        return path

    @classmethod
    def attach(cls, run_dir: Path) -> tuple[Stack, dict]:
        """Re-create a stack from its state file (FileNotFoundError when there is none)."""
        data = json.loads((run_dir / STATE_FILE).read_text())
        specs = []
        running = []
        for entry in data["processes"]:
            raw = entry["spec"]
            spec = ProcessSpec(
                **{**raw, "argv": tuple(raw["argv"]), "ready": Probe(**raw["ready"])}
            )
            specs.append(spec)
            proc = Running(
                spec,
                entry["pid"],
                entry["started"],
                Path(entry["log"]),
                state=entry.get("state", RUNNING),
                restarts=entry.get("restarts", 0),
                last_exit=entry.get("last_exit"),
            )
            if entry.get("exit"):
                proc.exit_code, proc.recorded_exit = -1, entry["exit"]
            running.append(proc)
        plan = Plan(
            graph=data["graph"],
            model=data["model"],
            processes=specs,
            base_url=data["base_url"],
            files={},
            notes=data.get("notes", []),
        )
        stack = cls(plan, run_dir)
        stack.running = running
        return stack, data

    def live(self) -> list[Running]:
        return [p for p in self.running if p.poll() is None]


def _port_span(spec: ProcessSpec, key: str) -> int:
    """KV event and replay ports take one port per data-parallel rank."""
    if key in ("kv-events", "kv-replay") and "--data-parallel-size" in spec.argv:
        return int(spec.argv[spec.argv.index("--data-parallel-size") + 1])
    return 1


async def probe(session: aiohttp.ClientSession, check: Probe) -> bool:
    """One readiness check; any failure to connect or a non-200 answer is 'not yet'."""
    if check.kind == "http":
        try:
            async with session.get(check.target, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
    if check.kind == "grpc":
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with grpc.aio.insecure_channel(check.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(service=check.service), timeout=2
                )
            except grpc.aio.AioRpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    raise ValueError(f"unknown probe kind {check.kind!r}")


def default_state_root() -> Path:
    """Where run directories live: $DYNAMOGRAPH_STATE_DIR, else $XDG_STATE_HOME/dynamograph."""
    if os.environ.get("DYNAMOGRAPH_STATE_DIR"):
        return Path(os.environ["DYNAMOGRAPH_STATE_DIR"])
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "dynamograph"


def recorded_runs(root: Path) -> list[Path]:
    """Run directories under `root` that have a state file."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if (d / STATE_FILE).is_file())
