"""Workers that serve no `/v1/engine` (engines we did not launch) described by `--engine-config`:
the template per worker, the flag, and discovery taking it only when `/v1/engine` answers 404."""

import argparse

import pytest
from aiohttp import web

from dynamograph.protocol.engine import EngineConfig
from dynamograph.protocol.identity import instance_id
from dynamograph.router.discovery import (
    Discovery,
    EngineTemplate,
    StaticSource,
    add_discovery_arguments,
    parse_worker_flag,
    pod_target,
    source_from_args,
)
from dynamograph.worker.testing import free_port

pytestmark = pytest.mark.unit

SIM_DOC = """
model: Qwen/Qwen3-0.6B
kv_cache_block_size: 16
tokenizer: qwen
kv_events:
  endpoint: tcp://127.0.0.1:5557
  bind: true
  topic: kv@{host}@Qwen/Qwen3-0.6B
"""


def test_template_fills_each_worker_from_its_address(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(SIM_DOC)
    template = EngineTemplate.load(path)
    a = template.config_for("http://127.0.0.2:8001", "127.0.0.2:8001")
    b = template.config_for("http://[fd00::1]:8001", "w-1")
    assert a.kv_events is not None and b.kv_events is not None
    assert a.kv_events.topic == "kv@127.0.0.2@Qwen/Qwen3-0.6B"
    assert b.kv_events.topic == "kv@[fd00::1]@Qwen/Qwen3-0.6B"
    assert a.kv_events.bind and a.kv_events.endpoint == "tcp://127.0.0.1:5557"
    # named as an engine that does not name itself: by where it was found
    assert (a.name, a.instance_id) == ("127.0.0.2:8001", instance_id("127.0.0.2:8001"))
    assert b.instance_id == instance_id("w-1") != a.instance_id
    assert (a.kv_cache_block_size, a.served_model_name, a.tokenizer) == (16, a.model, "qwen")
    per_port = EngineTemplate.from_fields(
        {"model": "m", "tokenizer": "qwen", "kv_events": {"endpoint": "tcp://{host}:{port}"}}
    )
    events = per_port.config_for("http://10.0.0.5:5557", "p").kv_events
    assert events is not None and events.endpoint == "tcp://10.0.0.5:5557"


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ("model: m\nname: w\n", "name"),
        ("model: m\ninstance_id: 3\n", "instance_id"),
        ("- model: m\n", "mapping"),
        ("model: m\ntokenizer: qwen\nkv_events: {endpoint: 'tcp://{pod}:1'}\n", "{host}"),
        ("model: m\ntokenizer: qwen\nkv_cache_block_size: 0\n", "kv_cache_block_size"),
        ("model: m\ntokenizer: qwen\nbogus: 1\n", "bogus"),
        ("model: meta-llama/Llama-3.1-8B\n", "tokenizer"),  # not a vocabulary we ship
    ],
)
def test_a_wrong_document_is_refused_when_loaded(tmp_path, doc, error):
    path = tmp_path / "engine.yaml"
    path.write_text(doc)
    with pytest.raises(ValueError, match=error):
        EngineTemplate.load(path)


def test_a_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="engine-config"):
        EngineTemplate.load(tmp_path / "absent.yaml")


def test_flag_reaches_the_source(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text(SIM_DOC)
    parser = argparse.ArgumentParser()
    add_discovery_arguments(parser)
    source = source_from_args(
        parser.parse_args(
            ["--worker", "http://127.0.0.2:1=127.0.0.2:1", "--engine-config", str(path)]
        )
    )
    assert source.fallback is not None
    assert source.fallback.fields["kv_cache_block_size"] == 16
    plain = source_from_args(parser.parse_args(["--worker", "http://127.0.0.2:1"]))
    assert plain.fallback is None


def test_a_pod_with_only_a_serving_port_is_a_worker_only_with_an_engine_document(tmp_path):
    pod = {
        "metadata": {"name": "sim-0", "namespace": "ns"},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    # by default it is no worker: a graph's frontends serve `http` and match its selector too
    assert pod_target(pod) is None
    path = tmp_path / "engine.yaml"
    path.write_text(SIM_DOC)
    parser = argparse.ArgumentParser()
    add_discovery_arguments(parser)
    args = ["--discovery", "kubernetes", "--selector", "app=sim", "--engine-config", str(path)]
    source = source_from_args(parser.parse_args(args))
    target = source.target(pod)
    assert target is not None
    assert (target.engine_url, target.serving_endpoint) == ("http://10.0.0.7:8000", "10.0.0.7:8000")


@pytest.mark.integration
async def test_discovery_uses_the_document_only_for_workers_without_one():
    """Two HTTP servers on 127.0.0.1: one answers 404 at /v1/engine (a foreign engine), the
    other serves its own document, which wins over the template."""
    own = EngineConfig(model="own", tokenizer="qwen", name="own-w", kv_cache_block_size=32)

    async def engine_doc(_request: web.Request) -> web.Response:
        return web.Response(body=own.model_dump_json(), content_type="application/json")

    foreign_app, own_app = web.Application(), web.Application()
    own_app.router.add_get("/v1/engine", engine_doc)
    runners = []
    ports = [free_port(), free_port()]
    for app, port in zip((foreign_app, own_app), ports, strict=True):
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    foreign_url, own_url = (f"http://127.0.0.1:{p}" for p in ports)
    template = EngineTemplate.from_fields(
        {"model": "sim", "tokenizer": "qwen", "kv_cache_block_size": 16}
    )
    discovery = Discovery(
        StaticSource(
            [parse_worker_flag(foreign_url), parse_worker_flag(own_url)], fallback=template
        )
    )
    try:
        await discovery.start()
        await discovery.wait_for(lambda: len(discovery.records) == 2, within=10)
        by_url = {r.engine_url: r.config for r in discovery.records.values()}
        assert by_url[foreign_url].model == "sim"
        assert by_url[foreign_url].name == f"127.0.0.1:{ports[0]}"
        assert by_url[own_url] == own
    finally:
        await discovery.stop()
        for runner in runners:
            await runner.cleanup()


async def _stays_undiscovered(app: web.Application) -> None:
    """Serve `app` as a worker's engine on 127.0.0.1: discovery (without `--engine-config`)
    finds no worker there within half a second."""
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    discovery = Discovery(
        StaticSource([parse_worker_flag(f"http://127.0.0.1:{port}")]), retry_interval=0.05
    )
    try:
        await discovery.start()
        with pytest.raises(TimeoutError):
            await discovery.wait_for(lambda: len(discovery.records) > 0, within=0.5)
    finally:
        await discovery.stop()
        await runner.cleanup()


@pytest.mark.integration
async def test_without_a_document_a_foreign_worker_stays_undiscovered():
    await _stays_undiscovered(web.Application())


@pytest.mark.integration
async def test_an_engine_document_without_its_models_tokenizer_is_not_routed_and_says_why(caplog):
    """An engine serving Llama whose /v1/engine names no tokenizer would be routed with Qwen's
    token ids: it stays undiscovered, and the log says what its document lacks."""
    app = web.Application()
    doc = {"model": "meta-llama/Llama-3.1-8B", "kv_cache_block_size": 16}

    async def engine(_: web.Request) -> web.Response:
        return web.json_response(doc)

    app.router.add_get("/v1/engine", engine)
    await _stays_undiscovered(app)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("cannot be used" in m and "tokenizer" in m for m in warned), warned
