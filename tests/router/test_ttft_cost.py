"""The TTFT cost (`ttft_scorers`): a worker is priced by what it would cost this request's
time to first token, in blocks to prefill. A follow-up stays with its history however many
other conversations decode there; queued prefill work, and KV blocks that would not fit, still
send it elsewhere — to an idle worker once they outweigh the history's recompute as the fleet's
work (prefill-work), but not into another queue when the re-prefill would delay the requests
waiting there more than it saves (queue-delay)."""

import pytest

from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.router_config import (
    HOME_MARGIN,
    PREFILL_WORK_WEIGHT,
    RouterConfig,
    ScorerRef,
    dynamo_scorers,
    ttft_scorers,
)
from dynamograph.router.scheduler import Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 16
TOTAL = 1000
PROMPT = list(range(40 * BS))  # a follow-up turn of 40 blocks
HISTORY = 36  # of which the conversation so far, cached on worker 1


# The cost's own decisions: the lowest cost wins (the default config's home margin, tested at
# the end, keeps some of these follow-ups home)
LOWEST_COST = {"type": "kv"}


def router_with(scorers: list[ScorerRef], picker: dict | None = LOWEST_COST) -> Router:
    config = RouterConfig(scorers=scorers, seed=1, **({"picker": picker} if picker else {}))
    router = Router(config)
    for wid in (1, 2):
        router.add_worker(wid, block_size=BS, total_blocks=TOTAL)
    tokens = PROMPT[: HISTORY * BS]
    engine = [1000 + i for i in range(HISTORY)]
    batch = EventBatch(0.0, [BlockStored(engine, None, tokens, BS, None)])
    assert router.apply_kv_batch(1, 0, batch) is None
    return router


def route(router: Router) -> int:
    request = RouteRequest("r", block_hash_array(PROMPT, BS), len(PROMPT), query_only=True)
    return router.schedule(request).decode.worker_id


def test_a_follow_up_stays_with_its_history_beside_other_conversations_decoding():
    # worker 1 holds the history and 300 blocks of other conversations' decodes; 2 is idle
    for scorers, expected in ((ttft_scorers(), 1), (dynamo_scorers(), 2)):
        router = router_with(scorers)
        for _ in range(3):
            router.active.book((1, 0), prompt_blocks=100, prefill_blocks=0)
        # TTFT: 4 uncached blocks + 300 · 0.0025 against 40 to prefill on worker 2; Dynamo's
        # cost weighs each active block as one to prefill: 4 + 340 against 40 + 40
        assert route(router) == expected


@pytest.mark.parametrize(
    "weight, queued, expected",
    [(0.0, 30, 1), (0.0, 40, 2), (1.0, 60, 1), (1.0, 80, 2), (8.0, 300, 1), (8.0, 340, 2)],
)
def test_queued_prefill_sends_it_to_an_idle_worker_once_the_wait_outweighs_its_recompute(
    weight, queued, expected
):
    """With `prefill-work` at weight λ (the default 8), worker 1 costs queued + 4 + 4λ (+ 4 · 1
    request waiting: queue-delay) and the idle worker 2 costs 40 + 40λ: the follow-up moves
    only when the prefill queued on its worker is over 36 (1 + λ) − 4 blocks."""
    router = router_with(ttft_scorers(work_weight=weight))
    assert route(router) == 1
    router.active.book((1, 0), prompt_blocks=queued, prefill_blocks=queued)
    assert route(router) == expected


def test_under_load_a_follow_up_keeps_its_history_rather_than_joining_another_queue():
    # queue-delay's part alone: without it and prefill-work (each request's own TTFT) it moves
    greedy = [s for s in ttft_scorers(work_weight=0) if s.type != "queue-delay"]
    for scorers, expected in ((greedy, 2), (ttft_scorers(work_weight=0), 1), (ttft_scorers(), 1)):
        router = router_with(scorers)
        # worker 1: one request with 50 blocks to prefill; worker 2: two short ones (5 blocks)
        router.active.book((1, 0), prompt_blocks=50, prefill_blocks=50)
        for blocks in (2, 3):
            router.active.book((2, 0), prompt_blocks=blocks, prefill_blocks=blocks)
        # own TTFT: 50 + 4 on worker 1 against 5 + 40 on worker 2, so the greedy cost moves it;
        # the 40 blocks it would prefill there delay the 2 requests that wait there (and the 4
        # new ones here the 1): 54 + 4 · 1 against 45 + 40 · 2
        assert route(router) == expected


def test_a_worker_whose_kv_blocks_are_nearly_all_in_use_is_avoided():
    router = router_with(ttft_scorers())
    # worker 1's KV is 98 % in use (scraped): the 40 blocks would not fit
    router.update_load(1, 0, kv_usage=0.98)
    assert route(router) == 2
    # while they fit, the history wins however full the worker is
    router.update_load(1, 0, kv_usage=0.95)
    assert route(router) == 1


def test_the_overflow_counts_a_whole_sequence_of_the_worker():
    router = router_with(ttft_scorers())
    for _ in range(2):  # 2 sequences of 490 blocks: 980 in use, 40 more are 20 over 1000
        router.active.book((1, 0), prompt_blocks=490, prefill_blocks=0)
    request = RouteRequest("r", block_hash_array(PROMPT, BS), len(PROMPT), query_only=True)
    assert router.schedule(request).decode.worker_id == 2
    # worker 2 full too (scraped, no requests of ours: one sequence of 1000 blocks): the
    # request goes where the engine frees the fewest blocks for it, worker 1's 490
    router.update_load(2, 0, kv_usage=1.0)
    decision = router.schedule(request).decode
    assert decision.worker_id == 1
    # its 4 uncached blocks also delay the 2 requests there still waiting for a first token,
    # and are the fleet's work
    work = 4 * PREFILL_WORK_WEIGHT
    assert decision.cost == pytest.approx(4 + 0.0025 * (980 + 40) + (20 + 490) + 4 * 2 + work)


@pytest.mark.parametrize(
    "margin, queued, expected", [(0.0, 340, 2), (0.5, 340, 1), (0.5, 800, 2), (0.9, 900, 1)]
)
def test_with_a_home_margin_a_follow_up_moves_only_to_save_that_share_of_its_cost(
    margin, queued, expected
):
    """Worker 1, its history's home, costs queued + 4 + 32 + 4 and the idle worker 2 costs
    40 + 320: the follow-up leaves home only when 360 is below (1 − margin) of home's cost."""
    router = router_with(
        ttft_scorers(), picker={"type": "kv", "parameters": {"home_margin": margin}}
    )
    router.active.book((1, 0), prompt_blocks=queued, prefill_blocks=queued)
    assert route(router) == expected


def test_a_prompt_two_workers_hold_alike_has_no_home_and_takes_the_lowest_cost():
    """A first turn over a system prompt both workers hold: the margin keeps nothing home."""
    router = router_with(ttft_scorers(), picker={"type": "kv", "parameters": {"home_margin": 0.9}})
    tokens = PROMPT[: HISTORY * BS]
    batch = EventBatch(
        0.0, [BlockStored([2000 + i for i in range(HISTORY)], None, tokens, BS, None)]
    )
    assert router.apply_kv_batch(2, 0, batch) is None
    router.active.book((1, 0), prompt_blocks=20, prefill_blocks=20)
    assert route(router) == 2


def test_the_default_config_keeps_a_follow_up_home_within_its_margin():
    """The default picker's margin (0.25): 360 against home's 380 keeps it home; 360 against
    900 + 40 does not."""
    assert RouterConfig().picker.parameters == {"home_margin": HOME_MARGIN} and HOME_MARGIN == 0.25
    for queued, expected in ((340, 1), (900, 2)):
        router = router_with(ttft_scorers(), picker=None)
        router.active.book((1, 0), prompt_blocks=queued, prefill_blocks=queued)
        assert route(router) == expected


def test_a_home_margin_of_one_or_more_is_refused_naming_the_parameter():
    with pytest.raises(ValueError, match="home_margin"):
        router_with(ttft_scorers(), picker={"type": "kv", "parameters": {"home_margin": 1.0}})
