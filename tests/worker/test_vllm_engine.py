"""`/v1/engine` for a real vLLM worker: the launcher's document and the middleware that serves it
inside `vllm serve` (no vLLM here: the middleware runs in front of a stand-in ASGI app, behind a
real HTTP server, the way vLLM's FastAPI app would carry it)."""

import argparse
import importlib
import json
from types import SimpleNamespace

import aiohttp
import pytest

from dynamograph.protocol.engine import ENGINE_PATH, EngineConfig, Role
from dynamograph.protocol.identity import instance_id
from dynamograph.worker.vllm import (
    MIDDLEWARE,
    engine_document,
    vllm_argv,
    vllm_env,
)
from dynamograph.worker.vllm_engine import ENV, EngineDocument

from .conftest import serve_asgi
from .conftest import worker_args as parse_worker_args

pytestmark = pytest.mark.integration


def worker_args(*argv: str) -> argparse.Namespace:
    return parse_worker_args("--engine", "vllm", *argv)


def test_document_from_the_flags_vllm_gets():
    args = worker_args(
        "--model", "Qwen/Qwen3-8B", "--served-model-name", "qwen", "--role", "prefill",
        "--block-size", "32", "--num-gpu-blocks", "5000", "--port", "8100",
        "--kv-events-port", "5600", "--kv-replay-port", "5601", "--data-parallel-size", "2",
        "--lora-modules", "sql=/adapters/sql", "--lora-modules", "chat=/adapters/chat",
    )  # fmt: skip
    document = engine_document(args, "pod-7", "qwen:qwen3", {"POD_IP": "10.1.2.3"})
    config = EngineConfig.model_validate(document)
    assert (config.instance_id, config.name, config.engine) == (
        instance_id("pod-7"),
        "pod-7",
        "vllm",
    )
    assert (config.kv_cache_block_size, config.total_kv_blocks) == (32, 5000)
    assert (config.role, config.data_parallel_size, config.tokenizer) == (
        Role.PREFILL,
        2,
        "qwen:qwen3",
    )
    assert config.kv_events.endpoint == "tcp://10.1.2.3:5600"  # other pods reach it there
    assert config.kv_events.replay_endpoint == "tcp://10.1.2.3:5601"
    # vLLM's decode leg needs the prefill's answer (NIXL block ids): no bootstrap path
    assert (config.bootstrap_host, config.bootstrap_port) == (None, None)
    assert config.lora_adapters == {1: "sql", 2: "chat"}  # vLLM's ids, in load order

    env = vllm_env(args, document, base={"POD_IP": "10.1.2.3"})
    assert EngineConfig.model_validate(json.loads(env[ENV])) == config  # JSON keys: "1" → 1
    argv = vllm_argv(args)
    assert argv[argv.index("--middleware") + 1] == MIDDLEWARE
    module, _, name = MIDDLEWARE.rpartition(".")
    assert getattr(importlib.import_module(module), name) is EngineDocument  # vLLM imports it


def test_without_a_gpu_block_override_vllm_decides_the_cache_size():
    document = engine_document(worker_args("--model", "m"), "pod", "qwen", {})
    assert document["total_kv_blocks"] is None
    with pytest.raises(RuntimeError, match=ENV):
        EngineDocument(app=None)  # started by hand, without the launcher's document


async def stand_in_vllm(scope, receive, send):
    """What vLLM's own routes answer (everything but /v1/engine)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"vllm:" + scope["path"].encode()})


async def test_middleware_serves_the_document_once_vllm_has_sized_its_cache():
    document = engine_document(worker_args("--model", "m", "--name", "w"), "w", "qwen", {})
    middleware = EngineDocument(stand_in_vllm, document)
    fastapi_app = SimpleNamespace(state=SimpleNamespace())  # vLLM sets vllm_config at startup

    async def starlette(scope, receive, send):  # Starlette puts its app in the scope
        await middleware({**scope, "app": fastapi_app}, receive, send)

    async with serve_asgi(starlette) as base, aiohttp.ClientSession() as http:
        async with http.get(base + ENGINE_PATH) as response:
            assert response.status == 503  # discovery retries until the cache is sized
            assert "KV cache" in (await response.json())["error"]["message"]
        cache = SimpleNamespace(num_gpu_blocks=12345)
        fastapi_app.state.vllm_config = SimpleNamespace(cache_config=cache)
        async with http.get(base + ENGINE_PATH) as response:
            assert response.status == 200
            config = EngineConfig.model_validate(await response.json())
        assert (config.total_kv_blocks, config.engine, config.name) == (12345, "vllm", "w")
        async with http.head(base + ENGINE_PATH) as response:
            assert response.status == 200 and await response.read() == b""
        async with http.post(base + ENGINE_PATH) as response:
            assert response.status == 405
        async with http.get(base + "/v1/models") as response:  # vLLM's routes untouched
            assert await response.read() == b"vllm:/v1/models"


def test_vllm_is_launched_with_the_priority_policy_the_frontend_forwards_for():
    """The frontend forwards `agent_hints.priority` as vLLM's request `priority`, which vLLM
    takes only under `--scheduling-policy priority` (else a 400): the launcher sets it."""
    argv = vllm_argv(worker_args("--engine", "vllm"))
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    argv = vllm_argv(worker_args("--engine", "vllm", "--scheduling-policy", "fcfs"))
    assert argv[argv.index("--scheduling-policy") + 1] == "fcfs"
