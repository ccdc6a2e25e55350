"""A worker whose published tokenizer the EPP cannot load (a path its pod cannot read) is held
out of routing, readiness counts only the workers it can route, and once the file is there
the worker is routed again."""

import shutil

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.router import tokenizers
from dynamograph.worker.testing import mock_worker, word_level_tokenizer, worker_process
from e2e.waiting import wait_for

from .conftest import ExtProcClient, chat_body, endpoint_of, running_epp, set_headers

pytestmark = pytest.mark.integration

COMPLETIONS = "/v1/completions"  # the word-level tokenizer has no chat template
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _readiness_becomes(port: int, status: int) -> None:
    async def probe() -> bool:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="readiness")
            return (await stub.Check(request, timeout=5)).status == status

    await wait_for(probe, f"readiness {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}")


async def test_a_worker_whose_tokenizer_cannot_be_loaded_is_held_until_it_can(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tokenizers, "RETRY_S", 0.2)
    vocabulary = tmp_path / "words"
    vocabulary.mkdir()
    words = word_level_tokenizer(vocabulary)
    async with (
        # a process of its own: it loaded the file, the EPP in this one has not
        worker_process("--tokenizer", str(vocabulary), "--served-model-name", "words") as held,
        mock_worker(name="qwen-worker") as other,
    ):
        assert held.config.tokenizer == f"hf:{vocabulary / 'tokenizer.json'}"
        hidden = tmp_path / "elsewhere"
        vocabulary.rename(hidden)  # what the EPP's pod cannot read
        async with running_epp([held, other]) as epp:
            failures = epp.metrics.tokenizer_load_failures.labels(held.config.tokenizer)
            await wait_for(lambda: failures._value.get() >= 2, "the load to fail and be retried")
            assert not epp.router.workers()[held.config.instance_id].ready
            await _readiness_becomes(epp.health_port, SERVING)  # the other worker routes
            client = ExtProcClient(epp.grpc_port)
            try:
                first, _, _ = await client.stream().request(chat_body("hi"))
                assert set_headers(first)["x-gateway-destination-endpoint"] == endpoint_of(other)
                words_prompt = orjson.dumps({"model": "words", "prompt": " ".join(words)})
                refused, _, _ = await client.stream().request(words_prompt, COMPLETIONS)
                assert refused.immediate_response.status.code == 503
                hidden.rename(vocabulary)
                await wait_for(
                    lambda: epp.router.workers()[held.config.instance_id].ready,
                    "the worker to be routed once its tokenizer loads",
                )
                routed, _, _ = await client.stream().request(words_prompt, COMPLETIONS)
                assert set_headers(routed)["x-gateway-destination-endpoint"] == endpoint_of(held)
            finally:
                await client.close()


async def test_readiness_is_not_serving_when_no_worker_can_be_routed(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizers, "RETRY_S", 0.2)
    vocabulary = tmp_path / "words"
    vocabulary.mkdir()
    word_level_tokenizer(vocabulary)
    async with worker_process("--tokenizer", str(vocabulary)) as held:
        shutil.rmtree(vocabulary)
        async with running_epp([held]) as epp:
            failures = epp.metrics.tokenizer_load_failures.labels(held.config.tokenizer)
            await wait_for(lambda: failures._value.get() >= 1, "the load to fail")
            await _readiness_becomes(epp.health_port, NOT_SERVING)
