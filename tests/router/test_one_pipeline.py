"""The EPP and the frontend's kv mode route through one request pipeline: for the same requests
and the same router state they make the same decisions (worker, rank, prefill leg, cache)."""

import threading

import orjson
import pytest

from dynamograph.epp.picker import EndpointView, KvEndpointPicker
from dynamograph.frontend.directory import WorkerDirectory
from dynamograph.frontend.kv_mode import KvMode
from dynamograph.frontend.routing import NO_PINS
from dynamograph.protocol.engine import EngineConfig, Role
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.nvext import parse_nvext
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens
from dynamograph.router.discovery import Discovery, StaticSource, WorkerRecord
from dynamograph.router.pipeline import RequestPipeline
from dynamograph.router.scheduler import Router

pytestmark = pytest.mark.unit

MODEL = "qwen"
BS = 16


def record(i: int, role: Role = Role.AGGREGATED, adapters: dict[int, str] | None = None):
    config = EngineConfig(
        model="Qwen/Qwen3-0.6B",
        served_model_name=MODEL,
        context_length=32768,
        kv_cache_block_size=BS,
        total_kv_blocks=4096,
        max_num_seqs=64,
        max_num_batched_tokens=8192,
        instance_id=1000 + i,
        name=f"w{i}",
        role=role,
        data_parallel_size=2 if i == 2 else 1,
        tokenizer="qwen",
        lora_adapters=adapters or {},
    )
    endpoint = None if role == Role.PREFILL else f"127.0.0.{i + 1}:8080"
    return WorkerRecord(config.name, config.instance_id, f"http://w{i}", endpoint, config)


RECORDS = [
    record(0),
    record(1, adapters={1: "sql"}),
    record(2),
    record(3, Role.PREFILL, adapters={1: "sql"}),
    record(4, Role.PREFILL),
]

CHAT = [
    {"role": "system", "content": "You are a careful assistant. " * 20},
    {"role": "user", "content": "Summarise the design of a KV-aware router."},
]
REQUESTS = [
    ("/v1/chat/completions", {"model": MODEL, "messages": CHAT}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [*CHAT, CHAT[1]]}),
    ("/v1/completions", {"model": MODEL, "prompt": "The quick brown fox " * 40}),
    ("/v1/completions", {"model": "sql", "prompt": "SELECT * FROM t WHERE x = 1; " * 30}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "nvext": {"agent_hints": {"osl": 500}}},
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "nvext": {"session_control": {"session_id": "s"}}},
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": CHAT, "nvext": {"session_control": {"session_id": "s"}}},
    ),
    ("/v1/completions", {"model": MODEL, "prompt": "A" * 700, "nvext": {"dp_rank": 1}}),
] * 3


def store(router, worker_id: int, path: str, body: dict) -> None:
    """The worker reports the request's full blocks as stored (as its KV events would)."""
    tokens = request_tokens(get_tokenizer("qwen"), path, body)
    full = len(tokens) // BS * BS
    engine = [hash((worker_id, i)) & (2**63 - 1) for i in range(full // BS)]
    batch = EventBatch(0.0, [BlockStored(engine, None, tokens[:full], BS, None)])
    assert router.apply_kv_batch(worker_id, 0, batch) is None


async def test_the_epp_and_the_frontend_kv_mode_decide_alike():
    config = RouterConfig(seed=11, temperature=0.5)  # sampling: the random draws must match too
    # the EPP's side, wired as `epp.server.Epp` wires it
    view = EndpointView()
    epp = KvEndpointPicker(RequestPipeline(Router(config)), view)
    # the frontend's kv mode, over a directory that knows the same workers
    discovery = Discovery(StaticSource([]))
    discovery.records.update({r.instance_id: r for r in RECORDS})
    frontend = KvMode(
        WorkerDirectory(None, discovery), enforce_disagg=False, kv_events=True, config=config
    )
    assert frontend.config == config
    for r in RECORDS:
        assert epp.pipeline.add_engine(r.config) and frontend.pipeline.add_engine(r.config)
        view.added(r)
    for router in (epp.pipeline.router, frontend.pipeline.router):
        store(router, 1000, *REQUESTS[0])
        store(router, 1002, *REQUESTS[2])

    seen: dict[str, list] = {"epp": [], "frontend": []}
    held = []
    for n, (path, body) in enumerate(REQUESTS):
        route = await epp.pick(path, {"x-request-id": f"r{n}"}, orjson.dumps(body), None)
        h = route.headers
        seen["epp"].append(
            (
                int(h["x-worker-instance-id"]),
                int(h["x-dp-rank"]),
                h.get("x-prefill-instance-id"),
                h.get("x-prefill-dp-rank"),
            )
        )
        chosen = await frontend.pick(NO_PINS, parse_nvext(body.get("nvext")), path, body)
        prefill = chosen.prefill_target
        seen["frontend"].append(
            (
                chosen.decode_target.worker_id,
                chosen.decode_target.dp_rank or 0,
                str(prefill.worker_id) if prefill else None,
                str(prefill.dp_rank or 0) if prefill else None,
            )
        )
        held.append((route.guard, chosen.booking))
        if n % 3 == 2:  # some requests end, others stay booked: the load differs per worker
            for guard in held.pop(0):
                guard.free()
    assert seen["epp"] == seen["frontend"]
    assert len({d[0] for d in seen["epp"]}) > 1  # the requests did not all go one way
    assert {d[2] for d in seen["epp"]} >= {"1003", "1004"}  # disaggregated: both prefill workers
    for guards in held:
        for guard in guards:
            guard.free()
    assert epp.pipeline.router.active.total_requests() == 0
    assert frontend.pipeline.router.active.total_requests() == 0


async def test_a_prompt_past_the_budget_is_routed_by_its_prefix():
    """A 1 MB prompt costs the router its first `max_prompt_chars` characters: those blocks are
    hashed (so it still meets its cached prefix), the rest is only counted."""
    config = RouterConfig(seed=1, max_prompt_chars=4096)
    pipeline = RequestPipeline(Router(config))
    for r in RECORDS[:3]:
        assert pipeline.add_engine(r.config)
    shared = "The quick brown fox jumps over the lazy dog. " * 100  # ~4.5k characters
    whole = {"model": MODEL, "prompt": shared + "x" * 1_000_000}  # no whitespace at all after
    request = pipeline.route_request("/v1/completions", whole, request_id="big")
    prefix_tokens = request_tokens(get_tokenizer("qwen"), "/v1/completions", {"prompt": shared})
    assert len(request.block_hashes) <= 4096 // BS  # only the prefix was hashed
    assert len(request.block_hashes) >= (len(prefix_tokens) * 4096 // len(shared)) // BS - 3
    assert request.isl_tokens >= 1_000_000 // 4  # the rest estimated, not tokenized
    # the prefix's blocks are the whole prompt's: a worker that cached the prefix is found
    store(pipeline.router, 1002, "/v1/completions", {"model": MODEL, "prompt": shared})
    try:
        routed = await pipeline.decide("/v1/completions", whole, request_id="big2")
    finally:
        pipeline.close()
    assert routed.decision.decode.worker_id == 1002
    assert routed.decision.decode.overlap_blocks == len(request.block_hashes)
    routed.decision.guard.free()
    # a chat past the budget keeps its first messages and cuts the one that crosses it
    chat = {"model": MODEL, "messages": [CHAT[0], {"role": "user", "content": "y" * 100_000}]}
    cut = pipeline.route_request("/v1/chat/completions", chat, request_id="chat")
    assert cut.isl_tokens > 100_000 // 4 and len(cut.block_hashes) <= 4096 // BS


async def test_the_kv_events_queued_at_a_decision_are_read_before_it():
    """The pipeline reads the KV events queued (`read_events`, the ingest's `read_queued`)
    before each decision: a worker that stored the prompt's blocks a moment ago is found, with
    no background round in between."""
    pipeline = RequestPipeline(Router(RouterConfig(seed=1)))
    for r in RECORDS[:3]:
        assert pipeline.add_engine(r.config)
    body = {"model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 40}
    reads: list[int] = []

    def read_events() -> None:  # what the ingest finds queued: worker 1002 stored the prompt
        reads.append(pipeline.router.index.block_count((1002, 0)))
        if len(reads) == 1:
            store(pipeline.router, 1002, "/v1/completions", body)

    pipeline.read_events = read_events
    decided = []
    try:
        for request_id in ("a", "b"):
            routed = await pipeline.decide("/v1/completions", body, request_id=request_id)
            routed.decision.guard.free()
            decided.append(routed.decision.decode)
    finally:
        pipeline.close()
    assert reads[0] == 0 and reads[1] > 0  # read once per decision, the first before any event
    for pick in decided:
        assert (pick.worker_id, pick.overlap_blocks) == (1002, reads[1])


async def test_long_prompts_are_tokenized_off_the_event_loop():
    """While one long prompt is tokenized, the loop keeps routing short ones."""
    import asyncio

    pipeline = RequestPipeline(Router(RouterConfig(seed=1, max_prompt_chars=1 << 21)))
    for r in RECORDS[:3]:  # a context the big prompt's 75k tokens fit
        assert pipeline.add_engine(r.config.model_copy(update={"context_length": 1 << 17}))
    pipeline.load_tokenizer("qwen")
    big = {"model": MODEL, "prompt": "a" * 600_000}  # BPE pays superlinearly for this
    short = {"model": MODEL, "prompt": "hello"}
    try:
        long_one = asyncio.create_task(pipeline.decide("/v1/completions", big, request_id="big"))
        routed_meanwhile = 0
        while not long_one.done():
            routed = await pipeline.decide("/v1/completions", short, request_id="s")
            routed.decision.guard.free()
            routed_meanwhile += 1
            await asyncio.sleep(0)
        (await long_one).decision.guard.free()
        assert routed_meanwhile > 1  # the loop was free while the long prompt was tokenized
    finally:
        pipeline.close()


def _pipeline_noting_threads(monkeypatch):
    """A pipeline over three engines, its Qwen tokenizer, and the names of the threads its
    requests are tokenized on (one per `decide`, in order)."""
    pipeline = RequestPipeline(Router(RouterConfig(seed=1)))
    for r in RECORDS[:3]:
        assert pipeline.add_engine(r.config)
    tokenizer = pipeline.load_tokenizer("qwen")
    threads: list[str] = []
    prepare = pipeline.route_request

    def route_request(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(pipeline, "route_request", route_request)
    return pipeline, tokenizer, threads


async def test_a_follow_up_turn_is_tokenized_on_the_loop(monkeypatch):
    """A long conversation's first turn is tokenized on the tokenizing thread; its follow-up,
    whose history is in the segment cache and whose new messages are short, on the event loop
    (no hop to the thread and back), with the ids of tokenizing it afresh."""
    pipeline, tokenizer, threads = _pipeline_noting_threads(monkeypatch)
    document = "A long document about prefix caches, number 41. " * 400  # ~20k characters
    first = [{"role": "user", "content": document}]
    follow = [*first, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "?"}]
    try:
        for messages in (first, follow):
            body = {"model": MODEL, "messages": messages}
            routed = await pipeline.decide("/v1/chat/completions", body, request_id="r")
            routed.decision.guard.free()
            whole = tokenizer.render_chat(messages, add_generation_prompt=True)
            assert routed.prompt_tokens == len(tokenizer._ids(whole))
        assert threads[0].startswith("tokenize")
        assert threads[1] == threading.main_thread().name
        edited = [{"role": "user", "content": document.replace("41", "42")}, *follow[1:]]
        routed = await pipeline.decide(
            "/v1/chat/completions", {"model": MODEL, "messages": edited}, request_id="e"
        )
        routed.decision.guard.free()
        assert threads[2].startswith("tokenize")  # an edited history is new text again
    finally:
        pipeline.close()


async def test_a_completion_that_extends_a_seen_prompt_is_tokenized_on_the_loop(monkeypatch):
    """A long /v1/completions prompt is tokenized on the tokenizing thread; the next one, the
    same text plus a short question (a conversation sent as one growing prompt), finds all but
    its last chunks in the segment cache and is tokenized on the event loop, with the ids of
    tokenizing it afresh."""
    pipeline, tokenizer, threads = _pipeline_noting_threads(monkeypatch)
    document = "A long document about prefix caches, chapter 41. " * 600  # ~30k characters
    try:
        for prompt in (document, document + "So what does a router cache?"):
            body = {"model": MODEL, "prompt": prompt}
            routed = await pipeline.decide("/v1/completions", body, request_id="c")
            routed.decision.guard.free()
            assert routed.prompt_tokens == len(tokenizer._ids(prompt))
        assert threads[0].startswith("tokenize")
        assert threads[1] == threading.main_thread().name
    finally:
        pipeline.close()
