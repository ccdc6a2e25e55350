"""With `RouterConfig.booked_prefix_hits` a prompt's overlap counts the blocks live requests on a
worker already hold: the second request of a fan-out over one long context, routed while the
first still prefills it and before any KV event says a block is stored, follows the first
instead of finding the context uncached everywhere. By default (Dynamo's overlap) only stored
blocks count."""

import pytest

from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.scheduler import Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 16
SYSTEM = list(range(30 * BS))  # a shared context of 30 blocks


def prompt(user: int) -> list[int]:
    return SYSTEM + [100_000 + user * 1000 + i for i in range(10 * BS)]  # 10 blocks of its own


def request(rid: str, user: int, *, query_only: bool = False) -> RouteRequest:
    tokens = prompt(user)
    return RouteRequest(rid, block_hash_array(tokens, BS), len(tokens), query_only=query_only)


def router(**config) -> Router:
    r = Router(RouterConfig(seed=3, **config))
    for wid in (1, 2):
        r.add_worker(wid, block_size=BS, total_blocks=1000)
    return r


def test_a_second_request_follows_the_first_prefill_of_its_context():
    r = router(booked_prefix_hits=True)
    first = r.schedule(request("a", 1))
    home = first.decode.worker_id
    assert first.decode.overlap_blocks == 0  # nothing stored or held anywhere yet
    second = r.schedule(request("b", 2))
    assert second.decode.worker_id == home
    assert second.decode.overlap_blocks == 30
    # it books only its own 10 blocks to prefill beside the first's 40
    assert r.active.load((home, 0)).prefill_blocks == 40 + 10
    second.guard.free()
    first.guard.free()
    # no live request holds the prompt any more, and no KV event stored it: nothing overlaps
    assert r.schedule(request("c", 3, query_only=True)).decode.overlap_blocks == 0


def test_by_default_only_stored_blocks_count_and_the_second_request_goes_to_the_idle_worker():
    r = router()
    first = r.schedule(request("a", 1))
    second = r.schedule(request("b", 2, query_only=True))
    assert second.decode.worker_id != first.decode.worker_id
    assert second.decode.overlap_blocks == 0
    first.guard.free()


def test_a_held_prefix_shorter_than_the_stored_one_does_not_lower_the_overlap():
    r = router(booked_prefix_hits=True)
    tokens = prompt(1)
    stored = BlockStored([5000 + i for i in range(40)], None, tokens, BS, None)
    assert r.apply_kv_batch(1, 0, EventBatch(0.0, [stored])) is None
    guard = r.active.book((1, 0), prompt_blocks=40, prefill_blocks=0)  # holds no keys
    pick = r.schedule(request("b", 1, query_only=True)).decode
    assert (pick.worker_id, pick.overlap_blocks) == (1, 40)
    r.active.free(guard)
