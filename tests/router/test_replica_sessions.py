"""Sticky sessions shared by replica sync (router/replicas.py, router/sessions.py): Routers on
real ZMQ sockets on 127.0.0.1 in one event loop, each with its own injectable clock (set far
apart: replicas' clocks differ), routing a session's turns on whichever replica they land on.

Waits poll the peer's table (`wait_for`); time only moves through the routers' clocks."""

import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from dynamograph.protocol.nvext import SessionControl
from dynamograph.router.replicas import ReplicaSettings, ReplicaSync
from dynamograph.router.scheduler import Router
from e2e.waiting import wait_for

from .test_scheduler import Clock, cache, make_router, request, tokens

pytestmark = pytest.mark.integration

WORKERS = (1, 2, 3)


def replica_router(start: float) -> tuple[Router, Clock]:
    """A replica's router and its clock: the same workers (instance ids) as every other's."""
    clock = Clock()
    clock.now = start
    return make_router(WORKERS, clock=clock), clock


@contextlib.asynccontextmanager
async def replica(
    router: Router, peers=(), *, sync_clock: Clock | None = None, timeout_s: float = 60.0
) -> AsyncIterator[ReplicaSync]:
    settings = ReplicaSettings("tcp://127.0.0.1:0", list(peers), 0.1, timeout_s)
    clock = sync_clock or time.monotonic
    sync = ReplicaSync(router.active, settings, sessions=router.sessions, clock=clock)
    await sync.start()
    try:
        yield sync
    finally:
        await sync.close()


async def meet(*pairs: tuple[ReplicaSync, ReplicaSync]) -> None:
    for x, y in pairs:
        x.set_peers([y.address])
        y.set_peers([x.address])
    await wait_for(
        lambda: all(x.live_peers() and y.live_peers() for x, y in pairs), "peers to meet", within=20
    )


def bind(router: Router, sid: str, **kw) -> tuple[int, int]:
    d = router.schedule(request(tokens(16), session=SessionControl(session_id=sid, **kw)))
    return (d.decode.worker_id, d.decode.dp_rank)


async def test_a_session_bound_on_a_routes_its_next_turn_on_b_to_the_bound_worker():
    a, _ = replica_router(1000.0)
    b, _ = replica_router(90_000.0)
    async with replica(a) as sa, replica(b) as sb:
        await meet((sa, sb))
        opened = a.schedule(
            request(tokens(16), session=SessionControl(session_id="chat", action="open"))
        )
        bound = (opened.decode.worker_id, opened.decode.dp_rank)
        opened.confirm_session()  # the engine accepted the open turn on A
        await wait_for(
            lambda: b.sessions.binding("chat", within=20) == bound, "B to learn the binding"
        )
        # B's KV index prefers another worker by far; the session still goes where it is bound
        other = next(w for w in WORKERS if w != bound[0])
        cache(b, other, tokens(64))
        turn = b.schedule(request(tokens(64), session=SessionControl(session_id="chat")))
        assert (turn.decode.worker_id, turn.decode.sticky) == (bound[0], True)
        # the control: without the session, B routes that prompt to the cached worker
        assert b.schedule(request(tokens(64))).decode.worker_id == other


async def test_close_on_b_unbinds_on_a_and_a_later_bind_wins_over_an_older_one():
    a, _ = replica_router(1000.0)
    b, _ = replica_router(5.0)
    async with replica(a) as sa, replica(b) as sb:
        await meet((sa, sb))
        bound = bind(a, "s", action="bind")
        await wait_for(
            lambda: b.sessions.binding("s", within=20) == bound, "B to learn the binding"
        )
        b.schedule(request(tokens(16), session=SessionControl(session_id="s", action="close")))
        assert b.sessions.binding("s") is None
        await wait_for(
            lambda: a.sessions.binding("s", within=20) is None, "A to drop the closed session"
        )
        # bound again (on B, after the close): both hold the new binding, nothing resurrects
        again = bind(b, "s", action="bind")
        await wait_for(
            lambda: a.sessions.binding("s", within=20) == again, "A to learn the new binding"
        )
        assert b.sessions.binding("s") == again


async def test_concurrent_binds_of_one_session_converge_on_one_binding():
    """Both replicas bind the same session before hearing of the other's bind: last writer
    (by stamp) wins on both, whatever order the messages cross in."""
    a, _ = replica_router(1000.0)
    b, _ = replica_router(2000.0)
    async with replica(a) as sa, replica(b) as sb:
        await meet((sa, sb))
        on_a = bind(a, "race", action="bind", timeout=600)
        on_b = bind(b, "race", action="bind", timeout=600)
        assert (a.sessions.binding("race"), b.sessions.binding("race")) == (on_a, on_b)
        await wait_for(
            lambda: a.sessions.entry("race", within=20).stamp == b.sessions.entry("race").stamp,
            "both replicas to settle on one binding",
        )
        assert a.sessions.binding("race") == b.sessions.binding("race")


async def test_a_late_joiner_gets_the_bindings_in_its_snapshot():
    a, _ = replica_router(1000.0)
    b, _ = replica_router(2000.0)
    c, _ = replica_router(3000.0)
    async with replica(a) as sa, replica(b) as sb:
        await meet((sa, sb))
        on_a = bind(a, "from-a", action="bind")
        on_b = bind(b, "from-b", action="bind")
        bind(a, "closed", action="bind")
        a.schedule(request(tokens(16), session=SessionControl(session_id="closed", action="close")))
        await wait_for(
            lambda: a.sessions.binding("from-b", within=20) == on_b, "A to learn B's binding"
        )
        async with replica(c, [sa.address]) as sc:  # C hears only A: A's snapshot has both
            await wait_for(
                lambda: (
                    (c.sessions.binding("from-a", within=20), c.sessions.binding("from-b"))
                    == (on_a, on_b)
                ),
                "C to get both bindings from A's snapshot",
            )
            assert c.sessions.binding("closed") is None and sc.snapshots_applied >= 1


async def test_a_refresh_on_a_keeps_bs_binding_alive_and_an_unrefreshed_one_expires_on_both():
    a, clock_a = replica_router(1000.0)
    b, clock_b = replica_router(70_000.0)
    async with replica(a) as sa, replica(b) as sb:
        await meet((sa, sb))
        kept = bind(a, "kept", action="bind", timeout=60)
        bind(a, "idle", action="bind", timeout=60)
        await wait_for(
            lambda: b.sessions.binding("kept", within=20) and b.sessions.binding("idle"),
            "B to learn both bindings",
        )
        clock_a.now += 50
        clock_b.now += 50
        # a turn of "kept" on A (no action): a refresh, sent with the 60 s it has left now
        a.schedule(request(tokens(16), session=SessionControl(session_id="kept")))
        await wait_for(
            lambda: b.sessions.entry("kept", within=20).expires_at >= clock_b.now + 59,
            "B to take A's refresh",
        )
        clock_a.now += 50
        clock_b.now += 50
        assert b.sessions.binding("kept") == kept == a.sessions.binding("kept")
        assert a.sessions.binding("idle") is None and b.sessions.binding("idle") is None


async def test_a_dead_peers_bindings_survive_its_timeout_until_their_ttl():
    a, _ = replica_router(1000.0)
    b, clock_b = replica_router(2000.0)
    sync_clock = Clock()  # B's replica-sync clock: the peer timeout moves only when told
    async with replica(b, sync_clock=sync_clock, timeout_s=5.0) as sb:
        async with replica(a, [sb.address]) as sa:
            await meet((sa, sb))
            bound = bind(a, "s", action="bind", timeout=120)
            await wait_for(
                lambda: b.sessions.binding("s", within=20) == bound, "B to learn the binding"
            )
        sync_clock.now += 60  # A is gone: B's next heartbeat turn drops it
        await wait_for(lambda: sb.peers_lost == 1, "B to drop the silent peer", within=20)
        assert sb.live_peers() == 0
        turn = b.schedule(request(tokens(16), session=SessionControl(session_id="s")))
        assert (turn.decode.worker_id, turn.decode.sticky) == (bound[0], True)
        clock_b.now += 121  # that turn refreshed it by 120 s on B's clock
        assert b.sessions.binding("s") is None
