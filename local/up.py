"""`dynamograph up [GRAPH.yaml]`: a whole DynamoGraph on this machine behind a real Envoy.

Reads the graph with the DynamoGraph models the operator uses too (`protocol/graph.py`), plans the processes
(`local/plan.py`), starts and supervises them (`local/stack.py`), prints the OpenAI base URL
(Envoy's listener) and a live status view until Ctrl-C or SIGTERM, then stops everything.

- `--detach`: start, print the base URL, return; `dynamograph down` stops it.
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
import shutil
import signal
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.live import Live

from . import procs
from .stack import STATE_FILE, Stack, StackError, default_state_root

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

    try:
        stack = _new_stack(graph, run_dir, args.speedup)
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


def _new_stack(graph, run_dir: Path, speedup: float | None) -> Stack:
    from .envoy import envoy_config, find_envoy
    from .plan import plan_graph
    from .procs import PortPool

    envoy = find_envoy()
    if run_dir.exists():  # logs of an earlier run
        shutil.rmtree(run_dir)
    pool = PortPool()
    try:
        plan = plan_graph(
            graph,
            run_dir,
            pool.take,
            envoy_binary=str(envoy),
            envoy_config=envoy_config,
            speedup=speedup,
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
    detached = args.detach
    try:
        started = await _start(err, stack, stop, args.timeout)
        if not started:
            return 1 if not stop.is_set() else 130
        if detached:
            stack.save_state()
            console.print(f"OpenAI base URL: {stack.plan.base_url}")
            console.print(f"logs: {stack.run_dir / 'logs'}")
            console.print(f"stop with: dynamograph down {stack.plan.graph}")
            return 0
        stack.save_state(supervisor=os.getpid())
        console.print(f"OpenAI base URL: {stack.plan.base_url}", highlight=False)
        if args.bench:
            return await _bench(console, stack)
        return await _watch(console, stack, stop)
    finally:
        if not detached:
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


def _death_event(proc, stamp: bool = True) -> str:
    what = f"{proc.spec.name} {proc.describe_exit()}"
    if stamp:
        what = f"{time.strftime('%H:%M:%S')} {what}"
    if proc.spec.kind == "engine":
        return f"{what}: the EPP drops it, routing continues on the rest"
    return f"{what} (log: {proc.log})"


async def _watch(console: Console, stack: Stack, stop: asyncio.Event) -> int:
    """Live view until Ctrl-C; on a terminal a rich Live table, otherwise one line per event."""
    from .status import render, scrape

    events: list[str] = []
    fatal = False
    live = console.is_terminal
    view = Live(console=console, refresh_per_second=2, transient=False) if live else None
    async with aiohttp.ClientSession() as session:
        with view or contextlib.nullcontext():
            while not stop.is_set():
                for proc in stack.reap():
                    if proc.stopped:
                        continue
                    event = _death_event(proc)
                    if proc.spec.kind == "engine":
                        # The pod is gone: its sidecar goes with it, as in Kubernetes.
                        for sidecar in stack.sidecars_of(proc):
                            await asyncio.to_thread(stack.stop_one, sidecar, "with its engine")
                    events.append(event)
                    if not live:
                        print(event, flush=True)
                    fatal = fatal or proc.spec.kind in ("envoy", "epp")
                    stack.save_state(supervisor=os.getpid())  # `up --status` shows it too
                if fatal:
                    events.append("the gateway cannot route any more: stopping")
                    print(events[-1], flush=True)
                    break
                if view is not None:
                    samples = await scrape(session, stack.running)
                    view.update(
                        render(
                            stack.plan.graph,
                            stack.plan.base_url,
                            stack.plan.model,
                            stack.running,
                            samples,
                            events,
                            footer="Ctrl-C stops everything",
                        )
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=1.0)
    return 1 if fatal else 0


async def _print_status(console: Console, stack: Stack) -> int:
    from .status import render, scrape

    async with aiohttp.ClientSession() as session:
        samples = await scrape(session, stack.running)
    for proc in stack.running:
        proc.poll()
    events = [_death_event(p, stamp=False) for p in stack.running if p.exit_code is not None]
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
