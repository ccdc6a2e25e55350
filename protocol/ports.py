"""Ports picked for a listener that binds later: the one place they are chosen.

Tests, benchmarks and `dynamograph up` pick ports before the servers that use them start
(`worker.testing.free_port`, `local.procs.PortPool`); both layers build on this, so it lives
in the bottom one.

Binding port 0 and releasing the port races with every outgoing connection on the machine: the
kernel hands port 0 out of its ephemeral range (/proc/sys/net/ipv4/ip_local_port_range), the
range each connect() takes its source port from, so by the time the server binds, the port
may be some connection's source port ("address already in use"), and a client dialling a port
nobody listens on can even be given it as its source and connect to itself. Ports here come
from outside that range (from `FLOOR` up), which the kernel never assigns by itself: only
another explicit listener can take one, and each is bound before it is handed out, which
checks that no listener holds it now.

Each process walks the candidates from a random start, so parallel processes rarely try the same
port, and one process hands a port out again only after going round all of them.
"""

from __future__ import annotations

import bisect
import errno
import os
import random
import socket
from pathlib import Path

RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT_RANGE = (32768, 60999)  # assumed when RANGE_FILE cannot be read
FLOOR = 10_000  # below: well-known ports and the usual service ports (8000, 8080, 9090, ...)

# Where this process's walk goes on; None: a random start. Only a hint: two threads that read
# it at once try the same port, and the bind lets one of them have it.
_next: int | None = None


def _forget_position() -> None:
    global _next
    _next = None


# A forked child would otherwise walk the same ports as its parent.
os.register_at_fork(after_in_child=_forget_position)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range, both ends included (Linux's default when unreadable)."""
    try:
        low, high = (int(field) for field in RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_RANGE
    return low, high


def bind_ports(n: int = 1, host: str = "127.0.0.1") -> list[socket.socket]:
    """Sockets bound to `n` consecutive ports of `host` outside the ephemeral range, not listening.

    While they are open nobody can bind those ports: they are bound without SO_REUSEADDR, which
    refuses even a server that sets it. So close them just before the server that gets the
    ports binds (it is refused too until then). A connection to a held port is refused.
    RuntimeError when no such block is free, or the ephemeral range leaves no room for one.
    """
    global _next
    low, high = ephemeral_range()
    starts = [
        port
        for first, end in ((FLOOR, low), (max(FLOOR, high + 1), 65536))
        for port in range(first, end - n + 1)
    ]
    where = f"on {host} in {FLOOR}-65535 outside the ephemeral range {low}-{high} ({RANGE_FILE})"
    if not starts:
        raise RuntimeError(f"no room for {n} consecutive ports {where}")
    if _next is None:
        # not the `random` module's shared generator: a program that seeds it (benchmarks do)
        # would send all its processes to the same ports
        _next = random.SystemRandom().choice(starts)
    at = bisect.bisect_left(starts, _next)
    for first in starts[at:] + starts[:at]:
        block = _bind_block(first, n, host)
        if block:
            _next = first + n
            return block
    raise RuntimeError(f"found no {n} consecutive free ports {where}")


def _bind_block(first: int, n: int, host: str) -> list[socket.socket]:
    """Sockets bound to ports first .. first + n - 1, or [] (all closed) when one is taken."""
    block: list[socket.socket] = []
    try:
        for port in range(first, first + n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            block.append(sock)
            sock.bind((host, port))
    except OSError as exc:
        for sock in block:
            sock.close()
        if exc.errno != errno.EADDRINUSE:  # a bad host, say: no other port would do better
            raise
        return []
    return block
