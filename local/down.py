"""`dynamograph down [NAME]`: stop a graph started with `dynamograph up` (detached or not).

Works from the run directory's state file: every recorded process group whose leader still
has its recorded kernel start time gets SIGTERM, then SIGKILL after a grace period; a
foreground `up` that is still supervising is asked to stop too. Then it checks that no process
of the graph is left and every port it used is free, and removes the state file. Without a
name it stops every graph recorded in the state directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path

from . import procs
from .stack import STATE_FILE, Stack, default_state_root, recorded_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="graph name (metadata.name); default: every graph")
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where `up` keeps run state (default: as for `up`)",
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
    )


def run(args: argparse.Namespace) -> int:
    root = args.state_dir or default_state_root()
    runs = [root / args.name] if args.name else recorded_runs(root)
    if args.name and not (root / args.name / STATE_FILE).is_file():
        print(f"graph {args.name} is not running (no state in {root / args.name})", file=sys.stderr)
        return 1
    if not runs:
        print(f"no running graphs in {root}")
        return 0
    failed = False
    for run_dir in runs:
        failed |= not stop_run(run_dir, args.grace)
    return 1 if failed else 0


def stop_run(run_dir: Path, grace: float = 10.0) -> bool:
    """Stop one recorded graph; True when nothing of it is left."""
    stack, data = Stack.attach(run_dir)
    supervisor = data.get("supervisor")
    if supervisor and procs.same_process(supervisor["pid"], supervisor["started"]):
        # A foreground `up`: let it stop its own children, then make sure below.
        with contextlib.suppress(ProcessLookupError):
            os.kill(supervisor["pid"], signal.SIGTERM)
        _wait_gone(supervisor["pid"], supervisor["started"], grace)
    left = stack.stop(grace)
    busy = _busy_ports(stack.ports())
    if left or busy:
        print(
            f"{stack.plan.graph}: still running: {', '.join(left) or '-'}; "
            f"ports still in use: {', '.join(map(str, busy)) or '-'}",
            file=sys.stderr,
        )
        return False
    (run_dir / STATE_FILE).unlink(missing_ok=True)
    print(f"{stack.plan.graph}: stopped {len(stack.running)} processes, ports free")
    return True


def _wait_gone(pid: int, started: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while procs.same_process(pid, started) and procs.is_live(pid):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)


def _busy_ports(ports: list[int], timeout: float = 5.0) -> list[int]:
    """Ports still listened on, after giving the kernel a moment to close the sockets."""
    deadline = time.monotonic() + timeout
    busy = [p for p in ports if not procs.port_is_free(p)]
    while busy and time.monotonic() < deadline:
        time.sleep(0.1)
        busy = [p for p in busy if not procs.port_is_free(p)]
    return busy
