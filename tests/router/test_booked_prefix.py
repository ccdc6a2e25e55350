"""`RouterConfig.booked_prefix_hits` (default on): in a request's wait on a worker, the prompt
blocks that live requests there already hold count as computed before any KV event says they
are stored, so the requests of a fan-out over one long context, routed while the first still
prefills it, follow it instead of each computing it elsewhere. The fleet's work
(`prefill-work`) and a conversation's home (the kv picker's `home_margin`) count stored blocks
only. Off, only stored blocks count (Dynamo's overlap)."""

import pytest

from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.scheduler import Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 16
CONTEXT = list(range(300 * BS))  # a shared context of 300 blocks


def prompt(user: int) -> list[int]:
    return CONTEXT + [100_000 + user * 1000 + i for i in range(10 * BS)]  # 10 blocks of its own


def request(rid: str, user: int, *, query_only: bool = False) -> RouteRequest:
    tokens = prompt(user)
    return RouteRequest(rid, block_hash_array(tokens, BS), len(tokens), query_only=query_only)


def router(workers=(1, 2), **config) -> Router:
    r = Router(RouterConfig(seed=3, **config))
    for wid in workers:
        r.add_worker(wid, block_size=BS, total_blocks=100_000)
    return r


def test_a_fan_out_follows_the_first_prefill_of_its_context():
    r = router()
    first = r.schedule(request("a", 1))
    home = first.decode.worker_id
    assert first.decode.overlap_blocks == 0  # nothing stored or held anywhere yet
    # the other worker is busy, so waiting for the context here beats computing it there
    other = 3 - home
    busy = r.active.book((other, 0), prompt_blocks=200, prefill_blocks=200)
    followers = [r.schedule(request(f"b{i}", 2 + i)) for i in range(3)]
    assert [d.decode.worker_id for d in followers] == [home] * 3
    assert all(d.decode.overlap_blocks == 300 for d in followers)
    # each books only its own 10 blocks to prefill behind the first's 310
    assert r.active.load((home, 0)).prefill_blocks == 310 + 3 * 10
    for d in (first, *followers):
        d.guard.free()
    r.active.free(busy)
    # no live request holds the context any more, and no KV event stored it: nothing overlaps
    assert r.schedule(request("c", 9, query_only=True)).decode.overlap_blocks == 0


def test_off_only_stored_blocks_count_and_the_fan_out_computes_the_context_again():
    r = router(booked_prefix_hits=False)
    first = r.schedule(request("a", 1))
    other = 3 - first.decode.worker_id
    busy = r.active.book((other, 0), prompt_blocks=200, prefill_blocks=200)
    second = r.schedule(request("b", 2, query_only=True)).decode
    # 310 queued + 310 of its own against 200 queued + 310: it goes to compute it again
    assert (second.worker_id, second.overlap_blocks) == (other, 0)
    first.guard.free()
    r.active.free(busy)


def test_an_idle_worker_still_takes_a_follower_that_would_wait_as_long():
    # Both ways take 310 blocks of prefill before the first token (the first's prefill, or the
    # context computed again); held blocks are not fleet work saved (prefill-work counts stored
    # blocks only), so the cost is even and the load term sends it to the idle worker.
    r = router()
    first = r.schedule(request("a", 1))
    second = r.schedule(request("b", 2, query_only=True)).decode
    assert second.worker_id != first.decode.worker_id
    first.guard.free()


def test_a_held_prefix_makes_no_home():
    # worker 1 holds the context only through a prefill under way; worker 2 is over 25 %
    # cheaper: with a home there the default margin would keep the request on worker 1
    r = router()
    held = r.schedule(request("a", 1))
    home = held.decode.worker_id
    queued = r.active.book((home, 0), prompt_blocks=400, prefill_blocks=400)
    pick = r.schedule(request("b", 2, query_only=True)).decode
    assert pick.worker_id == 3 - home
    held.guard.free()
    r.active.free(queued)


def test_a_held_prefix_shorter_than_the_stored_one_does_not_lower_the_overlap():
    r = router()
    tokens = prompt(1)
    stored = BlockStored([5000 + i for i in range(310)], None, tokens, BS, None)
    assert r.apply_kv_batch(1, 0, EventBatch(0.0, [stored])) is None
    guard = r.active.book((1, 0), prompt_blocks=310, prefill_blocks=0)  # holds no keys
    pick = r.schedule(request("b", 1, query_only=True)).decode
    assert (pick.worker_id, pick.overlap_blocks) == (1, 310)
    r.active.free(guard)
