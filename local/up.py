"""`dynamograph up [GRAPH.yaml]`: a whole DynamoGraph on this machine behind a real Envoy.

Reads the graph with the DynamoGraph models the operator uses too (`protocol/graph.py`), plans the processes
(`local/plan.py`), starts them (`local/stack.py`) and keeps them running (`local/supervisor.py`:
restarts with back-off), prints the OpenAI base URL (Envoy's listener) and a live status view
until Ctrl-C or SIGTERM, then stops everything.

- `--detach`: the same supervising `up` in the background (its own session, output in
  `logs/up.log`); this command returns once the graph is ready; `dynamograph down` stops it.
- `--status`: the status of a running graph (e.g. a detached one), once.
- `--bench`: a short prefix-heavy workload, KV routing against round-robin (`local/load.py`);
  against the running graph if there is one, else on a graph started (and stopped) for it.

The default graph is `examples/agg.yaml` of the source tree this package runs from (`make
setup` installs it editable), so `dynamograph up` works from any directory.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.live import Live

from . import procs
from .stack import (
    GIVEN_UP,
    RUNNING,
    STATE_FILE,
    Running,
    Stack,
    StackError,
    default_state_root,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DEFAULT_GRAPH = EXAMPLES / "agg.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "graph",
        nargs="?",
        type=Path,
        help=f"DynamoGraph YAML (default: {DEFAULT_GRAPH.relative_to(EXAMPLES.parent)}, "
        "four aggregated mock workers)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help="start, print the base URL and return")
    mode.add_argument(
        "--status", action="store_true", help="print the status of the running graph and return"
    )
    mode.add_argument(
        "--bench",
        action="store_true",
        help="send a short prefix-heavy workload, KV routing vs round-robin: hit rate and TTFT",
    )
    parser.add_argument(
        "--speedup",
        type=float,
        help="mock engines simulate time this many times faster (overrides engine.speedup)",
    )
    parser.add_argument(
        "--kv-curve",
        action="store_true",
        help="secure the KV-event stream with ZMQ CURVE, keys new with the run, as the graph's "
        "spec.kvEvents.curve does (docs/security.md)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where run state and logs go (default: $DYNAMOGRAPH_STATE_DIR, else "
        "$XDG_STATE_HOME/dynamograph, else ~/.local/state/dynamograph)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds to wait for every process to become ready (default 180)",
    )
    # The background `up` that `--detach` starts writes the base URL to this pipe once ready.
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from dynamograph.protocol.graph import GraphError, load_graph

    # Off a terminal (pipes, CI logs) rich would wrap the tables at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=160)
    err = Console(stderr=True)
    path = args.graph or DEFAULT_GRAPH
    if not path.is_file():
        bundled = ", ".join(sorted(p.name for p in EXAMPLES.glob("*.yaml")))
        err.print(f"[red]no graph file {path}[/red] (bundled examples in {EXAMPLES}: {bundled})")
        return 2
    try:
        graph = load_graph(path)
    except GraphError as exc:
        err.print(f"[red]{exc}[/red]")
        return 2
    run_dir = (args.state_dir or default_state_root()) / graph.name
    existing = _attach_live(run_dir)

    if args.status:
        if existing is None:
            err.print(f"graph {graph.name} is not running (no live processes in {run_dir})")
            return 1
        return asyncio.run(_print_status(console, existing))
    if args.bench and existing is not None:
        return asyncio.run(_bench(console, existing))
    if existing is not None:
        err.print(
            f"graph {graph.name} is already running at {existing.plan.base_url}; "
            f"stop it with: dynamograph down {graph.name}"
        )
        return 1
    if args.detach and args.ready_fd is None:
        return _detach(console, err, path, run_dir, args)

    try:
        stack = new_stack(
            graph, run_dir, args.speedup, fresh=args.ready_fd is None, kv_curve=args.kv_curve
        )
    except FileNotFoundError as exc:  # no Envoy binary: the message says how to install it
        err.print(f"[red]{exc}[/red]")
        return 2
    for note in stack.plan.notes:
        err.print(f"note: {note}")
    return asyncio.run(_run(console, err, stack, args))


def _attach_live(run_dir: Path) -> Stack | None:
    """The stack recorded in run_dir if any of its processes still runs; clears stale state."""
    try:
        stack, data = Stack.attach(run_dir)
    except FileNotFoundError:
        return None
    supervisor = data.get("supervisor")
    alive = stack.live() or (
        supervisor and procs.same_process(supervisor["pid"], supervisor["started"])
    )
    if alive:
        return stack
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    return None


def _detach(
    console: Console, err: Console, path: Path, run_dir: Path, args: argparse.Namespace
) -> int:
    """`--detach`: the supervising `up` runs in the background (its own session, its output in
    `logs/up.log`); return once it says the graph is ready, or with its error and exit code."""
    _clear(run_dir)
    log = run_dir / "logs" / "up.log"
    log.parent.mkdir(parents=True)
    read, write = os.pipe()
    argv = [
        sys.executable,
        *("-m", "dynamograph.cli", "up", str(path.resolve()), "--detach"),
        *("--ready-fd", str(write), "--state-dir", str(run_dir.parent)),
        *("--timeout", str(args.timeout)),
        *(() if args.speedup is None else ("--speedup", str(args.speedup))),
        *(("--kv-curve",) if args.kv_curve else ()),
    ]
    with log.open("wb") as out:
        child = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            pass_fds=(write,),
            start_new_session=True,  # outlives this command and the terminal
        )
    os.close(write)
    base_url = ""
    try:
        # The child bounds its own start (--timeout); the margin covers its imports.
        if select.select([read], [], [], args.timeout + 60)[0]:
            base_url = os.read(read, 4096).decode().strip()
    except KeyboardInterrupt:
        child.terminate()  # it stops whatever it started
        child.wait()
        return 130
    finally:
        os.close(read)
    if not base_url:
        if child.poll() is None:
            child.terminate()
        code = child.wait()
        err.print(
            f"[red]the graph did not start[/red]; last lines of {log}:\n{procs.log_tail(log, 40)}"
        )
        return code or 1
    console.print(f"OpenAI base URL: {base_url}", highlight=False)
    console.print(f"logs: {run_dir / 'logs'} (the supervisor's: up.log, supervisor.log)")
    console.print(f"stop with: dynamograph down {run_dir.name}")
    return 0


def _clear(run_dir: Path) -> None:
    if run_dir.exists():  # logs of an earlier run
        shutil.rmtree(run_dir)


def new_stack(
    graph,
    run_dir: Path,
    speedup: float | None,
    fresh: bool = True,
    envoy_config=None,
    kv_curve: bool = False,
) -> Stack:
    """The planned (not started) stack of `graph`; `envoy_config` replaces Envoy's config
    builder (the fault suite puts a proxy between Envoy and the EPP)."""
    from . import envoy as envoy_module
    from .envoy import find_envoy
    from .plan import plan_graph
    from .procs import PortPool

    envoy = find_envoy()
    if fresh:
        _clear(run_dir)
    pool = PortPool()
    try:
        plan = plan_graph(
            graph,
            run_dir,
            pool.take,
            envoy_binary=str(envoy),
            envoy_config=envoy_config or envoy_module.envoy_config,
            speedup=speedup,
            kv_curve=kv_curve,
        )
    finally:
        pool.release()
    return Stack(plan, run_dir)


async def _run(console: Console, err: Console, stack: Stack, args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Ctrl-C, `kill`, or the terminal closing (SIGHUP): all stop the graph cleanly.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    try:
        started = await _start(err, stack, stop, args.timeout)
        if not started:
            return 1 if not stop.is_set() else 130
        stack.save_state(supervisor=os.getpid())
        console.print(f"OpenAI base URL: {stack.plan.base_url}", highlight=False)
        if args.ready_fd is not None:  # the background `up` of --detach: tell the caller
            os.write(args.ready_fd, f"{stack.plan.base_url}\n".encode())
            os.close(args.ready_fd)
        if args.bench:
            return await _bench(console, stack)
        return await _watch(console, stack, stop)
    finally:
        left = stack.stop()
        (stack.run_dir / STATE_FILE).unlink(missing_ok=True)
        if left:
            err.print(f"[red]could not stop: {', '.join(left)}[/red]")
        else:
            err.print(f"stopped {len(stack.running)} processes")


async def _start(err: Console, stack: Stack, stop: asyncio.Event, ready_within: float) -> bool:
    """Start the stack unless Ctrl-C comes first; False when it did not come up."""
    err.print(f"starting {len(stack.plan.processes)} processes for graph {stack.plan.graph} …")
    starting = asyncio.create_task(stack.start(ready_within))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, StackError):
            await starting
        return False
    try:
        starting.result()
    except StackError as exc:
        err.print(f"[red]{exc}[/red]")
        return False
    return True


async def _watch(console: Console, stack: Stack, stop: asyncio.Event) -> int:
    """Supervise until Ctrl-C (`local/supervisor.py`: restarts with back-off); on a terminal a
    rich Live table, otherwise one line per event. Exits 1 when a process was given up."""
    from .status import render, scrape
    from .supervisor import Supervisor

    supervisor = Supervisor(stack)
    live = console.is_terminal
    view = Live(console=console, refresh_per_second=2, transient=False) if live else None

    next_view = 0.0

    async def each_round(new: list[str]) -> None:
        nonlocal next_view
        if new:
            if not live:
                for event in new:
                    print(event, flush=True)
            stack.save_state(supervisor=os.getpid())  # `up --status` shows it too
        # The view scrapes every engine: once a second is enough (the supervisor ticks faster).
        if view is not None and (new or time.monotonic() >= next_view):
            next_view = time.monotonic() + 1.0
            samples = await scrape(session, stack.running)
            view.update(
                render(
                    stack.plan.graph,
                    stack.plan.base_url,
                    stack.plan.model,
                    stack.running,
                    samples,
                    supervisor.events,
                    footer="Ctrl-C stops everything",
                )
            )

    async with aiohttp.ClientSession() as session:
        with view or contextlib.nullcontext():
            await supervisor.run(stop, each_round)
    return 1 if any(p.state == GIVEN_UP for p in stack.running) else 0


def _status_event(proc: Running) -> str:
    state = proc.state
    if state == RUNNING and proc.exit_code is not None:  # ended on purpose, or unsupervised
        state = proc.describe_exit()
    what = f"{proc.spec.name}: {state}"
    if proc.restarts:
        what += f", {proc.restarts} restart{'s' if proc.restarts > 1 else ''}"
    if proc.last_exit:
        what += f", last exit: {proc.last_exit}"
    return f"{what} (log: {proc.log})"


async def _print_status(console: Console, stack: Stack) -> int:
    from .status import render, scrape

    async with aiohttp.ClientSession() as session:
        samples = await scrape(session, stack.running)
    for proc in stack.running:
        proc.poll()
    events = [
        _status_event(p)
        for p in stack.running
        if p.state != RUNNING or p.exit_code is not None or p.restarts
    ]
    console.print(
        render(
            stack.plan.graph,
            stack.plan.base_url,
            stack.plan.model,
            stack.running,
            samples,
            events,
            footer=f"stop with: dynamograph down {stack.plan.graph}",
        )
    )
    return 0


async def _bench(console: Console, stack: Stack) -> int:
    from .load import Workload, compare, results_table

    console.print("sending a prefix-heavy workload twice: KV routing, then round-robin …")
    results = await compare(
        stack.plan.base_url, stack.plan.model, stack.running, Workload(), seed=int(time.time())
    )
    console.print(results_table(results))
    return 1 if any(r.errors == r.requests for r in results) else 0
