"""Requests written for Dynamo behave as in Dynamo, through the frontend's HTTP surface (issue
20; docs/nvext.md): unknown nvext keys, sessions against the hard constraints, stickiness per
phase, session actions. The kv mode runs the same request pipeline as the EPP."""

import asyncio
import contextlib
import functools
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.protocol.engine import Role
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.identity import instance_id
from dynamograph.protocol.tokenization import get_tokenizer
from dynamograph.router.scheduler import RouteRequest
from dynamograph.worker.lora import LoraModule
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import engine_gauges, frontend_metric, route, run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "Every turn of this conversation starts with the same long briefing. " * 8


async def post(fe, body: dict[str, Any], headers: dict[str, str] | None = None):
    """POST /v1/completions; (status, JSON body, response headers)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(fe.url + "/v1/completions", json=body, headers=headers or {}) as r,
    ):
        return r.status, await r.json(), r.headers


def cached_on(fe, worker) -> int:
    router = fe.routing.router
    tokens = get_tokenizer("qwen").encode(PROMPT, add_special_tokens=True)
    probe = RouteRequest("probe", block_hashes(tokens, router.block_size), len(tokens))
    probe.query_only = True
    probe.pins = type(probe.pins)(worker_id=worker.config.instance_id)
    return router.schedule(probe).decode.overlap_blocks


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.KV])
async def test_unknown_nvext_and_agent_hint_keys_are_ignored(model, mode):
    async with (
        mock_worker() as w,
        run_frontend(w if mode is Mode.DIRECT else None, [w], mode=mode) as fe,
    ):
        headers = route(w) if mode is Mode.DIRECT else None
        nvext = {
            "a_field_from_a_newer_dynamo": {"x": 1},
            "agent_hints": {"osl": 4, "context_tokens_hint": 99},
            "session_control": {"session_id": "s1", "ttl_policy": "later"},
        }
        body = {"model": model, "prompt": "hello", "max_tokens": 2, "nvext": nvext}
        status, out, _ = await post(fe, body, headers)
        assert status == 200, out
        # the fields we know keep their types checked
        body["nvext"] = {"agent_hints": {"osl": "many"}}
        status, out, _ = await post(fe, body, headers)
        assert status == 400 and "nvext.agent_hints.osl" in out["error"]["message"]


async def test_a_session_bound_worker_without_the_adapter_does_not_get_a_lora_request(model):
    async with (
        mock_worker(lora_modules=[LoraModule("sql", "/a/sql")]) as with_adapter,
        mock_worker() as without,
        run_frontend(None, [with_adapter, without], mode=Mode.KV) as fe,
    ):
        # the session opens where its prompt is cached: the worker without the adapter
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        assert (await post(fe, body, route(without)))[0] == 200
        await wait_for(lambda: cached_on(fe, without) > 0, what="the prompt's KV events")
        opened = {**body, "nvext": {"session_control": {"session_id": "chat", "action": "open"}}}
        assert (await post(fe, opened))[0] == 200
        assert (await served(without))["total"] == 2
        # the next turn asks for the adapter: the bound worker cannot serve it
        turn = {**body, "model": "sql", "nvext": {"session_control": {"session_id": "chat"}}}
        status, out, _ = await post(fe, turn)
        assert status == 200, out
        assert out["model"] == "sql" and (await served(with_adapter))["total"] == 1
        # and the session is still bound where it was
        status, _, headers = await post(fe, {**turn, "model": model})
        assert headers["x-dynamograph-worker-id"] == str(without.config.instance_id)


async def test_a_dp_rank_pin_is_not_overridden_by_the_session(model):
    async with (
        mock_worker(data_parallel_size=2) as w,
        run_frontend(None, [w], mode=Mode.KV) as fe,
    ):
        session = {"session_control": {"session_id": "dp", "action": "open"}}
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "nvext": session}
        status, _, headers = await post(fe, body)
        assert status == 200
        bound = int(headers["x-dynamograph-dp-rank"])
        follow = {**body, "nvext": {"session_control": {"session_id": "dp"}}}
        other = str(1 - bound)
        # a rank pinned without its worker (the header, or nvext.dp_rank) wins over the session
        status, _, headers = await post(fe, follow, {"x-dp-rank": other})
        assert status == 200 and headers["x-dynamograph-dp-rank"] == other
        pinned = {**follow, "nvext": {**follow["nvext"], "dp_rank": int(other)}}
        status, _, headers = await post(fe, pinned)
        assert status == 200 and headers["x-dynamograph-dp-rank"] == other
        # and did not move the session
        status, _, headers = await post(fe, follow)
        assert headers["x-dynamograph-dp-rank"] == str(bound)


async def test_session_actions_as_dynamo(model):
    async with (
        # KV for 512 tokens: a turn within the context may still be refused by the engine
        mock_worker(context_length=1024, num_gpu_blocks=32) as a,
        mock_worker(context_length=1024, num_gpu_blocks=32) as b,
        run_frontend(None, [a, b], mode=Mode.KV) as fe,
    ):
        sessions = fe.routing.router.sessions

        def turn(sid: str, action: str | None = None, **fields: Any) -> dict[str, Any]:
            control: dict[str, Any] = {"session_id": sid, **fields}
            if action is not None:
                control["action"] = action
            return {
                "model": model,
                "prompt": "hi",
                "max_tokens": 1,
                "nvext": {"session_control": control},
            }

        # no action only refreshes a binding: it never creates one
        assert (await post(fe, turn("plain")))[0] == 200
        assert sessions.binding("plain") is None
        # an open the engine refuses binds nothing
        refused = {**turn("refused", "open"), "max_tokens": 900}
        status, out, _ = await post(fe, refused)
        assert status == 400 and "tokens of KV cache" in out["error"]["message"]
        assert sessions.binding("refused") is None
        # open binds once the engine took the turn; the engine holds the session too
        status, _, headers = await post(fe, turn("s", "open", timeout=600))
        where = int(headers["x-dynamograph-worker-id"])
        assert status == 200 and sessions.binding("s") == (where, 0)
        engine = a if a.config.instance_id == where else b
        assert engine.engine.ranks[0].has_session("s")
        # bind is router-only: bound at once, the engine is not told
        status, _, headers = await post(fe, turn("r", "bind"))
        assert status == 200 and sessions.binding("r") is not None
        assert not any(w.engine.ranks[0].has_session("r") for w in (a, b))
        # any u64 timeout, 0 included
        assert (await post(fe, turn("zero", "bind", timeout=0)))[0] == 200
        assert sessions.binding("zero") is None  # bound for no time
        assert (await post(fe, turn("big", "bind", timeout=(1 << 64) - 1)))[0] == 200
        assert sessions.binding("big") is not None
        # close unbinds; the engine closes its side after the turn
        status, _, headers = await post(fe, turn("s", "close"))
        assert status == 200 and int(headers["x-dynamograph-worker-id"]) == where
        assert sessions.binding("s") is None
        await wait_for(lambda: not engine.engine.ranks[0].has_session("s"), what="engine close")


@asynccontextmanager
async def minimal_engine(model: str):
    """An engine whose /v1/engine says only its model (Dynamo's EngineConfig needs no more);
    it answers completions and records the bodies it got."""
    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def engine_config(request: web.Request) -> web.Response:
        return web.json_response({"model": model})

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.json())
        choice = {"index": 0, "text": "ok", "finish_reason": "length", "logprobs": None}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {"id": "c", "object": "text_completion", "created": 0, "model": model,
             "choices": [choice], "usage": usage}
        )  # fmt: skip

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_get("/v1/engine", engine_config)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    class Minimal:  # what run_frontend and route() need of a worker
        url = f"http://127.0.0.1:{port}"
        config = type("C", (), {"instance_id": instance_id(f"127.0.0.1:{port}")})

    try:
        yield Minimal(), seen
    finally:
        await runner.cleanup()


async def test_an_engine_saying_only_its_model_is_discovered_and_routed(model):
    """Discovered (named by host:port) and served, in kv mode and through the EPP's headers in
    direct mode."""
    async with minimal_engine(model) as (minimal, seen):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        async with run_frontend(None, [minimal], mode=Mode.KV) as fe:
            status, out, _ = await post(fe, body)
            assert status == 200, out
        async with run_frontend(None, [minimal]) as fe:
            status, out, _ = await post(fe, body, route(minimal))
            assert status == 200, out
        assert len(seen) == 2


async def test_greed_sampling_forces_greedy_on_the_engine(model):
    """Dynamo leaves `greed_sampling` to the backend; for a vLLM engine that is temperature 0,
    which the frontend (the hop every request takes to its engine) sets."""
    async with minimal_engine(model) as (engine, seen), run_frontend(None, [engine]) as fe:
        body = {"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0.9}
        greedy = {**body, "nvext": {"greed_sampling": True}}
        assert (await post(fe, greedy, route(engine)))[0] == 200
        assert (await post(fe, body, route(engine)))[0] == 200
        assert [b["temperature"] for b in seen] == [0.0, 0.9]


async def test_token_data_counts_only_with_backend_instance_id(model):
    """Dynamo uses `token_data` (GAIE's pre-tokenized second stage) only together with
    `backend_instance_id`; otherwise the prompt is tokenized, by router and engine alike."""
    async with mock_worker() as w, run_frontend(None, [w], mode=Mode.KV) as fe:
        tokens = list(range(100, 164))
        body = {"model": model, "prompt": "Hello world", "max_tokens": 1}
        status, out, _ = await post(fe, {**body, "nvext": {"token_data": tokens}})
        assert status == 200 and out["usage"]["prompt_tokens"] == 2  # "Hello world"
        named = {"token_data": tokens, "backend_instance_id": w.config.instance_id}
        status, out, _ = await post(fe, {**body, "nvext": named})
        assert status == 200 and out["usage"]["prompt_tokens"] == len(tokens)


async def test_expected_output_length_is_booked_load(model):
    """agent_hints.osl: a running request's expected output counts in its worker's booked load
    (Dynamo), so under Dynamo's cost a prompt cached there still goes elsewhere when that output
    is large (the default TTFT cost weighs an active block at what it costs a prefill: there
    the prompt would stay)."""
    from dynamograph.protocol.router_config import RouterConfig, dynamo_scorers

    dynamo = RouterConfig(scorers=dynamo_scorers())
    async with (
        mock_worker(speedup=1.0) as a,
        mock_worker() as b,
        run_frontend(None, [a, b], mode=Mode.KV, router=dynamo) as fe,
    ):
        assert (await post(fe, {"model": model, "prompt": PROMPT, "max_tokens": 1}, route(a)))[
            0
        ] == 200
        await wait_for(lambda: cached_on(fe, a) > 0, what="the prompt's KV events")
        hinted = {
            "model": model,
            "prompt": "x",
            "max_tokens": 800,
            "ignore_eos": True,
            "nvext": {"agent_hints": {"osl": 8000}},
        }
        long_running = asyncio.create_task(post(fe, hinted, route(a)))
        try:
            await wait_for(lambda: fe.routing.router.active.total_requests() == 1, what="booking")
            status, _, headers = await post(fe, {"model": model, "prompt": PROMPT, "max_tokens": 1})
            assert status == 200
            assert headers["x-dynamograph-worker-id"] == str(b.config.instance_id)
        finally:
            long_running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await long_running


async def health(fe) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(fe.url + "/health") as r:
        return r.status, await r.json()


async def test_enforced_disaggregation_is_not_ready_without_a_prefill_worker(model):
    async with mock_worker(role=Role.DECODE) as decode, mock_worker(role=Role.PREFILL) as prefill:
        async with run_frontend(decode, [decode], enforce_disagg=True) as fe:
            status, body = await health(fe)
            assert status == 503 and "no prefill worker" in body["reason"]
        async with run_frontend(decode, [decode, prefill], enforce_disagg=True) as fe:
            assert (await health(fe))[0] == 200


async def test_query_instance_id_answers_the_workers_and_tokens_and_books_nothing(model):
    """Dynamo's `query_instance_id:` annotation (GAIE's first stage): the chosen workers' ids
    and the prompt's token ids in the response nvext; no engine is called, nothing booked."""
    async with (
        mock_worker(role=Role.PREFILL) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(None, [prefill, decode], mode=Mode.KV) as fe,
    ):
        query = {
            "annotations": ["query_instance_id:"],
            "session_control": {"session_id": "q", "action": "bind"},
        }
        body = {"model": model, "prompt": "Hello world", "max_tokens": 1, "nvext": query}
        status, out, _ = await post(fe, body)
        assert status == 200, out
        assert out["nvext"]["token_ids"] == [9707, 1879]
        assert out["nvext"]["worker_id"] == {
            "prefill_worker_id": prefill.config.instance_id,
            "prefill_dp_rank": 0,
            "decode_worker_id": decode.config.instance_id,
            "decode_dp_rank": 0,
        }
        assert out["choices"] == []
        assert (await served(prefill))["total"] == 0 and (await served(decode))["total"] == 0
        assert fe.routing.router.sessions.binding("q") is None  # a query binds nothing either
        # a stray annotation of another name is not a query
        body["nvext"] = {"annotations": ["query_instance_id_extra:1"]}
        status, out, _ = await post(fe, body)
        assert status == 200 and "token_ids" not in (out.get("nvext") or {})
        assert (await served(decode))["total"] == 1


async def test_busy_requests_wait_in_the_router_queue_and_show_in_metrics(model):
    """With a router queue, a request finding every worker busy waits (instead of the 503)
    and is served once room frees; /metrics shows the queue."""
    from dynamograph.protocol.router_config import RouterConfig

    config = RouterConfig(busy_threshold=0.05, queue_max_requests=4, queue_timeout_s=30)
    async with (
        mock_worker(num_gpu_blocks=64, speedup=1.0) as small,
        run_frontend(None, [small], mode=Mode.KV, router=config) as fe,
    ):
        hog = {"model": model, "prompt": PROMPT, "max_tokens": 800, "ignore_eos": True}
        long_running = asyncio.create_task(post(fe, hog))
        await wait_for(lambda: fe.routing.router.active.total_requests() == 1, what="booking")
        hinted = {"model": model, "prompt": "one more", "max_tokens": 1}
        hinted["nvext"] = {"agent_hints": {"priority": 3}}
        waiting = asyncio.create_task(post(fe, hinted))
        queue = fe.routing.pipeline.queue
        await wait_for(lambda: queue.depth == 1, what="the request to queue")
        assert await frontend_metric(fe, "dynamograph_router_queue_depth") == 1
        async with aiohttp.ClientSession() as session, session.get(fe.url + "/metrics") as r:
            page = await r.text()  # as Prometheus scrapes it: the depth per priority tier
        assert 'dynamograph_router_queue_depth_by_priority{priority="0"} 1.0' in page
        long_running.cancel()  # the client leaves: its booking is freed, the queue moves
        with contextlib.suppress(asyncio.CancelledError):
            await long_running
        status, out, _ = await waiting
        assert status == 200, out
        dispatched = await frontend_metric(
            fe, "dynamograph_router_queue_requests_total", outcome="dispatched"
        )
        assert dispatched == 1
        assert await frontend_metric(fe, "dynamograph_router_queue_wait_seconds_count") == 1


async def test_streamed_output_decays_the_expected_output_booked(model):
    """Output-block decay (Dynamo's `1 - generated / osl`): as a streamed answer goes through
    the kv mode's frontend, its expected output stops weighing on its worker's booked load."""
    async with mock_worker(speedup=2.0) as w, run_frontend(None, [w], mode=Mode.KV) as fe:
        active = fe.routing.router.active
        slot = (w.config.instance_id, 0)
        body = {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
            "nvext": {"agent_hints": {"osl": 640}},  # 40 blocks of 16
        }

        async def stream() -> None:
            async with (
                aiohttp.ClientSession() as session,
                session.post(fe.url + "/v1/completions", json=body) as r,
            ):
                assert r.status == 200
                async for _ in r.content:
                    pass

        prompt_blocks = -(-len(get_tokenizer("qwen").encode(PROMPT, add_special_tokens=True)) // 16)
        streaming = asyncio.create_task(stream())
        try:
            await wait_for(lambda: slot in active.loads(), what="the booking")
            # booked with its expected output (less what may have streamed already) ...
            assert prompt_blocks + 20 < active.load(slot).decode_blocks <= prompt_blocks + 40
            # ... and once the 640 expected tokens streamed, only the prompt's blocks
            await wait_for(
                lambda: slot in active.loads() and active.load(slot).decode_blocks == prompt_blocks,
                what="the expected output to decay",
            )
        finally:
            streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await streaming


async def test_router_config_override_changes_the_routing_of_that_request_only(model):
    """`nvext.router_config_override` (Dynamo's per-request router settings): an overlap weight
    of 0 routes by load alone, for that request only; values are checked against the router's
    config (a 400 naming the field)."""
    async with (
        mock_worker(speedup=1.0) as a,
        mock_worker() as b,
        run_frontend(None, [a, b], mode=Mode.KV) as fe,
    ):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        assert (await post(fe, body, route(a)))[0] == 200
        await wait_for(lambda: cached_on(fe, a) > 1, what="the prompt's KV events")
        # a long answer keeps a's load above b's: one block of prompt, streaming
        hog = {"model": model, "prompt": "hog", "max_tokens": 2000, "ignore_eos": True}
        hog["stream"] = True
        async with (
            aiohttp.ClientSession() as session,
            session.post(fe.url + "/v1/completions", json=hog, headers=route(a)) as held,
        ):
            assert held.status == 200
            await held.content.readline()  # its prefill is done: only its decode load is left
            # the prompt's cached blocks outweigh a's one extra block of load ...
            _, _, headers = await post(fe, body)
            assert headers["x-dynamograph-worker-id"] == str(a.config.instance_id)
            # ... unless the request weighs the overlap at 0: then load alone decides
            override = {**body, "nvext": {"router_config_override": {"overlap_score_weight": 0}}}
            status, out, headers = await post(fe, override)
            assert status == 200, out
            assert headers["x-dynamograph-worker-id"] == str(b.config.instance_id)
            assert fe.routing.router.config.scorers[0].weight == 1.0  # the router's own
        bad = {**body, "nvext": {"router_config_override": {"router_temperature": -1}}}
        status, out, _ = await post(fe, bad)
        assert status == 400
        assert "nvext.router_config_override.router_temperature" in out["error"]["message"]
    from dynamograph.protocol.router_config import PluginRef, RouterConfig

    blind = RouterConfig(picker=PluginRef(type="round-robin"))
    async with mock_worker() as w, run_frontend(None, [w], mode=Mode.KV, router=blind) as fe:
        sampled = {**body, "nvext": {"router_config_override": {"router_temperature": 0.5}}}
        status, out, _ = await post(fe, sampled)
        assert status == 400 and "samples by no temperature" in out["error"]["message"]


@pytest.mark.parametrize("bootstrap", [False, True])
async def test_a_client_leaving_during_prefill_still_gets_its_decode_leg_sent(model, bootstrap):
    """As Dynamo: a client that disconnects while the prefill runs does not abort it; a decode
    leg is still sent once it is done (on the bootstrap path: again, the first one having been
    closed with the client), so the decode engine pulls (and frees) the KV the prefill holds
    for it; the booking is freed after that. Nothing is left on either engine."""
    async with (
        mock_worker(role=Role.PREFILL, speedup=0.01, bootstrap=bootstrap) as prefill,
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(None, [prefill, decode], mode=Mode.KV) as fe,
    ):
        body = {"model": model, "prompt": PROMPT * 4, "max_tokens": 200, "stream": True}
        client = asyncio.create_task(post(fe, body))

        async def prefilling() -> bool:
            return (await served(prefill))["total"] == 1

        await wait_for(prefilling, what="the prefill leg to start")
        client.cancel()  # the client goes away mid-prefill
        with contextlib.suppress(asyncio.CancelledError):
            await client

        async def decoded() -> bool:
            recent = (await served(decode))["recent"]
            return len(recent) == 1 + bootstrap and recent[-1].get("finish_reason") is not None

        await wait_for(decoded, what="the decode leg to be sent and end", within=30)
        first = (await served(prefill))["recent"][0]
        assert first["finish_reason"] == "length"  # the prefill ran to its end
        leg = (await served(decode))["recent"][-1]
        assert leg["kv_transfer"] and leg["finish_reason"] == "length"
        await wait_for(
            lambda: fe.routing.router.active.total_requests() == 0, what="the booking freed"
        )
        # no KV held for a decode that will never come, nothing running
        assert sum(len(rank.transfers) for rank in prefill.server.engine.ranks) == 0
        for worker in (prefill, decode):
            gauges = await engine_gauges(worker)
            assert gauges["running"] == gauges["waiting"] == 0


async def test_agent_hints_priority_reaches_the_engine_as_vllms_request_priority(model):
    """Dynamo normalises `agent_hints.priority` into the engine's priority: vLLM's request
    `priority` (lower runs first, under `--scheduling-policy priority`), which the mock engine
    honours in its scheduler; under vLLM's default fcfs policy it is refused as vLLM does."""
    async with (
        mock_worker(max_num_seqs=1, speedup=1.0) as w,  # one sequence at a time: a queue forms
        run_frontend(w) as fe,
    ):
        # long enough (~6 s) for the two others to queue behind it on a loaded machine
        hog = {"model": model, "prompt": "hog", "max_tokens": 1000, "ignore_eos": True}
        running = asyncio.create_task(post(fe, hog, route(w)))

        async def queued(n: int) -> bool:
            gauges = await engine_gauges(w)
            return gauges["running"] == 1 and gauges["waiting"] == n

        await wait_for(lambda: queued(0), what="the first request to run")
        order: list[str] = []
        tasks = []
        for name, nvext in (("plain", None), ("important", {"agent_hints": {"priority": 5}})):
            body = {"model": model, "prompt": name, "max_tokens": 5, "ignore_eos": True}
            if nvext:
                body["nvext"] = nvext
            task = asyncio.create_task(post(fe, body, route(w)))
            task.add_done_callback(lambda t, name=name: order.append(name))
            tasks.append(task)
            await wait_for(functools.partial(queued, len(tasks)), what=f"{name} to wait")
        assert (await running)[0] == 200
        assert [status for status, _, _ in await asyncio.gather(*tasks)] == [200, 200]
        assert order == ["important", "plain"]  # it arrived last and ran first
    async with mock_worker(scheduling_policy="fcfs") as w, run_frontend(w) as fe:
        body = {"model": model, "prompt": "hi", "max_tokens": 1}
        body["nvext"] = {"agent_hints": {"priority": 5}}
        status, out, _ = await post(fe, body, route(w))
        assert status == 400 and "Priority scheduling is not enabled" in out["error"]["message"]


def _speculating(session_id: str, action: str | None = None) -> dict:
    session: dict = {"session_id": session_id}
    if action:
        session["action"] = action
    return {"session_control": session, "agent_hints": {"speculative_prefill": True}}


async def test_speculative_prefill_warms_the_next_turn_on_the_bound_worker(model):
    """`agent_hints.speculative_prefill`: after a turn, the frontend prefills the turn's prompt
    followed by its answer (one token) on the worker the session is bound to, so the next turn
    finds that prefix cached there; the speculative request's booking is freed."""
    async with (
        mock_worker() as a,
        mock_worker() as b,
        run_frontend(None, [a, b], mode=Mode.KV) as fe,
    ):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
        body["nvext"] = _speculating("agent", "open")
        status, out, headers = await post(fe, body)
        assert status == 200, out
        bound = a if headers["x-dynamograph-worker-id"] == str(a.config.instance_id) else b
        prefix = PROMPT + out["choices"][0]["text"]
        prefix_tokens = len(get_tokenizer("qwen").encode(prefix, add_special_tokens=True))

        async def speculated() -> bool:
            recent = (await served(bound))["recent"]
            return len(recent) == 2 and recent[1].get("finish_reason") is not None

        await wait_for(speculated, what="the speculative prefill on the bound worker")
        spec = (await served(bound))["recent"][1]
        assert spec["prompt_tokens"] == prefix_tokens and spec["completion_tokens"] == 1
        assert fe.routing.router.active.total_requests() == 0  # its booking is freed
        assert (
            await frontend_metric(
                fe, "dynamograph_frontend_speculative_prefills_total", outcome="done"
            )
            == 1
        )
        # the next turn starts with that prefix: cached on the bound worker
        follow = {"model": model, "prompt": prefix + " And then?", "max_tokens": 1}
        follow["nvext"] = {"session_control": {"session_id": "agent"}}
        status, out, headers = await post(fe, follow)
        assert headers["x-dynamograph-worker-id"] == str(bound.config.instance_id)
        cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prefix_tokens // 16 * 16


async def test_a_speculative_prefill_is_cancelled_when_the_next_turn_comes_first(model):
    """The real turn arriving first cancels the speculative request: the engine aborts it and
    its booking is freed before the turn is routed."""
    async with (
        mock_worker(max_num_seqs=1, speedup=1.0) as w,  # one at a time: the speculation waits
        run_frontend(None, [w], mode=Mode.KV) as fe,
    ):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 60, "ignore_eos": True}
        body["stream"] = True
        body["nvext"] = _speculating("agent", "open")
        hog = {"model": model, "prompt": "hog", "max_tokens": 400, "ignore_eos": True}

        async def waiting(n: int) -> bool:
            return (await engine_gauges(w))["waiting"] == n

        async with (
            aiohttp.ClientSession() as session,
            session.post(fe.url + "/v1/completions", json=body) as turn,
        ):
            assert turn.status == 200
            # a long request queues behind the turn: it runs when the turn ends, so the
            # speculative prefill then waits behind it
            hogging = asyncio.create_task(post(fe, hog, route(w)))
            await wait_for(functools.partial(waiting, 1), what="the long request to queue")
            await turn.read()
        await wait_for(lambda: len(fe._speculative) == 1, what="the speculative prefill")
        await wait_for(functools.partial(waiting, 1), what="the speculative prefill to queue")
        assert fe.routing.router.active.total_requests() == 2  # the long one and it
        follow = {"model": model, "prompt": PROMPT + " And then?", "max_tokens": 1}
        follow["nvext"] = {"session_control": {"session_id": "agent"}}
        status, out, _ = await post(fe, follow)
        assert status == 200, out
        assert (
            await frontend_metric(
                fe, "dynamograph_frontend_speculative_prefills_total", outcome="cancelled"
            )
            == 1
        )
        assert (await hogging)[0] == 200
        # the engine's log: turn, long request, speculation, next turn; the speculation was
        # aborted while it waited (it never ran), and nothing is left running
        spec = (await served(w))["recent"][2]
        assert "first_output" not in spec and spec.get("finish_reason") is None
        gauges = await engine_gauges(w)
        assert gauges["running"] == gauges["waiting"] == 0
        await wait_for(
            lambda: fe.routing.router.active.total_requests() == 0, what="every booking freed"
        )


async def test_the_bootstrap_path_sends_the_decode_leg_before_the_prefill_ends(model):
    """A prefill engine advertising a bootstrap address (SGLang's hand-off, which Dynamo's
    prefill router drives): the prefill leg runs in the background while the decode leg is
    sent at once; the decode engine pulls the KV from the bootstrap address once the prefill
    has it, and the answer is the one the same prompt gets anywhere."""
    async with (
        mock_worker(role=Role.PREFILL, bootstrap=True, speedup=0.02) as prefill,  # slow
        mock_worker(role=Role.DECODE) as decode,
        run_frontend(None, [prefill, decode], mode=Mode.KV) as fe,
    ):
        assert prefill.config.bootstrap_port is not None
        body = {"model": model, "prompt": PROMPT * 4, "max_tokens": 8, "ignore_eos": True}
        answer = asyncio.create_task(post(fe, body))

        async def decode_sent() -> bool:
            return (await served(decode))["total"] == 1

        await wait_for(decode_sent, what="the decode leg")
        (computing,) = (await served(prefill))["recent"]
        assert computing.get("finish_reason") is None  # the prefill has not answered yet
        status, out, _ = await answer
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 8
        (leg,) = (await served(decode))["recent"]
        assert leg["kv_transfer"] and leg["finish_reason"] == "length"
        assert (await served(prefill))["recent"][0]["finish_reason"] == "length"
        # the decode engine pulled the prefill's KV: nothing is held for it any more
        assert sum(len(rank.transfers) for rank in prefill.server.engine.ranks) == 0
        await wait_for(
            lambda: fe.routing.router.active.total_requests() == 0, what="the booking freed"
        )
    async with mock_worker() as single, run_frontend(single) as fe:  # the same prompt, whole
        status, whole, _ = await post(fe, body, route(single))
        assert whole["choices"][0]["text"] == out["choices"][0]["text"]
