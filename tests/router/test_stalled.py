"""The `stalled` filter (default profile): a slot whose requests wait for the engine with no
progress for `timeout_s` is left out until it shows some; answers under way do not count, and
when every slot has stalled none is left out. Time is moved by ageing `ActiveRequests.progress`
(when each slot last showed progress), not by sleeping."""

import pytest

from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.router.scheduler import Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 16
TOKENS = list(range(64))


def router() -> Router:
    r = Router()  # the default profile: stalled, then busy
    for wid in (1, 2, 3):
        r.add_worker(wid, block_size=BS, total_blocks=1000)
    batch = EventBatch(0.0, [BlockStored([11, 12, 13, 14], None, TOKENS, BS, None)])
    assert r.apply_kv_batch(2, 0, batch) is None  # worker 2 holds the prompt: it wins
    return r


def book(r: Router, name: str, on: int | None = None):
    hashes = block_hash_array(TOKENS, BS)
    decision = r.schedule(
        RouteRequest(name, hashes, len(TOKENS), allowed_ids=on and frozenset([on]))
    )
    return decision.decode.worker_id, decision.guard


def route(r: Router) -> int:
    request = RouteRequest("q", block_hash_array(TOKENS, BS), len(TOKENS), query_only=True)
    return r.schedule(request).decode.worker_id


def age(r: Router) -> None:
    """Every slot last showed progress long ago (monotonic 0)."""
    r.active.progress[:] = 0.0


def test_a_slot_waiting_on_a_silent_engine_is_left_out_until_it_answers():
    r = router()
    worker, guard = book(r, "a")
    assert worker == 2
    age(r)
    assert route(r) != 2
    guard.mark_prefill_done()  # its first output: the engine works
    assert route(r) == 2
    guard.free()


def test_a_slot_busy_with_answers_under_way_is_not_stalled():
    r = router()
    _, guard = book(r, "a")
    guard.mark_prefill_done()
    age(r)  # a long, quiet stream
    assert route(r) == 2
    guard.free()


def test_when_every_slot_has_stalled_none_is_left_out():
    r = router()
    booked = [book(r, f"r{wid}", on=wid) for wid in (1, 2, 3)]  # one waiting on every worker
    age(r)
    assert route(r) in (1, 2, 3)
    for _, guard in booked:
        guard.free()
