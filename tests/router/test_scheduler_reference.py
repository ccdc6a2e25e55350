"""Differential property test: the column-wise scheduler against a per-slot reference.

Random fleets (roles, DP ranks, adapters, readiness, scraped usage), random KV-index contents
(real BlockStored events), random live bookings, then random requests: every decision of
`Router.schedule` must be what a straightforward computation of the cost rule
(docs/router.md "How a request is placed"), slot by slot in plain Python, gives — the same slot,
overlap and cost, the same 503/429 reason, and the same random tie-break or softmax draw from
the same random state.
"""

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.protocol.engine import Role
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.router_config import PluginRef, RouterConfig, dynamo_scorers
from dynamograph.router.index import chain_keys
from dynamograph.router.scheduler import NoEligibleWorker, Overloaded, Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 4
FAMILY_BLOCKS = 12


def family_tokens(family: int, blocks: int) -> list[int]:
    return [family * 1000 + i for i in range(blocks * BS)]


# -- the reference: one slot at a time, in plain Python -------------------------------------


def reference(router: Router, request: RouteRequest, rng: random.Random):
    """(phase → (slot, overlap, cost)) or the exception (type, reason) the rule gives."""
    config = router.config
    workers = router.workers()
    hashes = [int(h) for h in request.block_hashes]
    keys = chain_keys(0, request.block_hashes).tolist() if hashes else []
    overlaps = router.index.find_matches(hashes) if hashes else {}
    prompt_blocks = max(-(-request.isl_tokens // router.block_size), len(keys))
    output = 0
    if request.expected_output_tokens:  # osl is booked whether or not output is tracked
        output = -(-request.expected_output_tokens // router.block_size)
    slots = [(w, r) for w, state in workers.items() for r in range(state.dp_size)]

    def rank_busy(slot) -> bool:
        state = workers[slot[0]]
        usage = max(
            state.kv_usage[slot[1]], router.active.load(slot).decode_blocks / state.total_blocks
        )
        return config.busy_threshold is not None and usage > config.busy_threshold

    def select(phase: str):
        def eligible(slot):
            state = workers[slot[0]]
            return [
                ("role", (state.role == Role.PREFILL) == (phase == "prefill")),
                ("ready", state.ready),
                ("lora", not request.lora_name or request.lora_name in state.lora_names),
                (
                    "subset",
                    request.allowed_ids is None
                    or phase == "prefill"
                    or slot[0] in request.allowed_ids,
                ),
                # Dynamo: a worker is busy when every one of its ranks is
                ("busy", not all(rank_busy((slot[0], r)) for r in range(state.dp_size))),
            ]

        candidates = list(slots)
        for i, name in enumerate(("role", "ready", "lora", "subset", "busy")):
            candidates = [s for s in candidates if eligible(s)[i][1]]
            if not candidates:
                return (Overloaded if name == "busy" else NoEligibleWorker), name
        rows = []
        for slot in candidates:
            load = router.active.load(slot)
            held = load.held_prefix(keys)
            overlap = overlaps.get(slot, 0)
            if config.booked_prefix_hits:  # what live requests hold there counts as cached
                overlap = max(overlap, held)
            prefill = 0 if phase == "decode" else max(prompt_blocks - overlap, 0)
            if phase != "decode":
                prefill += load.prefill_blocks
            decode = (
                load.decode_blocks + prompt_blocks - held + (output if phase != "prefill" else 0)
            )
            weight = 0.0 if phase == "decode" else config.scorers[0].weight
            cost = weight * prefill + decode
            rows.append((slot, overlap, cost, load.decode_blocks, load.requests))
        if config.picker.type == "least-loaded":
            best = min((r[4], r[3]) for r in rows)
            tied = [r for r in rows if (r[4], r[3]) == best]
            chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
            return chosen[0], chosen[1], chosen[2]
        if config.temperature <= 0 or len(rows) == 1:
            best = min((r[2], r[3], r[4]) for r in rows)
            tied = [r for r in rows if (r[2], r[3], r[4]) == best]
            chosen = tied[0] if len(tied) == 1 else rng.choice(tied)
        else:
            costs = [r[2] for r in rows]
            lo, hi = min(costs), max(costs)
            if hi == lo:
                chosen = rows[rng.randrange(len(rows))]
            else:
                weights = [math.exp(-((c - lo) / (hi - lo)) / config.temperature) for c in costs]
                chosen = rows[rng.choices(range(len(rows)), weights=weights)[0]]
        return chosen[0], chosen[1], chosen[2]

    prefill_states = [w for w in workers.values() if w.role == Role.PREFILL]
    out = {}
    if prefill_states and any(w.ready for w in prefill_states):
        out["prefill"] = select("prefill")
        if isinstance(out["prefill"][0], type):
            return out
        out["decode"] = select("decode")
    else:
        out["aggregated"] = select("aggregated")
    return out


# -- random worlds ----------------------------------------------------------------------------

worker_st = st.fixed_dictionaries(
    {
        "role": st.sampled_from([Role.AGGREGATED] * 4 + [Role.PREFILL, Role.DECODE]),
        "dp": st.integers(1, 3),
        "total": st.integers(20, 400),
        "lora": st.sets(st.sampled_from(["a", "b"]), max_size=2),
        "ready": st.sampled_from([True, True, True, False]),
        "usage": st.lists(st.sampled_from([0.0, 0.1, 0.5, 0.85, 0.95]), min_size=3, max_size=3),
    }
)
request_st = st.fixed_dictionaries(
    {
        "family": st.integers(0, 4),
        "prefix": st.integers(0, FAMILY_BLOCKS),
        "tail": st.integers(0, 6),
        "partial": st.integers(0, BS - 1),
        "lora": st.sampled_from([None, None, None, "a", "b"]),
        "subset": st.none() | st.sets(st.integers(0, 11), max_size=6),
        "osl": st.none() | st.integers(1, 40),
    }
)


def _add_worker(router: Router, wid: int, w: dict) -> None:
    router.add_worker(
        wid,
        role=w["role"],
        dp_size=w["dp"],
        block_size=BS,
        total_blocks=w["total"],
        lora_names=sorted(w["lora"]),
    )


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    workers=st.lists(worker_st, min_size=1, max_size=12),
    stores=st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 2), st.integers(0, 4), st.integers(1, 12)),
        max_size=25,
    ),
    booked=st.lists(st.tuples(request_st, st.sampled_from(["keep", "free", "prefill_done"]))),
    requests=st.lists(
        st.tuples(
            request_st,
            # between requests the fleet changes: a worker leaves (and comes back with
            # other ranks), turns (not) ready, or reports KV usage
            st.none()
            | st.tuples(st.sampled_from(["remove", "readd", "ready", "usage"]), st.integers(0, 11)),
        ),
        min_size=1,
        max_size=6,
    ),
    policy=st.sampled_from(["kv"] * 4 + ["least-loaded"]),
    temperature=st.sampled_from([0.0, 0.0, 0.5]),
    overlap_weight=st.sampled_from([0.0, 1.0, 1.0, 4.0, 0.5]),
    busy=st.none() | st.sampled_from([0.3, 0.9]),
    track_output=st.booleans(),
    booked_hits=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_decisions_equal_the_per_slot_reference(
    workers,
    stores,
    booked,
    requests,
    policy,
    temperature,
    overlap_weight,
    busy,
    track_output,
    booked_hits,
    seed,
):
    config = RouterConfig(
        picker=PluginRef(type=policy),
        temperature=temperature,
        scorers=dynamo_scorers(overlap_weight),
        busy_threshold=busy,
        track_output_blocks=track_output,
        booked_prefix_hits=booked_hits,
        seed=seed,
    )
    router = Router(config, clock=lambda: 1000.0)
    ids = []
    for i, w in enumerate(workers):
        wid = 1000 + i * 7
        ids.append(wid)
        _add_worker(router, wid, w)
        router.set_ready(wid, w["ready"])
        for rank in range(w["dp"]):
            router.update_load(wid, rank, kv_usage=w["usage"][rank])
    # KV-index contents: a family's first blocks stored on a slot (through real events)
    seqs: dict = {}
    for which, rank, family, blocks in stores:
        wid = ids[which % len(ids)]
        rank %= workers[which % len(ids)]["dp"]
        toks = family_tokens(family, blocks)
        engine = [(wid << 8) + family * 64 + b + 1 for b in range(blocks)]
        seq = seqs.get((wid, rank), 0)
        seqs[(wid, rank)] = seq + 1
        batch = EventBatch(0.0, [BlockStored(engine, None, toks, BS, None)], rank)
        assert router.apply_kv_batch(wid, seq, batch) is None

    def route_request(n: int, r: dict, query_only: bool) -> RouteRequest:
        toks = family_tokens(r["family"], r["prefix"])
        toks += [50_000 + n * 100 + i for i in range(r["tail"] * BS + r["partial"])]
        subset = None if r["subset"] is None else frozenset(ids[i % len(ids)] for i in r["subset"])
        return RouteRequest(
            f"r{n}",
            block_hash_array(toks, BS, r["lora"]),
            len(toks),
            lora_name=r["lora"],
            allowed_ids=subset,
            expected_output_tokens=r["osl"],
            query_only=query_only,
        )

    guards = []
    for n, (r, then) in enumerate(booked):  # live load: booked requests, some freed or prefilled
        try:
            decision = router.schedule(route_request(n, r, False))
        except (NoEligibleWorker, Overloaded):
            continue
        guards.append(decision.guard)
        if then == "free":
            decision.guard.free()
        elif then == "prefill_done":
            decision.guard.mark_prefill_done()
            decision.guard.add_output_tokens(r["osl"] or 3)

    for n, (r, change) in enumerate(requests, start=len(booked)):
        if change is not None:
            kind, which = change
            wid, w = ids[which % len(ids)], workers[which % len(ids)]
            if kind == "remove" and len(router.workers()) > 1:
                router.remove_worker(wid)
            elif kind == "readd":
                w["dp"] = w["dp"] % 3 + 1
                _add_worker(router, wid, w)
            elif kind == "ready" and wid in router.workers():
                router.set_ready(wid, not router.workers()[wid].ready)
            elif kind == "usage" and wid in router.workers():
                router.update_load(wid, 0, kv_usage=0.95 - router.workers()[wid].kv_usage[0])
        request = route_request(n, r, True)
        rng = random.Random()
        rng.setstate(router._rng.getstate())
        expected = reference(router, request, rng)
        failed = next((v for v in expected.values() if isinstance(v[0], type)), None)
        if failed is not None:
            with pytest.raises(failed[0]) as info:
                router.schedule(request)
            assert info.value.reason.startswith(_REASONS[failed[1]])
            continue
        decision = router.schedule(request)
        decode_phase = "aggregated" if "aggregated" in expected else "decode"
        got = {decode_phase: decision.decode}
        if decision.prefill is not None:
            got["prefill"] = decision.prefill
        assert set(got) == set(expected)
        for phase, pick in got.items():
            slot, overlap, cost = expected[phase]
            assert ((pick.worker_id, pick.dp_rank), pick.overlap_blocks, pick.cost) == (
                slot,
                overlap,
                cost,
            ), phase
        assert router._rng.getstate() == rng.getstate()  # the same random draws were made
    for guard in guards:
        guard.free()
    assert router.active.loads() == {}


_REASONS = {
    "role": "no ",
    "ready": "no ",
    "lora": "no ready ",
    "subset": "no eligible worker is in the requested endpoint subset",
    "busy": "every eligible ",
}


def test_a_tie_goes_to_the_least_booked_load_before_the_fewest_requests():
    """Equal cost from different terms (a slot whose live requests hold part of the prompt
    has more booked load yet the same cost): the less booked load wins, even with more
    requests — as in the reference and Dynamo's order of tie-breaks."""
    router = Router(RouterConfig(scorers=dynamo_scorers(0.0), seed=1), clock=lambda: 1000.0)
    for wid in (1, 2):
        router.add_worker(wid, block_size=BS, total_blocks=1000)
    shared = family_tokens(0, 4)
    a = router.active
    a.book(
        (1, 0),
        prompt_blocks=10,
        prompt_keys=chain_keys(0, block_hash_array(shared, BS)),
        prefill_blocks=0,
    )
    a.book((2, 0), prompt_blocks=3, prefill_blocks=0)
    a.book((2, 0), prompt_blocks=3, prefill_blocks=0)
    # worker 1: booked 10, holds 4 of the prompt's 6 blocks → 10 + 6 - 4 = 12
    # worker 2: booked 6 over two requests, holds nothing → 6 + 6 = 12
    request = RouteRequest(
        "t", block_hash_array(shared + family_tokens(9, 2), BS), 6 * BS, query_only=True
    )
    rng = random.Random()
    rng.setstate(router._rng.getstate())
    expected = reference(router, request, rng)["aggregated"]
    decision = router.schedule(request)
    assert expected == ((2, 0), 0, 12.0)
    assert (
        (decision.decode.worker_id, decision.decode.dp_rank),
        0,
        decision.decode.cost,
    ) == expected


def test_debug_log_names_the_choice_and_the_cheapest_others(caplog):
    router = Router(RouterConfig(seed=3), clock=lambda: 1000.0)
    for wid in (1, 2, 3):
        router.add_worker(wid, block_size=BS, total_blocks=1000)
    toks = family_tokens(1, 6)
    engine = [10 + b for b in range(6)]
    batch = EventBatch(0.0, [BlockStored(engine, None, toks, BS, None)], 0)
    assert router.apply_kv_batch(2, 0, batch) is None
    request = RouteRequest("d", block_hash_array(toks, BS), len(toks), query_only=True)
    router.schedule(request)
    assert not caplog.records  # nothing built or logged above debug level
    with caplog.at_level("DEBUG", logger="dynamograph.router.scheduler"):
        decision = router.schedule(request)
    assert decision.decode.worker_id == 2
    (record,) = [r for r in caplog.records if "pick" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith(
        "aggregated pick (2, 0) of 6 blocks: overlap=6 kv-overlap=0 load=6 kv-overflow=0 "
        "queue-delay=0 prefill-work=0"
    )
    assert (
        "cost=0.015 requests=0; next: (1, 0) overlap=0 kv-overlap=6 load=6 kv-overflow=0 "
        "queue-delay=0 prefill-work=6 cost=54.015" in message
    )
    assert "(3, 0) overlap=0" in message
