"""`dynamograph epp` as a process: gRPC health services, Prometheus metrics, and a graceful drain
on SIGTERM (readiness goes NOT_SERVING, new streams are refused, the stream in flight completes)."""

import asyncio
import os
import signal
import sys

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, ExtProcClient, chat_body, endpoint_of, response_body, response_headers

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(stub, service: str):
    try:
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return response.status
    except grpc.aio.AioRpcError as exc:
        return exc.code()


async def _until_status(stub, service, wanted, within=30.0):
    async def reached() -> bool:
        return await _status(stub, service) == wanted

    await wait_for(reached, f"{service} to be {wanted}", within=within)


async def test_health_metrics_and_drain_on_sigterm():
    async with mock_worker(model=MODEL, name="cli-epp-w") as worker:
        grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynamograph.cli", "epp",
            "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--health-port", str(health_port), "--metrics-port", str(metrics_port),
            "--worker", f"{worker.url}={endpoint_of(worker)}", "--drain-grace", "20",
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        client = ExtProcClient(grpc_port)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                await _until_status(health, "liveness", SERVING)
                await _until_status(health, "readiness", SERVING)
                ext_proc = "envoy.service.ext_proc.v3.ExternalProcessor"
                assert await _status(health, ext_proc) == SERVING

                # A request in flight when SIGTERM arrives.
                stream = client.stream()
                first, _, _ = await stream.request(chat_body("drain me " * 40))
                assert first.HasField("request_headers")

                url = f"http://127.0.0.1:{metrics_port}/metrics"
                async with aiohttp.ClientSession() as http, http.get(url) as r:
                    text = await r.text()
                assert 'dynamograph_epp_requests_total{outcome="routed"} 1.0' in text
                assert "dynamograph_epp_active_streams 1.0" in text
                assert 'dynamograph_epp_workers{ready="true",role="aggregated"} 1.0' in text

                proc.send_signal(signal.SIGTERM)
                await _until_status(health, "readiness", NOT_SERVING)
                assert await _status(health, ext_proc) == NOT_SERVING
                # New streams are refused while draining…
                with pytest.raises(grpc.aio.AioRpcError):
                    late = client.stream()
                    await late.request(chat_body("too late"))
                # …and the one in flight finishes normally.
                await stream.send(response_headers())
                assert (await stream.recv()).HasField("response_headers")
                await stream.send(response_body(b"data: [DONE]\n\n", end_of_stream=True))
                last = await stream.recv()
                assert last.response_body.response.body_mutation.streamed_response.end_of_stream
                await stream.call.done_writing()
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            await client.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
