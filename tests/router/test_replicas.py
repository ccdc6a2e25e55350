"""Replica sync (router/replicas.py) between ReplicaSync instances on real ZMQ sockets on
127.0.0.1 in one event loop: what a peer's ActiveRequests holds after bookings, progress and
frees; a lost message answered by a snapshot; a replica restarting under its name replacing its
old self without waiting for the timeout. Sticky sessions between two Routers: a session opened
through one replica is sticky in the other, a close through either drops it in both, a late
joiner gets the bindings from the snapshot, refreshes and timeouts hold on both (each on its own
clock), the LRU bound holds (and an eviction is not a close), two replicas writing one session at
once agree, a close through a replica that never held the binding closes it on the replica that
does (and a bind stamped after such a close survives it), a close lost in a gap is repaired by
the snapshot, and a snapshot holds only entries a replica before 1351fb4 reads (the closes follow
it). Remembered closes, message by message into one ReplicaSync: a close delivered before the
bind it closes wins, the closer ignores a peer's older write, the closes are remembered for their
time and within the sessions' bound, and closes in the earlier versions' wire shapes apply."""

import contextlib

import msgpack
import numpy as np
import zmq

from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.nvext import SessionControl
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.active import ActiveRequests
from dynamograph.router.replicas import ReplicaSettings, ReplicaSync
from dynamograph.router.scheduler import Decision, Router, RouteRequest
from dynamograph.router.sessions import StickySessions
from e2e.waiting import wait_for

SLOT = (7, 0)


@contextlib.asynccontextmanager
async def replica(
    active: ActiveRequests,
    peers=(),
    *,
    name: str = "",
    bind="tcp://127.0.0.1:0",
    sessions: StickySessions | None = None,
):
    sync = ReplicaSync(
        active,
        ReplicaSettings(bind, list(peers), heartbeat_s=0.1, timeout_s=60.0, name=name),
        sessions=sessions,
    )
    await sync.start()
    try:
        yield sync
    finally:
        await sync.close()


def view(active: ActiveRequests) -> tuple[int, int, int]:
    load = active.load(SLOT)
    return load.requests, load.prefill_blocks, load.decode_blocks


async def converge(active: ActiveRequests, wanted: tuple[int, int, int], what: str) -> None:
    await wait_for(lambda: view(active) == wanted, what, within=20)


async def test_a_peer_holds_exactly_what_was_booked_and_nothing_after_the_frees():
    a, b = ActiveRequests(), ActiveRequests()
    async with replica(a) as sa, replica(b, [sa.address]) as sb:
        sa.set_peers([sb.address])
        await wait_for(lambda: sa.live_peers() and sb.live_peers(), "peers to meet", within=20)
        keys = np.array([11, 12, 13], np.uint64)
        first = a.book(SLOT, prompt_blocks=4, prefill_blocks=3, prompt_keys=keys)
        # shares the prompt's three keyed blocks: they count once on the slot
        second = b.book(SLOT, prompt_blocks=4, prefill_blocks=1, prompt_keys=keys)
        # 3 keyed blocks shared (counted once on the slot) + one partial block each
        await converge(b, (2, 4, 5), "B to hold A's booking too")
        await converge(a, (2, 4, 5), "A to hold B's booking too")
        a.prefill_progress(first, 1)
        b.add_output_tokens(second, 1)
        await converge(b, (2, 2, 5), "B to see A's prefill progress")
        await converge(a, (2, 2, 5), "A to see B's progress")
        a.free(first)
        b.free(second)
        await converge(a, (0, 0, 0), "A back to zero")
        await converge(b, (0, 0, 0), "B back to zero")
        assert sa.remote_requests() == sb.remote_requests() == 0


async def test_a_lost_message_is_repaired_by_a_snapshot():
    a, b = ActiveRequests(), ActiveRequests()
    async with replica(a) as sa, replica(b, [sa.address]) as sb:
        await wait_for(lambda: sb.live_peers(), "B to hear A", within=20)
        a.book(SLOT, prompt_blocks=2, prefill_blocks=2)
        await converge(b, (1, 2, 2), "B to hold A's first booking")
        sa._seq += 1  # as if one message had been dropped on the way
        lost = a.book(SLOT, prompt_blocks=3, prefill_blocks=3)
        # B notices the gap at the next message, asks again and gets everything
        await converge(b, (2, 5, 5), "B to recover A's bookings from a snapshot")
        assert sb.gaps == 1 and sb.snapshots_applied >= 2
        a.free(lost)
        await converge(b, (1, 2, 2), "B to follow A again after the snapshot")


async def test_a_restarted_replica_replaces_its_old_self_at_once():
    a, b = ActiveRequests(), ActiveRequests()
    async with replica(b) as sb:
        async with replica(a, name="epp-0") as sa:
            sb.set_peers([sa.address])
            address = sa.address
            a.book(SLOT, prompt_blocks=2, prefill_blocks=2)
            await converge(b, (1, 2, 2), "B to hold the first life's booking")
        # Same name and address, a new process (its booking died with the old one); the
        # timeout is a minute, so only the name can tell B.
        async with replica(ActiveRequests(), name="epp-0", bind=address) as again:
            await converge(b, (0, 0, 0), "B to drop the old life's booking")
            assert sb.dropped == 1 and sb.peers_lost == 1 and again.id != sa.id
            await wait_for(lambda: sb.live_peers() == 1, "B to sync with the new life", within=20)


# -- sticky sessions ---------------------------------------------------------------------------

WORKERS = (1, 2, 3)
BS = 4


class Clock:
    """A pod's clock: each replica has its own, far apart, so only remaining times can agree."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_router(clock: Clock, **config) -> Router:
    router = Router(RouterConfig(seed=7, **config), clock=clock)
    for w in WORKERS:
        router.add_worker(w, block_size=BS, total_blocks=1000)
    return router


def turn(router: Router, sid: str, action: str | None = None, *, pin=None, **control) -> Decision:
    """A session's turn of 16 tokens, routed and (an `open`) accepted by the engine."""
    if action is not None:
        control["action"] = action
    session = SessionControl(session_id=sid, **control)
    pins = RoutePins(worker_id=pin) if pin is not None else RoutePins()
    toks = list(range(16))
    decision = router.schedule(
        RouteRequest(sid, block_hashes(toks, BS, None), len(toks), session=session, pins=pins)
    )
    decision.confirm_session()
    assert decision.guard is not None
    decision.guard.free()
    return decision


@contextlib.asynccontextmanager
async def routers(a: Router, b: Router):
    """Two replicas that have met."""
    async with (
        replica(a.active, sessions=a.sessions) as sa,
        replica(b.active, [sa.address], sessions=b.sessions) as sb,
    ):
        sa.set_peers([sb.address])
        await wait_for(lambda: sa.live_peers() and sb.live_peers(), "peers to meet", within=20)
        yield sa, sb


async def test_a_session_opened_on_one_replica_is_sticky_on_the_other_and_closes_on_both():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0))
    async with routers(a, b):
        # the open is pinned to worker 2, so that B's unpinned turn lands there by the binding
        turn(a, "chat", "open", pin=2, timeout=60)
        assert a.sessions.binding("chat") == (2, 0)
        await wait_for(lambda: b.sessions.binding("chat") == (2, 0), "B to hold A's binding")
        follow = turn(b, "chat")
        assert (follow.decode.worker_id, follow.decode.sticky) == (2, True)
        binding = b.sessions.get("chat")
        assert binding is not None and binding.engine_backed and binding.ttl_s == 60
        close = turn(b, "chat", "close")
        assert close.decode.worker_id == 2 and b.sessions.binding("chat") is None
        await wait_for(lambda: a.sessions.get("chat") is None, "A to drop the closed session")
        assert not turn(a, "chat").decode.sticky


async def test_a_late_joiner_gets_the_bindings_from_the_snapshot_with_their_time_left():
    clock_a, clock_c = Clock(1000.0), Clock(5.0)
    a, c = make_router(clock_a), make_router(clock_c)
    async with replica(a.active, sessions=a.sessions) as sa:
        turn(a, "early", "bind", pin=3, timeout=60)
        turn(a, "gone", "bind", pin=1, timeout=10)
        clock_a.now += 20  # 40 s left of "early"; "gone" has expired
        async with replica(c.active, [sa.address], sessions=c.sessions):
            await wait_for(lambda: c.sessions.binding("early") == (3, 0), "C to get the binding")
            binding = c.sessions.get("early")
            assert binding is not None and binding.expires_at == clock_c.now + 40
            assert c.sessions.get("gone") is None  # expired bindings are not sent
            assert (turn(c, "early").decode.worker_id, c.sessions.binding("early")) == (3, (3, 0))


async def test_refreshes_and_timeouts_hold_on_both_replicas():
    clock_a, clock_b = Clock(1000.0), Clock(5.0)
    a, b = make_router(clock_a), make_router(clock_b)
    async with routers(a, b):
        turn(a, "s", "bind", pin=1, timeout=30)
        await wait_for(lambda: b.sessions.binding("s") == (1, 0), "B to hold the binding")
        clock_a.now += 20
        clock_b.now += 20
        turn(b, "s")  # a turn through B: 30 s again from now, on both
        # 30 s left when B sent it, on A's clock: the clocks, 995 s apart, never meet
        await wait_for(
            lambda: getattr(a.sessions.get("s"), "expires_at", None) == clock_a.now + 30,
            "A to take B's refresh",
        )
        clock_a.now += 25
        clock_b.now += 25
        # 45 s after the bind: without the refresh both would have dropped it at 30
        assert a.sessions.binding("s") == b.sessions.binding("s") == (1, 0)
        clock_a.now += 10
        clock_b.now += 10
        assert a.sessions.binding("s") is None and b.sessions.binding("s") is None
        assert not turn(a, "s").decode.sticky and not turn(b, "s").decode.sticky


async def test_bindings_from_a_peer_keep_the_lru_bound():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0), max_sessions=2)
    async with routers(a, b):
        for sid, worker in (("s1", 1), ("s2", 2), ("s3", 3)):
            turn(a, sid, "bind", pin=worker)
        await wait_for(lambda: b.sessions.binding("s3") == (3, 0), "B to hold the last binding")
        assert [sid for sid, _ in b.sessions.live()] == ["s2", "s3"]
        assert a.sessions.binding("s1") == (1, 0)  # A's own bound is its own


async def test_a_binding_evicted_by_the_lru_bound_is_not_closed_on_the_peers():
    a, b = make_router(Clock(1000.0), max_sessions=1), make_router(Clock(5.0))
    async with routers(a, b):
        turn(a, "s1", "bind", pin=1)
        await wait_for(lambda: b.sessions.binding("s1") == (1, 0), "B to hold s1")
        turn(a, "s1")  # within one loop turn: s1 refreshed, then evicted from A's table by s2
        turn(a, "s2", "bind", pin=2)
        await wait_for(lambda: b.sessions.binding("s2") == (2, 0), "B to hold s2")
        assert a.sessions.get("s1") is None and b.sessions.binding("s1") == (1, 0)


async def test_two_replicas_binding_one_session_at_once_agree():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0))
    async with routers(a, b) as (sa, sb):
        # within one loop turn, before either has sent anything: a conflict
        turn(a, "both", "bind", pin=1)
        turn(b, "both", "bind", pin=2)
        winner = (1, 0) if sa.id > sb.id else (2, 0)  # the larger stamp: same clock, larger id
        await wait_for(
            lambda: a.sessions.binding("both") == b.sessions.binding("both") == winner,
            "both replicas to keep the same write",
        )


async def test_a_close_lost_in_a_gap_is_repaired_by_the_snapshot():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0))
    async with routers(a, b) as (sa, sb):
        turn(a, "chat", "bind", pin=2, timeout=60)
        await wait_for(lambda: b.sessions.binding("chat") == (2, 0), "B to hold A's binding")
        sa._seq += 1  # as if the message carrying the close had been dropped on the way
        turn(a, "chat", "close")
        # B notices the gap, asks again, and the snapshot must carry the close
        await wait_for(lambda: b.sessions.get("chat") is None, "B to close A's session", within=10)
        assert sb.gaps == 1


async def test_a_snapshot_holds_only_what_a_replica_before_1351fb4_reads_the_closes_follow_it():
    """Before 1351fb4 every snapshot entry but `sb` was read as a booking (a 5-field `sc` fails
    to unpack, and the whole snapshot is dropped): the closes go in the events message right
    after the snapshot, where that version applies an `sc` by its last two fields (the stamp)."""
    a = make_router(Clock(1000.0))
    async with replica(a.active, sessions=a.sessions) as sa:
        turn(a, "kept", "bind", pin=1)
        turn(a, "gone", "bind", pin=2)
        turn(a, "gone", "close")
        context = zmq.Context()
        sub = context.socket(zmq.SUB)  # a bare subscriber: its subscription brings a snapshot
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(sa.address)
        frames: list[list] = []

        def snapshot_and_the_next_message() -> bool:
            with contextlib.suppress(zmq.Again):
                while True:
                    frames.append(msgpack.unpackb(sub.recv(zmq.NOBLOCK)))
            kinds = [frame[3] for frame in frames]
            return "s" in kinds[:-1]

        try:
            await wait_for(snapshot_and_the_next_message, "A's snapshot and the message after it")
        finally:
            sub.close()
            context.term()
        at = [frame[3] for frame in frames].index("s")
        snapshot, after = frames[at], frames[at + 1]
        assert [entry[:2] for entry in snapshot[4]] == [["sb", "kept"]]
        assert (after[2], after[3]) == (snapshot[2] + 1, "e")
        assert [entry[:2] for entry in after[4]] == [["sc", "gone"]]


async def test_a_close_through_a_replica_that_never_held_the_binding_closes_it_on_the_peers():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0))
    async with routers(a, b):
        # within one loop turn, before either has sent anything: B closes a session it has not
        # heard of; B's clock is ahead (two writes of its own), so its close is the later write
        turn(b, "other", "bind", pin=1)
        turn(b, "other")
        turn(a, "chat", "bind", pin=2)
        turn(b, "chat", "close")
        await wait_for(lambda: a.sessions.get("chat") is None, "A to drop the chat B closed")
        turn(a, "after", "bind", pin=3)  # sent after A's bind of chat: B has seen that by then
        await wait_for(lambda: b.sessions.binding("after") == (3, 0), "B to hold A's next bind")
        assert b.sessions.get("chat") is None  # A's older bind did not bind it on B


async def test_a_bind_stamped_after_a_close_through_another_replica_survives_it():
    a, b = make_router(Clock(1000.0)), make_router(Clock(5.0))
    async with routers(a, b):
        # one loop turn again, A's clock ahead this time: its bind is the later write
        turn(a, "other", "bind", pin=1)
        turn(a, "other")
        turn(b, "chat", "close")
        turn(a, "chat", "bind", pin=2)
        await wait_for(lambda: b.sessions.binding("chat") == (2, 0), "B to take A's later bind")
        turn(b, "after", "bind", pin=3)  # sent after B's close: A has seen that by then
        await wait_for(lambda: a.sessions.binding("after") == (3, 0), "A to hold B's next bind")
        assert a.sessions.binding("chat") == (2, 0)  # B's older close did not drop it


# -- closes, message by message: a ReplicaSync's apply path, its sockets never started ----------

A, B = 1, 2  # the peers' replica ids (smaller than any random one of ours)


@contextlib.asynccontextmanager
async def offline(clock: Clock, max_sessions: int = 100):
    """A replica's sessions and sync, fed the peers' messages by `deliver` (no sockets)."""
    sessions = StickySessions(300.0, max_sessions, clock)
    sync = ReplicaSync(ActiveRequests(), ReplicaSettings("tcp://127.0.0.1:0"), sessions=sessions)
    sessions.observer = sync
    for peer in (A, B):
        sync._apply(peer, f"epp-{peer}", 0, "s", [])  # met: their events apply in order
    try:
        yield sessions, sync
    finally:
        await sync.close()


def deliver(sync: ReplicaSync, peer: int, seq: int, *events: list) -> None:
    sync._apply(peer, f"epp-{peer}", seq, "e", list(events))


def bind(sid: str, clock: int, replica: int) -> list:
    return ["sb", sid, 1, 0, None, 60.0, 60.0, False, clock, replica]


def close(sid: str, clock: int, replica: int, kept: float = 60.0) -> list:
    return ["sc", sid, kept, clock, replica]


async def test_a_close_that_arrives_before_the_bind_it_closes_wins():
    async with offline(Clock(5.0)) as (sessions, sync):
        # A bound at (1, A), B saw it and closed at (2, B); B's close arrives here first
        deliver(sync, B, 1, close("s", 2, B))
        deliver(sync, A, 1, bind("s", 1, A))
        assert sessions.get("s") is None
        deliver(sync, A, 2, bind("s", 3, A))  # a bind after the close (a reopen) binds
        assert sessions.binding("s") == (1, 0)


async def test_a_replica_that_closed_a_session_ignores_a_peer_s_older_write_of_it():
    async with offline(Clock(5.0)) as (sessions, sync):
        deliver(sync, A, 1, bind("s", 1, A))
        sessions.unbind("s")  # closed here at (2, ours)
        deliver(sync, A, 2, bind("s", 2, A))  # A's refresh, made before it heard of the close
        assert sessions.get("s") is None


async def test_closes_in_the_wire_shapes_of_earlier_replicas_are_applied():
    clock = Clock(5.0)
    async with offline(clock) as (sessions, sync):
        deliver(sync, A, 1, bind("held", 1, A))  # a 60 s timeout
        # a replica before 1351fb4 sends ["sc", session id, clock, replica id]: no seconds
        deliver(sync, B, 1, ["sc", "held", 2, B], ["sc", "unheld", 2, B])
        assert sessions.get("held") is None
        clock.now += 30  # past 2 s (the clock, once read as the seconds), within both timeouts
        deliver(sync, A, 2, bind("held", 1, A), bind("unheld", 1, A))  # made before the closes
        assert sessions.get("held") is None and sessions.get("unheld") is None
        # a replica from 1351fb4 to the fix put its closes in the snapshot
        sync._apply(A, "epp-1", 3, "s", [bind("snap", 1, A), close("snap", 2, A)])
        assert sessions.get("snap") is None


async def test_closes_are_remembered_for_their_time_and_within_the_table_s_bound():
    clock = Clock(5.0)
    async with offline(clock, max_sessions=2) as (sessions, sync):
        deliver(sync, B, 1, close("s1", 2, B), close("s2", 2, B), close("s3", 2, B, kept=30))
        assert len(sync._closed) == 2  # as many closes as bindings: the oldest is forgotten
        deliver(sync, A, 1, bind("s1", 1, A), bind("s2", 1, A), bind("s3", 1, A))
        assert [sid for sid, _ in sessions.live()] == ["s1"]
        clock.now += 30  # s3's close is past its time; s2's has 30 s left
        deliver(sync, A, 2, bind("s2", 1, A), bind("s3", 1, A))
        assert [sid for sid, _ in sessions.live()] == ["s1", "s3"]
