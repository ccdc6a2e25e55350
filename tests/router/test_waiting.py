"""The router's queue (router/waiting.py): with every worker busy, requests wait by priority in
the one request pipeline instead of getting the 503 at once."""

import asyncio

import pytest

from dynamograph.protocol.engine import EngineConfig
from dynamograph.protocol.openai import OpenAIError
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.pipeline import RequestPipeline
from dynamograph.router.scheduler import Router
from e2e.waiting import wait_for

pytestmark = pytest.mark.unit

MODEL = "Qwen/Qwen3-0.6B"
LONG = "Many words fill these blocks of the worker's small cache. " * 12  # > 5 blocks of 16


def pipeline(**config) -> RequestPipeline:
    router_config = RouterConfig(**{"busy_threshold": 0.5, "queue_timeout_s": 5, **config})
    pipe = RequestPipeline(Router(router_config))
    engine = EngineConfig(model=MODEL, name="w", kv_cache_block_size=16, total_kv_blocks=10)
    assert pipe.add_engine(engine)
    return pipe


def body(prompt: str, priority: int | None = None) -> dict:
    out: dict = {"model": MODEL, "prompt": prompt}
    if priority is not None:
        out["nvext"] = {"agent_hints": {"priority": priority}}
    return out


async def decide(pipe: RequestPipeline, rid: str, b: dict):
    from dynamograph.protocol.nvext import parse_nvext

    return await pipe.decide(
        "/v1/completions", b, request_id=rid, nvext=parse_nvext(b.get("nvext"))
    )


async def test_busy_requests_wait_and_leave_by_priority_then_arrival():
    pipe = pipeline(queue_max_requests=3)
    hog = await decide(pipe, "hog", body(LONG))  # the only worker is now busy
    order: list[str] = []
    tasks = {}
    for name, priority in (("low", None), ("high", 5), ("low2", None)):
        tasks[name] = asyncio.create_task(decide(pipe, name, body(f"{name} hi", priority)))
        tasks[name].add_done_callback(lambda t, name=name: order.append(name))
        queued = len(tasks)
        await wait_for(lambda queued=queued: pipe.queue.depth == queued, what=f"{name} queued")
    with pytest.raises(OpenAIError) as full:  # bounded
        await decide(pipe, "extra", body("one too many"))
    assert full.value.status == 503 and "queue is full" in full.value.message
    assert not order
    hog.decision.guard.free()  # room: the queue empties, the most important first
    routed = await asyncio.gather(*tasks.values())
    assert order == ["high", "low", "low2"]
    assert pipe.queue.outcomes == {"dispatched": 3, "timed_out": 0, "rejected": 1}
    for r in routed:
        r.decision.guard.free()
    pipe.close()


async def test_a_request_waiting_too_long_gets_the_busy_503_and_a_gone_one_is_skipped():
    pipe = pipeline(queue_max_requests=2, queue_timeout_s=0.3)
    hog = await decide(pipe, "hog", body(LONG))
    gone = asyncio.create_task(decide(pipe, "gone", body("gone", 9)))
    await wait_for(lambda: pipe.queue.depth == 1, what="queued")
    gone.cancel()
    with pytest.raises(OpenAIError) as waited:  # the timeout is the behaviour under test
        await decide(pipe, "late", body("late"))
    assert waited.value.status == 503 and "waited 0.3 s" in waited.value.message
    assert waited.value.retry_after_s == 1.0
    hog.decision.guard.free()
    assert pipe.router.active.total_requests() == 0  # the cancelled one booked nothing
    pipe.close()


async def test_without_a_queue_busy_is_the_503_at_once():
    pipe = pipeline()
    hog = await decide(pipe, "hog", body(LONG))
    with pytest.raises(OpenAIError) as busy:
        await decide(pipe, "next", body("next"))
    assert busy.value.status == 503 and pipe.queue is None
    hog.decision.guard.free()


def jumped(prompt: str, **nvext) -> dict:
    return {"model": MODEL, "prompt": prompt, "nvext": nvext}


async def test_the_order_is_the_tier_then_the_arrival_moved_earlier_by_the_priority_jump():
    """Dynamo's newest queue order: `agent_hints.strict_priority` tiers first; within a tier the
    arrival time moved earlier by the jump (`nvext.priority_jump` seconds, else
    `agent_hints.priority` seconds)."""
    pipe = pipeline(queue_max_requests=5)
    hog = await decide(pipe, "hog", body(LONG))
    order: list[str] = []
    arrivals = (
        ("first", jumped("first hi")),
        ("jump 60 s", jumped("jump hi", priority_jump=60.0)),
        ("priority 30", jumped("prio hi", agent_hints={"priority": 30})),
        ("negative priority", jumped("neg hi", agent_hints={"priority": -5})),
        ("tier 1", jumped("tier hi", agent_hints={"strict_priority": 1})),
    )
    tasks = []
    for name, b in arrivals:
        task = asyncio.create_task(decide(pipe, name, b))
        task.add_done_callback(lambda t, name=name: order.append(name))
        tasks.append(task)
        queued = len(tasks)
        await wait_for(lambda queued=queued: pipe.queue.depth == queued, what=f"{name} queued")
    assert pipe.queue.depth_by_tier() == {0: 4, 1: 1}
    hog.decision.guard.free()
    routed = await asyncio.gather(*tasks)
    # a negative priority is clamped to no jump: it keeps its place in arrival order
    assert order == ["tier 1", "jump 60 s", "priority 30", "first", "negative priority"]
    assert sum(pipe.queue.wait_counts) == 5
    for r in routed:
        r.decision.guard.free()
    pipe.close()


async def decide_for(pipe: RequestPipeline, rid: str, b: dict, objective_priority: int):
    from dynamograph.protocol.nvext import parse_nvext

    return await pipe.decide(
        "/v1/completions",
        b,
        request_id=rid,
        nvext=parse_nvext(b.get("nvext")),
        objective_priority=objective_priority,
    )


async def test_the_objective_priority_comes_first_and_a_sheddable_request_is_refused_429():
    """GAIE's InferenceObjective priority: a higher one is served first, before any tier or
    jump; a negative one is sheddable — refused with 429 at once while workers are busy, never
    queued, while the others wait."""
    pipe = pipeline(queue_max_requests=5)
    hog = await decide(pipe, "hog", body(LONG))
    order: list[str] = []
    arrivals = (
        ("tier 3", jumped("tier hi", agent_hints={"strict_priority": 3}), 0),
        ("objective 1", jumped("obj1 hi"), 1),
        ("objective 5", jumped("obj5 hi"), 5),
        ("objective 1, jump", jumped("obj1j hi", priority_jump=60.0), 1),
    )
    tasks = []
    for name, b, priority in arrivals:
        task = asyncio.create_task(decide_for(pipe, name, b, priority))
        task.add_done_callback(lambda t, name=name: order.append(name))
        tasks.append(task)
        queued = len(tasks)
        await wait_for(lambda queued=queued: pipe.queue.depth == queued, what=f"{name} queued")
    assert pipe.queue.depth_by_objective_priority() == {0: 1, 1: 2, 5: 1}
    with pytest.raises(OpenAIError) as refused:
        await decide_for(pipe, "sheddable", jumped("shed hi"), -1)
    assert refused.value.status == 429 and "sheddable" in refused.value.message
    assert refused.value.retry_after_s == 1.0
    assert pipe.queue.depth == 4 and pipe.queue.refusals["shed"] == 1
    hog.decision.guard.free()
    routed = await asyncio.gather(*tasks)
    assert order == ["objective 5", "objective 1, jump", "objective 1", "tier 3"]
    for r in routed:
        r.decision.guard.free()
    # with room, a sheddable request is routed like any other
    free = await decide_for(pipe, "sheddable, room", jumped("room hi"), -1)
    free.decision.guard.free()
    pipe.close()


async def test_without_a_queue_a_sheddable_request_gets_429_and_the_others_503():
    pipe = pipeline()
    hog = await decide(pipe, "hog", body(LONG))
    for priority, status in ((-3, 429), (0, 503), (2, 503)):
        with pytest.raises(OpenAIError) as busy:
            await decide_for(pipe, f"p{priority}", body(f"next {priority}"), priority)
        assert busy.value.status == status
    hog.decision.guard.free()
