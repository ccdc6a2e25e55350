"""Scheduler behaviour: cost, pins, query-only, approximate mode, disaggregation, sticky sessions,
backpressure, pickers and KV-event sequencing (docs/router.md)."""

import math
from collections import Counter

import numpy as np
import pytest

from dynamograph.protocol.engine import Role
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.headers import parse_routing_headers
from dynamograph.protocol.kv_events import AllBlocksCleared, BlockStored, EventBatch
from dynamograph.protocol.nvext import NvExt, SessionControl
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.router_config import PluginRef, RouterConfig, ScorerRef, dynamo_scorers
from dynamograph.router.errors import ContextTooLong
from dynamograph.router.prefills import MAX_MARKS, prefill_marks
from dynamograph.router.scheduler import (
    NoEligibleWorker,
    Overloaded,
    Router,
    RouteRequest,
)

pytestmark = pytest.mark.unit

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def make_router(workers=(1, 2, 3), clock=None, **config) -> Router:
    """A router with Dynamo's cost unless `scorers` are given: these tests check the cost's
    arithmetic in its terms (the default TTFT cost: test_ttft_cost.py)."""
    config.setdefault("scorers", dynamo_scorers())
    router = Router(RouterConfig(seed=7, **config), clock=clock or Clock())
    for w in workers:
        router.add_worker(w, block_size=BS, total_blocks=1000)
    return router


def request(toks, rid="r", lora=None, **kw) -> RouteRequest:
    return RouteRequest(rid, block_hashes(toks, BS, lora), len(toks), lora_name=lora, **kw)


_seq: Counter = Counter()


def cache(router: Router, worker: int, toks, rank: int = 0, lora_id=None, lora_name=None) -> None:
    """Worker `worker` reports the full blocks of `toks` as stored (one chain, from the root)."""
    n = len(toks) // BS
    engine = [hash((worker, rank, tuple(toks[: (i + 1) * BS]))) & (2**63 - 1) for i in range(n)]
    stored = BlockStored(engine, None, toks[: n * BS], BS, lora_id, lora_name=lora_name)
    batch = EventBatch(0.0, [stored], data_parallel_rank=rank)
    seq = _seq[(id(router), worker, rank)]
    _seq[(id(router), worker, rank)] += 1
    assert router.apply_kv_batch(worker, seq, batch) is None


# -- cost and temperature -------------------------------------------------------------------


def test_engine_storing_the_prompt_settles_its_pending_prefill():
    """Behind a gateway a non-streaming answer shows no first token until the end; the KV
    events of the booked worker storing the whole prompt end the prefill load instead."""
    router = make_router(workers=(1, 2))
    prompt = tokens(42)  # 10 full blocks + a partial one
    d = router.schedule(request(prompt))
    slot = (d.decode.worker_id, d.decode.dp_rank)
    other = 3 - slot[0]
    assert router.active.load(slot).prefill_blocks == 11
    cache(router, other, prompt)  # another worker storing it settles nothing here
    cache(router, slot[0], prompt[:20])  # the first chunk (5 blocks): 6 left to compute
    assert router.active.load(slot).prefill_blocks == 6 and not d.guard.prefill_done
    cache(router, slot[0], prompt)
    assert router.active.load(slot).prefill_blocks == 0 and d.guard.prefill_done
    assert router.active.load(slot).decode_blocks == 11  # still decoding: blocks held
    d.guard.free()
    assert router.active.loads() == {} and not router.active.awaits_stored_blocks(slot)


def _pending_marks(router: Router, slot) -> int:
    return len(router.active.load(slot).pending)


def test_prefill_waits_on_its_last_block_at_its_position():
    """A prompt of one repeated block: the engine storing that block's content at the first
    position is not the prompt's last block stored (marks are prefix keys, not block hashes)."""
    router = make_router(workers=(1,))
    prompt = [7] * (BS * 6)  # six identical blocks
    d = router.schedule(request(prompt))
    assert d.guard.awaits_stored_blocks
    cache(router, 1, prompt[:BS])
    assert not d.guard.prefill_done and d.guard.awaits_stored_blocks
    cache(router, 1, prompt)
    assert d.guard.prefill_done and not d.guard.awaits_stored_blocks
    assert _pending_marks(router, (1, 0)) == 0
    d.guard.free()


def test_short_or_cached_prompts_are_not_left_to_kv_events():
    """No new full block to store, no event to wait for: the caller's own sign ends those."""
    router = make_router(workers=(1,))
    short = router.schedule(request(tokens(BS - 1), rid="short"))
    assert not short.guard.awaits_stored_blocks
    prompt = tokens(BS * 5)
    cache(router, 1, prompt)
    cached = router.schedule(request(prompt, rid="cached"))
    assert cached.decode.overlap_blocks == 5 and not cached.guard.awaits_stored_blocks
    assert _pending_marks(router, (1, 0)) == 0
    short.guard.free()
    cached.guard.free()


@pytest.mark.parametrize(
    ("full", "cached", "blocks"), [(1, 0, 1), (1, 0, 2), (10, 3, 11), (1000, 0, 1001), (5, 5, 6)]
)
def test_prefill_marks(full, cached, blocks):
    """The last full block's mark leaves nothing; the others, evenly spaced over the uncached
    blocks, leave strictly less and less; never more than MAX_MARKS; none when all is cached."""
    keys = np.arange(100, 100 + full, dtype=np.uint64)
    marks = prefill_marks(keys, cached, blocks)
    if full <= cached:
        assert marks == ()
        return
    assert 1 <= len(marks) <= MAX_MARKS
    assert marks[-1] == (int(keys[-1]), 0)
    left = [remaining for _, remaining in marks]
    assert left == sorted(left, reverse=True) and len(set(left)) == len(left)
    assert all(int(keys[cached]) <= key for key, _ in marks)  # only uncached blocks
    assert len(marks) == min(MAX_MARKS, full - cached)


def test_a_long_prefill_is_watched_with_few_marks_and_shrinks_as_it_goes():
    router = make_router(workers=(1,))
    prompt = tokens(BS * 1000)
    d = router.schedule(request(prompt))
    slot = (1, 0)
    assert _pending_marks(router, slot) == 16  # MAX_MARKS, whatever the prompt's length
    cache(router, 1, prompt[: BS * 500])  # a chunk: the booked prefill shrinks at a mark
    assert 500 <= router.active.load(slot).prefill_blocks < 1000
    assert _pending_marks(router, slot) < 16
    d.guard.mark_prefill_done()  # the first token came first: nothing is waited on any more
    assert _pending_marks(router, slot) == 0 and not d.guard.awaits_stored_blocks
    d.guard.free()


@pytest.mark.parametrize("end", ["free", "collected", "worker_removed"])
def test_pending_prefill_marks_cannot_outlive_their_request(end):
    """However a request ends before its prompt is stored (answered, failed, client gone, its
    guard dropped, its worker gone), the slot waits on none of its marks any more."""
    router = make_router(workers=(1,))
    keep = router.schedule(request(tokens(BS * 8, 50_000), rid="other"))  # keeps the slot busy
    d = router.schedule(request(tokens(BS * 8), rid="r"))
    slot = (1, 0)
    assert _pending_marks(router, slot) == 16
    if end == "free":
        d.guard.free()
    elif end == "collected":
        del d
        router.active.reap()
    else:
        router.remove_worker(1)
        router.add_worker(1, block_size=BS, total_blocks=1000)
    assert _pending_marks(router, slot) == (8 if end != "worker_removed" else 0)
    keep.guard.free()
    assert _pending_marks(router, slot) == 0


def test_requests_sharing_a_prefix_load_the_worker_once():
    """Decode load counts a slot's distinct prompt blocks (Dynamo's unique blocks): live
    requests on one system prompt must not push the next one off the worker that caches it."""
    router = make_router(workers=(1, 2))
    system = tokens(360)
    cache(router, 1, system)
    guards = [
        router.schedule(request(system + tokens(40, 10_000 * (i + 1)), rid=f"r{i}")).guard
        for i in range(3)
    ]
    for g in guards:
        g.mark_prefill_done()  # decoding now: only their KV blocks load the worker
    d = router.schedule(request(system + tokens(40, 90_000), rid="next"))
    # worker 1: 10 uncached + (90 shared + 3 × 10 own) booked + 10 new = 140;
    # worker 2 (idle, cold): 100 uncached + 100 new = 200. Counted per request, worker 1
    # would have cost 10 + 300 + 100 = 410 and lost.
    assert (d.decode.worker_id, d.decode.cost) == (1, 140)
    d.guard.free()
    for g in guards:
        g.free()
    assert router.active.loads() == {}


def test_prefers_the_worker_holding_the_prefix():
    router = make_router()
    prompt = tokens(64)
    cache(router, 2, prompt[:48])
    d = router.schedule(request(prompt))
    assert (d.decode.worker_id, d.decode.overlap_blocks) == (2, 12)
    # cost = overlap_weight · prefill + decode: 4 uncached blocks + 16 prompt blocks
    assert d.decode.cost == 1.0 * 4 + 16


def test_load_outweighs_a_small_overlap():
    router = make_router(workers=(1, 2))
    prompt = tokens(40)
    cache(router, 1, prompt[:8])  # 2 of 10 blocks cached on worker 1
    router.active.book((1, 0), prompt_blocks=30, prefill_blocks=0)  # but it is busy
    assert router.schedule(request(prompt)).decode.worker_id == 2
    # with no weight on prefill, only the decode load counts
    router2 = make_router(workers=(1, 2), scorers=dynamo_scorers(0.0))
    cache(router2, 2, prompt)
    router2.active.book((2, 0), prompt_blocks=1, prefill_blocks=0)
    assert router2.schedule(request(prompt)).decode.worker_id == 1


def test_temperature_zero_is_deterministic_and_ties_go_to_the_least_loaded():
    prompt = tokens(32)
    picks = set()
    for seed in range(5):
        router = Router(RouterConfig(seed=seed), clock=Clock())
        for w in (1, 2, 3):
            router.add_worker(w, block_size=BS, total_blocks=1000)
        cache(router, 3, prompt)
        picks.add(router.schedule(request(prompt, query_only=True)).decode.worker_id)
    assert picks == {3}
    # equal cost (no cache, no booked blocks), but worker 2 has more booked requests: the tie
    # goes to the least loaded
    router = make_router(workers=(1, 2))
    router.active.book((1, 0), prompt_blocks=0, prefill_blocks=0)
    router.active.book((2, 0), prompt_blocks=0, prefill_blocks=0)
    router.active.book((2, 0), prompt_blocks=0, prefill_blocks=0)
    assert {
        router.schedule(request(prompt, query_only=True)).decode.worker_id for _ in range(20)
    } == {1}


def test_exact_ties_are_broken_at_random_but_reproducibly():
    def picks(seed):
        router = Router(RouterConfig(seed=seed), clock=Clock())
        for w in range(1, 9):
            router.add_worker(w, block_size=BS, total_blocks=1000)
        return [
            router.schedule(request(tokens(8), query_only=True)).decode.worker_id for _ in range(30)
        ]

    assert picks(1) == picks(1)
    assert len(set(picks(1))) > 3


def test_softmax_sampling_follows_normalised_costs():
    router = make_router(workers=(1, 2, 3), temperature=0.5)
    prompt = tokens(40)
    cache(router, 1, prompt)  # cost 10 (nothing to prefill)
    cache(router, 2, prompt[:20])  # cost 15
    counts = Counter(
        router.schedule(request(prompt, query_only=True)).decode.worker_id for _ in range(3000)
    )
    costs = {1: 10.0, 2: 15.0, 3: 20.0}
    weights = {w: math.exp(-((c - 10) / 10) / 0.5) for w, c in costs.items()}
    total = sum(weights.values())
    for w, weight in weights.items():
        assert counts[w] / 3000 == pytest.approx(weight / total, abs=0.03)


# -- pins -----------------------------------------------------------------------------------


def test_decode_pin_bypasses_selection_and_is_booked():
    router = make_router()
    prompt = tokens(32)
    cache(router, 1, prompt)
    router.set_ready(3, False)  # pins skip the filters, readiness included
    d = router.schedule(request(prompt, pins=RoutePins(worker_id=3)))
    assert (d.decode.worker_id, d.decode.pinned, d.prefill) == (3, True, None)
    assert router.active.load((3, 0)).requests == 1
    d.guard.free()
    assert router.active.loads() == {}


def test_dp_rank_pin_and_best_rank_of_a_pinned_worker():
    router = Router(RouterConfig(seed=1), clock=Clock())
    router.add_worker(5, dp_size=4, block_size=BS, total_blocks=1000)
    prompt = tokens(32)
    cache(router, 5, prompt, rank=2)
    assert router.schedule(request(prompt, pins=RoutePins(worker_id=5))).decode.dp_rank == 2
    d = router.schedule(request(prompt, pins=RoutePins(worker_id=5, dp_rank=3)))
    assert (d.decode.dp_rank, d.decode.overlap_blocks) == (3, 0)
    with pytest.raises(NoEligibleWorker, match=r"ranks 0\.\.3, not 4"):
        router.schedule(request(prompt, pins=RoutePins(worker_id=5, dp_rank=4)))
    with pytest.raises(NoEligibleWorker, match="worker 9 is not registered") as err:
        router.schedule(request(prompt, pins=RoutePins(worker_id=9)))
    assert err.value.status == 503


def test_pins_per_phase_in_disaggregated_mode():
    router = make_router(workers=(1, 2))
    for w in (10, 11):
        router.add_worker(w, role=Role.PREFILL, block_size=BS, total_blocks=1000)
    prompt = tokens(32)
    cache(router, 11, prompt)
    only_prefill = router.schedule(request(prompt, pins=RoutePins(prefill_worker_id=10)))
    assert only_prefill.prefill.worker_id == 10 and only_prefill.prefill.pinned
    assert not only_prefill.decode.pinned
    only_decode = router.schedule(request(prompt, pins=RoutePins(worker_id=2)))
    assert only_decode.prefill.worker_id == 11 and not only_decode.prefill.pinned  # KV overlap
    assert only_decode.decode.worker_id == 2 and only_decode.decode.pinned
    loads = router.active.loads()
    assert loads[(10, 0)].requests == loads[(11, 0)].requests == 1


def test_pins_from_nvext_and_headers():
    nvext = NvExt(backend_instance_id=4, prefill_worker_id=6, dp_rank=1, prefill_dp_rank=0)
    assert RoutePins.from_nvext(nvext) == RoutePins(4, 1, 6, 0)
    assert RoutePins.from_nvext(NvExt(decode_worker_id=8, backend_instance_id=4)).worker_id == 8
    assert RoutePins.from_nvext(None) == RoutePins()
    headers = parse_routing_headers({"x-worker-instance-id": "12", "x-dp-rank": "2"})
    assert RoutePins.from_headers(headers) == RoutePins(12, 2, None, None)


# -- query-only and approximate mode --------------------------------------------------------


def test_query_only_books_and_records_nothing():
    router = make_router(use_kv_events=False)
    session = SessionControl(session_id="s1")
    d = router.schedule(request(tokens(32), query_only=True, session=session))
    assert d.guard is None
    assert router.active.loads() == {}
    assert router.index.total_blocks() == 0
    assert router.sessions.binding("s1") is None


def test_approximate_mode_records_routed_blocks_for_a_ttl():
    clock = Clock()
    router = make_router(clock=clock, use_kv_events=False, approx_ttl_s=120)
    prompt = tokens(64)
    first = router.schedule(request(prompt))
    first.guard.free()
    again = router.schedule(request(prompt + tokens(8, 500), rid="again"))
    assert again.decode.worker_id == first.decode.worker_id
    assert again.decode.overlap_blocks == 16
    again.guard.free()
    clock.now += 119
    assert router.index.find_matches(block_hashes(prompt, BS))  # refreshed by `again`
    clock.now += 121
    router.schedule(request(tokens(4, 9000), rid="tick", query_only=True))  # expiry runs here
    assert router.index.find_matches(block_hashes(prompt, BS)) == {}


# -- disaggregation --------------------------------------------------------------------------


def disagg_router(**config) -> Router:
    router = make_router(workers=(1, 2), **config)
    for w in (10, 11):
        router.add_worker(w, role=Role.PREFILL, block_size=BS, total_blocks=1000)
    return router


def test_disaggregated_picks_prefill_by_overlap_and_decode_by_load_only():
    router = disagg_router()
    prompt = tokens(64)
    cache(router, 11, prompt)
    cache(router, 1, prompt)  # decode ignores the cache (overlap weight 0)
    router.active.book((1, 0), prompt_blocks=1, prefill_blocks=0)
    # prompt-side load on decode worker 2 (a prefill it would compute) does not count
    router.active.book((2, 0), prompt_blocks=0, prefill_blocks=500)
    d = router.schedule(request(prompt))
    assert d.disaggregated and d.prefill.worker_id == 11 and d.prefill.overlap_blocks == 16
    assert d.decode.worker_id == 2
    assert d.decode.cost == 16  # decode blocks only
    # the prefill booking ends with the prefill, the decode booking with the request
    assert router.active.load((11, 0)).prefill_blocks == 0  # fully cached: nothing to compute
    d.guard.mark_prefill_done()
    assert (11, 0) not in router.active.loads()
    assert router.active.load((2, 0)).requests == 2
    d.guard.free()
    assert router.active.load((2, 0)).requests == 1


def test_falls_back_to_aggregated_without_ready_prefill_workers():
    router = disagg_router()
    router.set_ready(10, False)
    router.set_ready(11, False)
    d = router.schedule(request(tokens(16)))
    assert d.prefill is None and not d.disaggregated
    assert d.fallback_reason == "no prefill worker is ready"
    assert d.decode.worker_id in (1, 2)


def test_enforced_disaggregation_refuses_with_the_reason():
    router = disagg_router(enforce_disagg=True)
    router.set_ready(10, False)
    router.set_ready(11, False)
    with pytest.raises(NoEligibleWorker, match="enforced but no prefill worker is ready"):
        router.schedule(request(tokens(16)))
    aggregated_only = make_router(enforce_disagg=True)
    with pytest.raises(NoEligibleWorker, match="no prefill worker is registered"):
        aggregated_only.schedule(request(tokens(16)))


# -- sticky sessions -------------------------------------------------------------------------


def test_sticky_session_open_binds_once_the_engine_accepted_refreshes_and_closes():
    clock = Clock()
    router = make_router(clock=clock)
    open_ = SessionControl(session_id="chat", action="open", timeout=60)
    first = router.schedule(request(tokens(16), session=open_))
    bound = (first.decode.worker_id, 0)
    assert router.sessions.binding("chat") is None  # the engine has not answered yet
    first.confirm_session()  # the engine accepted the open turn
    assert router.sessions.binding("chat") == bound
    other = next(w for w in (1, 2, 3) if w != bound[0])
    cache(router, other, tokens(64))  # a much better KV match elsewhere
    follow = SessionControl(session_id="chat")  # later turns name no action (nor timeout)
    d = router.schedule(request(tokens(64), session=follow))
    assert (d.decode.worker_id, d.decode.sticky) == (bound[0], True)
    clock.now += 50
    router.schedule(request(tokens(64), session=follow))  # refreshes by the binding's 60 s
    clock.now += 50
    assert router.sessions.binding("chat") == bound
    close = SessionControl(session_id="chat", action="close")
    assert router.schedule(request(tokens(64), session=close)).decode.worker_id == bound[0]
    assert router.sessions.binding("chat") is None
    assert router.schedule(request(tokens(64))).decode.worker_id == other


def test_open_refused_by_the_engine_binds_nothing():
    router = make_router()
    d = router.schedule(request(tokens(16), session=SessionControl(session_id="x", action="open")))
    d.guard.free()  # the engine's answer was an error: nobody confirms
    assert router.sessions.binding("x") is None


def test_bind_is_router_only_and_immediate_and_no_action_never_creates_a_binding():
    router = make_router()
    d = router.schedule(request(tokens(16), session=SessionControl(session_id="n")))
    assert router.sessions.binding("n") is None and d.session_open is None
    b = router.schedule(request(tokens(16), session=SessionControl(session_id="b", action="bind")))
    assert router.sessions.binding("b") == (b.decode.worker_id, 0)


def test_session_timeout_zero_binds_for_no_time():
    clock = Clock()
    router = make_router(clock=clock)
    zero = SessionControl(session_id="z", action="bind", timeout=0)
    first = router.schedule(request(tokens(16), session=zero))
    assert router.sessions.binding("z") is None  # expired at once
    cache(router, next(w for w in (1, 2, 3) if w != first.decode.worker_id), tokens(64))
    d = router.schedule(request(tokens(64), session=SessionControl(session_id="z")))
    assert not d.decode.sticky


def test_sticky_session_expires_and_rebinds_when_worker_goes():
    clock = Clock()
    router = make_router(clock=clock, session_ttl_s=30)
    s = SessionControl(session_id="a", action="bind")  # no timeout given: the router's default
    bound = router.schedule(request(tokens(16), session=s)).decode.worker_id
    clock.now += 31
    assert router.sessions.binding("a") is None
    bound = router.schedule(request(tokens(16), session=s)).decode.worker_id
    router.remove_worker(bound)
    moved = router.schedule(request(tokens(16), session=SessionControl(session_id="a")))
    assert moved.decode.worker_id != bound and not moved.decode.sticky
    assert router.sessions.binding("a") == (moved.decode.worker_id, 0)


def test_explicit_pin_disables_stickiness_for_that_phase():
    router = make_router()
    s = SessionControl(session_id="p", action="bind")
    bound = router.schedule(request(tokens(16), session=s)).decode.worker_id
    other = next(w for w in (1, 2, 3) if w != bound)
    d = router.schedule(request(tokens(16), session=s, pins=RoutePins(worker_id=other)))
    assert d.decode.worker_id == other and d.decode.pinned and not d.decode.sticky
    assert router.sessions.binding("p") == (bound, 0)  # the pin did not rebind


def test_sticky_slot_must_pass_the_hard_constraints():
    """A session bound to a worker without the request's LoRA adapter (or outside the
    caller's subset) is served where the constraints allow; the binding stays."""
    router = make_router(workers=(1,))
    router.add_worker(2, block_size=BS, total_blocks=1000, lora_names=["sql"])
    s = SessionControl(session_id="l", action="bind")
    router.schedule(request(tokens(16), session=s, pins=RoutePins(worker_id=1)))
    router.sessions.unbind("l")
    router.schedule(request(tokens(16), session=s, allowed_ids=frozenset({1})))
    assert router.sessions.binding("l") == (1, 0)
    follow = SessionControl(session_id="l")
    d = router.schedule(request(tokens(16), lora="sql", session=follow))
    assert (d.decode.worker_id, d.decode.sticky) == (2, False)
    with pytest.raises(NoEligibleWorker, match="subset"):
        router.schedule(request(tokens(16), session=follow, allowed_ids=frozenset({99})))
    assert router.sessions.binding("l") == (1, 0)
    assert router.schedule(request(tokens(16), session=follow)).decode.sticky


def test_prefill_phase_is_sticky_and_its_pins_turn_only_it_off():
    router = disagg_router()
    s = SessionControl(session_id="d", action="bind")
    first = router.schedule(request(tokens(16), session=s))
    bound_prefill, bound_decode = first.prefill.worker_id, first.decode.worker_id
    other = 21 - bound_prefill  # the other prefill worker (10 or 11)
    cache(router, other, tokens(64))  # a far better prefill match elsewhere
    follow = SessionControl(session_id="d")
    d = router.schedule(request(tokens(64), session=follow))
    assert (d.prefill.worker_id, d.prefill.sticky) == (bound_prefill, True)
    assert (d.decode.worker_id, d.decode.sticky) == (bound_decode, True)
    # a prefill pin turns off the prefill phase's stickiness only
    pinned = router.schedule(
        request(tokens(64), session=follow, pins=RoutePins(prefill_worker_id=other))
    )
    assert pinned.prefill.worker_id == other and pinned.prefill.pinned
    assert (pinned.decode.worker_id, pinned.decode.sticky) == (bound_decode, True)
    assert router.sessions.prefill_binding("d") == (bound_prefill, 0)


def test_dp_rank_only_pin_is_not_overridden_by_the_session():
    router = Router(RouterConfig(seed=7), clock=Clock())
    for w in (1, 2):
        router.add_worker(w, dp_size=2, block_size=BS, total_blocks=1000)
    s = SessionControl(session_id="r", action="bind")
    first = router.schedule(request(tokens(16), session=s, pins=RoutePins(dp_rank=0)))
    assert first.decode.dp_rank == 0 and router.sessions.binding("r")[1] == 0
    d = router.schedule(
        request(tokens(16), session=SessionControl(session_id="r"), pins=RoutePins(dp_rank=1))
    )
    assert d.decode.dp_rank == 1 and not d.decode.sticky
    with pytest.raises(NoEligibleWorker, match="data-parallel rank 2"):
        router.schedule(request(tokens(16), pins=RoutePins(dp_rank=2)))


# -- filters and backpressure ----------------------------------------------------------------


def test_backpressure_when_every_worker_is_saturated():
    router = make_router(busy_threshold=0.9, retry_after_s=2)
    for w in (1, 2, 3):
        router.update_load(w, kv_usage=0.95, waiting=4, running=10)
    with pytest.raises(Overloaded) as err:
        router.schedule(request(tokens(16)))
    assert err.value.status == 503 and err.value.retry_after_s == 2
    router.update_load(2, kv_usage=0.5)
    assert router.schedule(request(tokens(16))).decode.worker_id == 2
    # booked blocks count too: 1000 total, 950 booked on worker 2
    router.active.book((2, 0), prompt_blocks=950, prefill_blocks=0)
    with pytest.raises(Overloaded):
        router.schedule(request(tokens(16)))


def test_busy_is_strictly_over_the_threshold_and_a_dp_worker_only_when_every_rank_is():
    router = Router(RouterConfig(seed=7, busy_threshold=0.9), clock=Clock())
    router.add_worker(1, dp_size=2, block_size=BS, total_blocks=1000)
    router.add_worker(2, block_size=BS, total_blocks=1000)
    router.update_load(1, 0, kv_usage=0.95)  # rank 0 busy, rank 1 not: worker 1 is not busy
    router.update_load(2, 0, kv_usage=0.95)  # worker 2 busy
    cache(router, 1, tokens(64), rank=0)  # the busy rank holds the prompt
    d = router.schedule(request(tokens(64)))
    assert (d.decode.worker_id, d.decode.dp_rank) == (1, 0)
    router.update_load(1, 1, kv_usage=0.9)  # at the threshold is not over it
    assert router.schedule(request(tokens(64))).decode.worker_id == 1
    router.update_load(1, 1, kv_usage=0.91)
    with pytest.raises(Overloaded, match="busy"):
        router.schedule(request(tokens(64)))


def test_busy_by_prefill_tokens_pending():
    router = make_router(workers=(1, 2), busy_prefill_tokens_threshold=100)
    router.active.book((1, 0), prompt_blocks=26, prefill_blocks=26)  # 104 tokens to prefill
    assert router.schedule(request(tokens(16))).decode.worker_id == 2
    router.active.book((2, 0), prompt_blocks=25, prefill_blocks=25)  # 100: not over
    assert router.schedule(request(tokens(16), rid="b")).decode.worker_id == 2
    router.active.book((2, 0), prompt_blocks=1, prefill_blocks=1)
    with pytest.raises(Overloaded) as err:
        router.schedule(request(tokens(16), rid="c"))
    assert err.value.status == 503 and "100 prefill tokens pending" in err.value.reason


def test_requests_go_only_to_workers_whose_context_holds_them():
    """A worker's context length (max model length) must hold the prompt and the answer's
    max_tokens (1 when not given); none does: 400 naming the need and the longest context."""
    router = make_router(workers=(1,))  # says no context length: always passes
    router.add_worker(2, block_size=BS, total_blocks=1000, context_length=64)
    router.add_worker(3, block_size=BS, total_blocks=1000, context_length=32)
    router.remove_worker(1)
    picks = {router.schedule(request(tokens(40), rid=f"a{i}")).decode.worker_id for i in range(20)}
    assert picks == {2}  # 40 + 1 tokens fit only worker 2
    picks = {router.schedule(request(tokens(16), rid=f"b{i}")).decode.worker_id for i in range(40)}
    assert picks == {2, 3}  # a short one fits both
    assert router.schedule(request(tokens(40), max_tokens=24)).decode.worker_id == 2  # 64: fits
    with pytest.raises(ContextTooLong) as err:
        router.schedule(request(tokens(40), max_tokens=25))  # 65 tokens
    assert err.value.status == 400
    assert err.value.reason.startswith(  # vLLM's words, which clients look for
        "This model's maximum context length is 64 tokens. However, you requested 65 tokens "
        "(40 in the messages, 25 in the completion)."
    )
    with pytest.raises(ContextTooLong):
        router.schedule(request(tokens(64)))  # the prompt alone fills it: no token to answer
    # an estimated count (a prompt cut for tokenizing) is left to the engine
    assert router.schedule(request(tokens(64), isl_exact=False)).decode.worker_id in (2, 3)
    # a pinned worker skips the filters, as for every other filter
    pinned = request(tokens(40), pins=RoutePins(worker_id=3))
    assert router.schedule(pinned).decode.worker_id == 3


def test_the_prefill_leg_needs_context_for_its_prompt_and_one_token():
    router = make_router(workers=())
    router.add_worker(1, role=Role.PREFILL, block_size=BS, total_blocks=1000, context_length=48)
    router.add_worker(2, role=Role.DECODE, block_size=BS, total_blocks=1000, context_length=128)
    d = router.schedule(request(tokens(40), max_tokens=80))  # 41 fit the prefill, 120 the decode
    assert (d.prefill.worker_id, d.decode.worker_id) == (1, 2)
    with pytest.raises(
        ContextTooLong,
        match=r"length is 48 tokens. However, you requested 49 tokens .*no ready prefill worker",
    ):
        router.schedule(request(tokens(48), max_tokens=8))


def test_filters_name_the_reason():
    router = make_router(workers=(1, 2))
    router.add_worker(3, block_size=BS, total_blocks=1000, lora_names=["sql"])
    d = router.schedule(request(tokens(16), lora="sql"))
    assert d.decode.worker_id == 3
    with pytest.raises(NoEligibleWorker, match="LoRA adapter 'chat'"):
        router.schedule(request(tokens(16), lora="chat"))
    assert router.schedule(request(tokens(16), allowed_ids=frozenset({2}))).decode.worker_id == 2
    with pytest.raises(NoEligibleWorker, match="subset"):
        router.schedule(request(tokens(16), allowed_ids=frozenset({99})))
    for w in (1, 2, 3):
        router.set_ready(w, False)
    with pytest.raises(NoEligibleWorker, match="no aggregated worker is ready"):
        router.schedule(request(tokens(16)))
    with pytest.raises(NoEligibleWorker, match="no worker is registered"):
        Router().schedule(request(tokens(16)))


def test_lora_blocks_match_only_requests_for_that_adapter():
    router = make_router(workers=(1, 2))
    router.add_worker(2, block_size=BS, total_blocks=1000, lora_names={3: "sql"})
    prompt = tokens(32)
    cache(router, 2, prompt, lora_id=3)
    assert router.schedule(request(prompt, lora="sql", query_only=True)).decode.overlap_blocks == 8
    assert router.index.find_matches(block_hashes(prompt, BS)) == {}


def test_an_engine_naming_the_adapter_needs_no_id_mapping():
    """vLLM's events name the adapter (`lora_name`): its blocks match that adapter's requests
    whatever id vLLM gave it, and the name wins over a stale mapping of the id."""
    router = make_router(workers=(1, 2))
    router.add_worker(2, block_size=BS, total_blocks=1000, lora_names={3: "old", 4: "sql"})
    prompt = tokens(32)
    cache(router, 2, prompt, lora_id=9, lora_name="sql")  # an id the mapping does not know
    assert router.schedule(request(prompt, lora="sql", query_only=True)).decode.overlap_blocks == 8
    other = tokens(48, start=1000)
    cache(router, 2, other, lora_id=3, lora_name="sql")  # the mapping says "old": stale
    assert router.schedule(request(other, lora="sql", query_only=True)).decode.overlap_blocks == 12
    assert router.index.find_matches(block_hashes(other, BS, "old")) == {}


# -- policies --------------------------------------------------------------------------------


def test_round_robin_random_and_least_loaded_policies():
    rr = make_router(picker=PluginRef(type="round-robin"))
    assert [rr.schedule(request(tokens(8))).decode.worker_id for _ in range(6)] == [1, 2, 3] * 2
    rnd = make_router(picker=PluginRef(type="random"))
    assert {rnd.schedule(request(tokens(8))).decode.worker_id for _ in range(60)} == {1, 2, 3}
    ll = make_router(picker=PluginRef(type="least-loaded"))
    cache(ll, 1, tokens(64))  # ignored by this policy
    guards = [ll.schedule(request(tokens(64), rid=str(i))).guard for i in range(6)]
    assert Counter(g._decode.slot[0] for g in guards) == {1: 2, 2: 2, 3: 2}
    assert ll.schedule(request(tokens(64), query_only=True)).decode.worker_id in (1, 2, 3)
    guards[0].free()
    freed = guards[0]._decode.slot[0]
    assert ll.schedule(request(tokens(64), query_only=True)).decode.worker_id == freed


# -- KV event sequencing ----------------------------------------------------------------------


def stored_batch(toks, worker=1, rank=0):
    n = len(toks) // BS
    engine = [hash((worker, tuple(toks[: (i + 1) * BS]))) & (2**63 - 1) for i in range(n)]
    return EventBatch(0.0, [BlockStored(engine, None, toks[: n * BS], BS)], rank)


def test_gap_asks_for_replay_and_replay_fills_it():
    router = make_router(workers=(1,))
    a, b, c = tokens(8), tokens(8, 100), tokens(8, 200)
    assert router.apply_kv_batch(1, 10, stored_batch(a)) is None
    gap = router.apply_kv_batch(1, 13, stored_batch(c))
    assert (gap.worker_id, gap.dp_rank, gap.start_seq, gap.got_seq) == (1, 0, 11, 13)
    assert router.index.find_matches(block_hashes(c, BS)) == {}  # held back
    for seq, toks in ((11, b), (12, tokens(4, 300)), (13, c)):
        assert router.apply_kv_batch(1, seq, stored_batch(toks)) is None
    assert router.apply_kv_batch(1, 12, stored_batch(tokens(8, 999))) is None  # duplicate
    assert router.index.find_matches(block_hashes(tokens(8, 999), BS)) == {}
    for toks in (a, b, c):
        assert router.index.find_matches(block_hashes(toks, BS)) == {(1, 0): 2}


def test_replay_failure_clears_the_worker_and_restarts_tracking():
    router = Router(RouterConfig(), clock=Clock())
    router.add_worker(1, dp_size=2, block_size=BS, total_blocks=100)
    router.apply_kv_batch(1, 0, stored_batch(tokens(8), rank=0))
    router.apply_kv_batch(1, 0, stored_batch(tokens(8), rank=1))
    assert router.apply_kv_batch(1, 5, stored_batch(tokens(8, 50), rank=1)) is not None
    router.replay_failed(1, dp_rank=1)
    assert router.index.find_matches(block_hashes(tokens(8), BS)) == {(1, 0): 2}
    assert router.apply_kv_batch(1, 6, stored_batch(tokens(8, 50), rank=1)) is None
    assert router.index.find_matches(block_hashes(tokens(8, 50), BS)) == {(1, 1): 2}


def test_publisher_restart_clears_and_unknown_workers_are_ignored():
    router = make_router(workers=(1,))
    router.apply_kv_batch(1, 0, stored_batch(tokens(8)))
    router.apply_kv_batch(1, 1, stored_batch(tokens(8, 50)))
    router.apply_kv_batch(1, 0, EventBatch(0.0, []))  # seq back to 0: a new engine process
    assert router.index.total_blocks() == 0
    assert router.apply_kv_batch(42, 0, stored_batch(tokens(8), worker=42)) is None
    assert router.index.slots() == [(1, 0)]
    router.apply_kv_batch(1, 1, stored_batch(tokens(8)))
    router.apply_kv_batch(1, 2, EventBatch(0.0, [AllBlocksCleared()]))
    assert router.index.total_blocks() == 0


# -- workers and config ----------------------------------------------------------------------


def test_worker_table_rules():
    router = make_router(workers=(1,))
    with pytest.raises(ValueError, match="block size 16 but the pool uses 4"):
        router.add_worker(2, block_size=16, total_blocks=10)
    router.add_worker(1, dp_size=2, block_size=BS, total_blocks=10)  # update keeps the worker
    router.update_load(1, 1, running=3)
    assert router.workers()[1].running == [0, 3]
    with pytest.raises(ValueError, match=r"ranks 0\.\.1"):
        router.update_load(1, 2, running=1)
    guard = router.schedule(request(tokens(8))).guard
    cache(router, 1, tokens(8))
    router.remove_worker(1)
    assert router.active.loads() == {} and router.index.total_blocks() == 0
    guard.free()  # freeing after the worker left is harmless
    assert router.block_size is None


def test_router_config_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(
        "scorers: [{type: kv-overlap, weight: 2.5}]\ntemperature: 0.3\npicker: {type: least-loaded}\n"
    )
    config = RouterConfig.load(path, temperature=0.0, enforce_disagg=None)
    assert (config.scorers, config.temperature, config.picker.type) == (
        [ScorerRef(type="kv-overlap", weight=2.5)],
        0.0,
        "least-loaded",
    )
    path.write_text("weights: {kv-overlap: 2}\n")
    with pytest.raises(ValueError, match="weights: unknown field"):
        RouterConfig.load(path)
    with pytest.raises(ValueError, match="busy_threshold"):
        RouterConfig.load(None, busy_threshold=1.5)


def test_sticky_pick_reports_its_overlap_and_books_only_uncached_blocks():
    router = make_router(workers=(1, 2))
    s = SessionControl(session_id="k", action="bind")
    first = router.schedule(request(tokens(8), session=s))
    bound = first.decode.worker_id
    cache(router, bound, tokens(32))
    d = router.schedule(request(tokens(40), rid="next", session=s))
    assert d.decode.sticky and d.decode.overlap_blocks == 8
    # the new request's 2 uncached blocks; the first's were settled when the worker stored them
    assert router.active.load((bound, 0)).prefill_blocks == 2
    first.guard.free()
    d.guard.free()


def test_block_hashes_may_be_a_numpy_array():
    router = make_router(use_kv_events=False)
    hashes = np.array(block_hashes(tokens(64), BS), dtype=np.uint64)
    first = router.schedule(RouteRequest("a", hashes, 64))
    first.guard.free()
    again = router.schedule(RouteRequest("b", hashes, 64, query_only=True))
    assert again.decode.worker_id == first.decode.worker_id and again.decode.overlap_blocks == 16
