"""bench route's `llmd-precise` policy: llm-d's precise prefix-cache scorer, fed by our workers'
KV events and tokenizing through llm-d's tokenizer service contract (bench/llmd_tokenizer.py).

- `precise_config` points llm-d's shipped configuration at a pool and changes nothing else;
- the tokenizer service, compiled from llm-d-kv-cache's own tokenizer.proto (Go's module cache,
  after `make counterparts`), answers every call llm-d makes with the token ids the workers'
  KV events carry, and failures in the response as llm-d's service does;
- end to end (llm-d's scheduler built, the control plane built): a follow-up of a long prompt
  goes to the worker whose KV events stored the prompt, and llm-d's index says it found them.
"""

import tempfile
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml

from dynamograph.bench.llmd_tokenizer import compile_proto, serving
from dynamograph.bench.route_client import completion_body, send_one
from dynamograph.bench.route_fleet import LaunchError, WorkerSpec, worker_procs
from dynamograph.bench.route_foreign_epp import (
    LLMD_PRECISE_CONFIG,
    PRECISE_SCORER,
    _kv_cache_proto,
    _module_dir,
    index_lookup_hits,
    kv_topic,
    precise_config,
    serve_foreign_epp,
)
from dynamograph.bench.route_metrics import OK, RequestResult
from dynamograph.local.procs import PortPool
from dynamograph.protocol.identity import instance_id
from dynamograph.protocol.openai import CHAT_COMPLETIONS, COMPLETIONS
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens

from .conftest import skip_unless_foreign_epp_runs

SHIPPED = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "decode-filter"},
        {
            "type": PRECISE_SCORER,
            "parameters": {
                "tokenProcessorConfig": {"blockSize": 64, "hashSeed": "42"},
                "indexerConfig": {"kvBlockIndexConfig": {"enableMetrics": True}},
            },
        },
        {"type": "queue-scorer"},
    ],
    "schedulingProfiles": [
        {"name": "default", "plugins": [{"pluginRef": PRECISE_SCORER, "weight": 2.0}]}
    ],
}


def _configured(shipped):
    return precise_config(
        shipped,
        model="m",
        block_size=16,
        tokenizer_socket=Path("/tmp/t.sock"),
        events_port=5600,
        app="bench-x",
    )


def test_precise_config_points_the_shipped_scorer_at_the_pool():
    config = _configured(SHIPPED)
    scorer = config["plugins"][1]["parameters"]
    assert scorer["tokenProcessorConfig"] == {"blockSize": 16, "hashSeed": "42"}
    assert scorer["indexerConfig"] == {
        "kvBlockIndexConfig": {"enableMetrics": True},
        "tokenizersPoolConfig": {
            "modelName": "m",
            "workersCount": 5,
            "uds": {"socketFile": "/tmp/t.sock"},
        },
    }
    assert scorer["kvEventsConfig"] == {
        "topicFilter": "kv@",
        "discoverPods": True,
        "podDiscoveryConfig": {
            "podLabelSelector": "app=bench-x",
            "podNamespace": "default",
            "socketPort": 5600,
        },
    }
    # everything else as shipped, and the shipped configuration untouched
    assert config["plugins"][0] == SHIPPED["plugins"][0]
    assert config["plugins"][2] == SHIPPED["plugins"][2]
    assert config["schedulingProfiles"] == SHIPPED["schedulingProfiles"]
    assert SHIPPED["plugins"][1]["parameters"]["tokenProcessorConfig"]["blockSize"] == 64


def test_precise_config_refuses_a_configuration_without_the_scorer():
    with pytest.raises(LaunchError, match=PRECISE_SCORER):
        _configured({"plugins": [{"type": "queue-scorer"}]})


def test_llmds_own_shipped_configuration_is_accepted():
    path = _module_dir("llmd-epp") / LLMD_PRECISE_CONFIG
    if not path.is_file():
        pytest.skip(f"{path} is not in Go's module cache (make counterparts)")
    config = _configured(yaml.safe_load(path.read_text()))
    (scorer,) = [p for p in config["plugins"] if p["type"] == PRECISE_SCORER]
    assert scorer["parameters"]["kvEventsConfig"]["podDiscoveryConfig"]["socketPort"] == 5600


def test_the_topic_names_the_pod_as_the_scorer_keys_endpoints():
    assert kv_topic("127.1.0.5", 8000, "qwen") == "kv@127.1.0.5:8000@qwen"


def _proto() -> Path:
    proto = _kv_cache_proto()
    if not proto.is_file():
        pytest.skip(f"llm-d's {proto} is not in Go's module cache (make counterparts)")
    return proto


async def test_the_tokenizer_service_answers_llmds_calls_with_the_workers_tokens():
    proto = _proto()
    tokenizer = get_tokenizer("qwen")
    prompt = "The quick brown fox jumps over the lazy dog. " * 20
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]
    with tempfile.TemporaryDirectory(prefix="tok-") as folder:
        socket = Path(folder) / "t.sock"
        pb, pb_grpc = compile_proto(proto, Path(folder))
        async with (
            serving(socket, proto, "qwen") as service,
            grpc.aio.insecure_channel(f"unix://{socket}") as channel,
        ):
            stub = pb_grpc.TokenizationServiceStub(channel)
            init = await stub.InitializeTokenizer(pb.InitializeTokenizerRequest(model_name="x"))
            assert init.success
            rendered = await stub.RenderCompletion(
                pb.RenderCompletionRequest(model_name="x", prompt=prompt)
            )
            tokenized = await stub.Tokenize(pb.TokenizeRequest(model_name="x", input=prompt))
            chat = await stub.RenderChatCompletion(
                pb.RenderChatCompletionRequest(
                    model_name="x",
                    messages=[
                        pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
                    ],
                    add_generation_prompt=True,
                )
            )
            empty = await stub.RenderChatCompletion(pb.RenderChatCompletionRequest())
        assert service.calls == 4
    workers_see = request_tokens(tokenizer, COMPLETIONS, {"prompt": prompt}).tolist()
    assert rendered.success and list(rendered.token_ids) == workers_see
    assert tokenized.success and list(tokenized.input_ids) == workers_see
    chat_tokens = request_tokens(tokenizer, CHAT_COMPLETIONS, {"messages": messages}).tolist()
    assert chat.success and list(chat.token_ids) == chat_tokens
    assert not empty.success and "messages" in empty.error_message


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_follow_ups_go_where_the_kv_events_put_their_prefix(tmp_path):
    skip_unless_foreign_epp_runs("llmd-epp", precise=True)
    spec = WorkerSpec(num_gpu_blocks=4096, speedup=100.0)
    ports = PortPool()
    workers = worker_procs(3, spec, tmp_path / "fleet", ports)
    async with serve_foreign_epp(
        "llmd-precise", "llmd-epp", workers, ports, tmp_path, model=spec.model, precise=True
    ) as routed:
        assert routed.metrics_url is not None
        by_id = {str(instance_id(w.name)): w.name for w in routed.workers}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

            async def send(i: int, prompt: str) -> str:
                result = await send_one(
                    session,
                    routed.url + "/v1/completions",
                    completion_body(spec.model, prompt, 2),
                    RequestResult(index=i),
                )
                assert result.status == OK, result.error
                assert result.worker is not None
                return by_id[result.worker]

            hits_before = await index_lookup_hits(session, routed.metrics_url)
            prompts = [f"Document {i}: " + f"fact {i} is worth noting. " * 120 for i in range(6)]
            first = [await send(i, p) for i, p in enumerate(prompts)]
            # one at a time, after the first ones' KV events had time to arrive
            follow = [await send(10 + i, p + " And then?") for i, p in enumerate(prompts)]
            hits_after = await index_lookup_hits(session, routed.metrics_url)
    assert follow == first, f"first answers from {first}, follow-ups from {follow}"
    assert hits_after > hits_before
