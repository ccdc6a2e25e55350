"""Ports picked ahead of their listener (protocol/ports.py) and its users, `PortPool`, `free_port`
and `refusing_address`: outside the kernel's ephemeral range, free, held while taken. Real
sockets on 127.0.0.1."""

import os
import socket
from pathlib import Path

import pytest

from dynamograph.local.procs import PortPool, port_is_free
from dynamograph.protocol import ports
from dynamograph.worker.testing import free_port, refusing_address

pytestmark = pytest.mark.integration


def kernel_range() -> tuple[int, int]:
    low, high = (int(f) for f in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return low, high


def outside_ephemeral(port: int) -> bool:
    low, high = kernel_range()
    return ports.FLOOR <= port < 65536 and not low <= port <= high


def listen(port: int) -> socket.socket:
    """Bind and listen as a server does (SO_REUSEADDR, like aiohttp, grpc, ZMQ and Envoy)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@pytest.fixture
def only_ports(tmp_path, monkeypatch):
    """Restrict the candidates to `count` free ports found by a pool (returned held: the caller
    releases them): FLOOR at the first, the ephemeral range from just after the last to 65535."""

    def restrict(count: int) -> tuple[PortPool, int]:
        pool = PortPool()
        first = pool.take(count)
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{first + count}\t65535\n")
        monkeypatch.setattr(ports, "RANGE_FILE", range_file)
        monkeypatch.setattr(ports, "FLOOR", first)
        return pool, first

    return restrict


def test_the_range_is_read_from_the_kernel():
    assert ports.ephemeral_range() == kernel_range()


@pytest.mark.parametrize("content", [None, "", "32768", "a b", "1 2 3"])
def test_an_unreadable_range_falls_back_to_linux_default(tmp_path, monkeypatch, content):
    range_file = tmp_path / "ip_local_port_range"
    if content is not None:
        range_file.write_text(content)
    monkeypatch.setattr(ports, "RANGE_FILE", range_file)
    assert ports.ephemeral_range() == ports.LINUX_DEFAULT_RANGE == (32768, 60999)
    sock = ports.bind_ports()[0]
    with sock:
        assert not 32768 <= sock.getsockname()[1] <= 60999


def test_every_way_of_picking_a_port_stays_outside_the_ephemeral_range():
    pool = PortPool()
    try:
        taken = [pool.take() for _ in range(20)] + [pool.take(4) for _ in range(5)]
        blocks = [p + i for p in taken[20:] for i in range(4)]
    finally:
        pool.release()
    found = [free_port() for _ in range(50)]
    with refusing_address() as dead:
        refused = int(dead.rsplit(":", 1)[1])
    picked = [*taken[:20], *blocks, *found, refused]
    assert [p for p in picked if not outside_ephemeral(p)] == []
    # each released at once, yet none handed out again: the walk goes on past them
    assert len(set(found)) == len(found)


def test_a_block_is_held_then_free_for_its_servers():
    pool = PortPool()
    first = pool.take(4)
    try:
        for port in range(first, first + 4):
            assert not port_is_free(port)
            # the holder refuses even a server that sets SO_REUSEADDR...
            with pytest.raises(OSError, match="in use"):
                listen(port)
            # ...and nothing answers there
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        pool.release()
    servers = [listen(port) for port in range(first, first + 4)]
    for server in servers:
        server.close()


def test_a_held_port_is_skipped(monkeypatch):
    pool = PortPool()
    try:
        held = pool.take(3)
        # send the walk straight at the held block
        monkeypatch.setattr(ports, "_next", held)
        again = pool.take(2)
        assert not {again, again + 1} & {held, held + 1, held + 2}
        monkeypatch.setattr(ports, "_next", held + 1)
        assert free_port() not in (held, held + 1, held + 2)
    finally:
        pool.release()


def test_no_room_outside_the_ephemeral_range_is_a_clear_error(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024 65535")
    monkeypatch.setattr(ports, "RANGE_FILE", range_file)
    with pytest.raises(RuntimeError, match=r"no room for 1 consecutive ports .* range 1024-65535"):
        free_port()


def test_a_block_never_runs_into_the_ephemeral_range(only_ports):
    pool, first = only_ports(2)
    pool.release()
    with pytest.raises(RuntimeError, match="no room for 3 consecutive ports"):
        PortPool().take(3)
    assert PortPool().take(2) == first


def test_every_candidate_taken_is_a_clear_error_until_one_is_released(only_ports):
    pool, first = only_ports(2)
    try:
        with pytest.raises(RuntimeError, match="found no 1 consecutive free ports"):
            free_port()
    finally:
        pool.release()
    assert free_port() in (first, first + 1)


def test_a_forked_child_walks_from_its_own_start():
    free_port()  # this process has a position in its walk now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether it inherited the position, and leave
        os.write(write, b"fresh" if ports._next is None else b"inherited")
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        assert answer.read() == b"fresh"
    os.waitpid(pid, 0)
