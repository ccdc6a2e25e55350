"""EPP readiness: not ready until a worker is known AND the tokenizer it names is loaded (the
first requests would otherwise wait seconds for a vocabulary), and never ready again once
draining."""

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.router import pipeline as pipeline_module
from e2e.waiting import wait_for

from .conftest import running_epp

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="readiness")
        return (await stub.Check(request, timeout=5)).status


async def test_ready_only_once_the_workers_tokenizer_is_loaded(workers, monkeypatch):
    release = threading.Event()
    real = pipeline_module.get_tokenizer

    def slow_load(spec, **options):  # runs in the preload thread
        assert release.wait(30), "the test never released the tokenizer load"
        return real(spec, **options)

    monkeypatch.setattr(pipeline_module, "get_tokenizer", slow_load)
    try:
        async with running_epp(workers) as epp:
            # Workers known, vocabulary still loading: not ready, and it stays so while the
            # load is held (the pauses are the test: nothing may turn readiness on meanwhile).
            for _ in range(5):
                assert await _readiness(epp.health_port) == NOT_SERVING
                await asyncio.sleep(0.05)
            release.set()
            await wait_for(
                lambda: not epp.tokenizers.loading, "the tokenizer loads to finish", within=30
            )
            assert await _readiness(epp.health_port) == SERVING

            await epp.health.set("readiness", NOT_SERVING)  # what drain() starts with
            epp._draining = True
            epp._update_readiness()  # e.g. a worker appearing while draining
            await wait_for(lambda: not epp._background, "the readiness update to run")
            assert await _readiness(epp.health_port) == NOT_SERVING
    finally:
        release.set()
