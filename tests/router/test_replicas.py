"""Replica sync (router/replicas.py) between ReplicaSync instances on real ZMQ sockets on
127.0.0.1 in one event loop: what a peer's ActiveRequests holds after bookings, progress and
frees; a lost message answered by a snapshot; a replica restarting under its name replacing its
old self without waiting for the timeout."""

import contextlib

import numpy as np

from dynamograph.router.active import ActiveRequests
from dynamograph.router.replicas import ReplicaSettings, ReplicaSync
from e2e.waiting import wait_for

SLOT = (7, 0)


@contextlib.asynccontextmanager
async def replica(active: ActiveRequests, peers=(), *, name: str = "", bind="tcp://127.0.0.1:0"):
    sync = ReplicaSync(
        active,
        ReplicaSettings(bind, list(peers), heartbeat_s=0.1, timeout_s=60.0, name=name),
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
