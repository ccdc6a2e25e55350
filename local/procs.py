"""Operating-system facts about local processes and ports, for the supervisor and `down`.

Every process `up` starts leads its own process group (pgid = pid), so a whole component,
including anything it spawned, is stopped with one `killpg`. A pid alone is not an identity —
it may be reused after the process dies — so the state file records each process's kernel start
time and nothing is signalled unless the pid still has that start time. Linux (`/proc`) only.

The ports a plan's processes get come from `PortPool`, held until they start. `spawn` starts a
process that way (its own session, output to a log file) for the supervisor and the benchmarks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from dynamograph.protocol.ports import bind_ports

PROC = Path("/proc")


def spawn(
    argv: Sequence[str], log: Path, env: Mapping[str, str], *, append: bool = False
) -> subprocess.Popen:
    """Start `argv` leading its own session (so its process group holds whatever it spawns and
    one `killpg` stops them all; it also outlives the terminal), stdout and stderr into `log`
    (appended to with `append`), stdin closed, with exactly `env`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab" if append else "wb") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log ("" when it cannot be read): what an error shows."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (which may hold spaces or parens)."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks since boot; None when there is no such process."""
    fields = _stat_fields(pid)
    # Field 22 of stat is starttime; after dropping pid and comm it is index 19.
    return int(fields[19]) if fields else None


def is_live(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie holds no ports and does no work)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is `pgid`."""
    members = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        # After pid and comm: state, ppid, pgrp.
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def same_process(pid: int, started: int | None) -> bool:
    """`pid` is still the process recorded with kernel start time `started`."""
    return started is not None and start_time(pid) == started


def signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to a process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError as exc:  # pragma: no cover - only on a foreign pgid
        raise RuntimeError(f"not allowed to signal process group {pgid}") from exc
    return True


def stop_groups(pgids: Iterable[int], grace: float = 10.0, poll: float = 0.05) -> list[int]:
    """SIGTERM every group, wait up to `grace` seconds, SIGKILL what is left.

    Returns the groups that still have live members after SIGKILL (normally none).
    """
    pending = [g for g in pgids if signal_group(g, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while pending and time.monotonic() < deadline:
        pending = [g for g in pending if group_members(g)]
        if pending:
            time.sleep(poll)
    for pgid in pending:
        signal_group(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while pending and time.monotonic() < deadline:
        pending = [g for g in pending if group_members(g)]
        if pending:
            time.sleep(poll)
    return pending


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on host:port (TIME_WAIT leftovers do not count: servers reuse them)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class PortPool:
    """TCP ports on 127.0.0.1 for one plan, held open until `release()` so it never gets one twice.

    `take(n)` returns the first of `n` consecutive free ports (a data-parallel worker publishes
    KV events on `port + rank`), from outside the kernel's ephemeral range
    (`protocol.ports.bind_ports`), so no outgoing connection is given one meanwhile. The holding
    sockets keep everyone else off the ports, the plan's own processes too: `release()` just
    before they start. Only a program binding that very port in between can take it then, and a
    component that loses that race exits with "address in use", which the supervisor reports
    with its log.
    """

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host
        self._held: list[socket.socket] = []

    def take(self, n: int = 1) -> int:
        block = bind_ports(n, self.host)
        self._held.extend(block)
        return block[0].getsockname()[1]

    def release(self) -> None:
        for sock in self._held:
            with contextlib.suppress(OSError):
                sock.close()
        self._held.clear()
