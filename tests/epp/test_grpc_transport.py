"""`dynamograph epp` as a process does its gRPC socket I/O on the thread that polls gRPC's
completion queue (`cli.main.EPP_ENVIRONMENT`): gRPC's EventEngine threads are not woken for
every ext_proc message, as they are under gRPC's defaults. A user's own `GRPC_EXPERIMENTS` wins.

Counted in thread wake-ups (context switches from /proc), not time: the same requests through
the same EPP with the user's empty setting (gRPC's defaults) are the baseline."""

import asyncio
import os
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dynamograph.cli.main import COMMANDS, EPP_ENVIRONMENT, load
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, ExtProcClient, chat_body, endpoint_of

REQUESTS = 40


def _event_engine_wakeups(pid: int) -> dict[str, int]:
    """Context switches so far of each of the process's gRPC EventEngine threads (by thread id:
    the pool may end threads and start others)."""
    counts = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() != "event_engine":
                continue
            status = (task / "status").read_text()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        counts[task.name] = sum(
            int(line.split()[1])
            for line in status.splitlines()
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"))
        )
    return counts


def _since(before: dict[str, int], after: dict[str, int]) -> int:
    """Switches between the two readings of the threads alive at the second."""
    return sum(n - before.get(tid, 0) for tid, n in after.items())


async def _wakeups_per_request(worker, environment: dict[str, str]) -> float:
    """EventEngine wake-ups per routed request of an EPP process started with `environment`."""
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dynamograph.cli", "epp",
        "--host", "127.0.0.1", "--grpc-port", str(grpc_port),
        "--health-port", str(health_port), "--metrics-port", str(metrics_port),
        "--worker", f"{worker.url}={endpoint_of(worker)}",
        env={**environment, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    client = ExtProcClient(grpc_port)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def ready() -> bool:
                try:
                    answer = await health.Check(
                        health_pb2.HealthCheckRequest(service="readiness"), timeout=2
                    )
                except grpc.aio.AioRpcError:
                    return False
                return answer.status == health_pb2.HealthCheckResponse.SERVING

            await wait_for(ready, "the EPP to be ready", within=60)
        before = _event_engine_wakeups(proc.pid)
        for i in range(REQUESTS):
            stream = client.stream()
            first, _, _ = await stream.request(chat_body(f"request {i} " * 200))
            assert first.HasField("request_headers"), first
            await stream.finish_response()
            await stream.call.done_writing()
        return _since(before, _event_engine_wakeups(proc.pid)) / REQUESTS
    finally:
        await client.close()
        proc.kill()
        await proc.wait()


@pytest.mark.integration
async def test_epp_process_does_its_grpc_io_without_event_engine_hops():
    inherited = {k: v for k, v in os.environ.items() if k not in EPP_ENVIRONMENT}
    async with mock_worker(model=MODEL, name="transport-w") as worker:
        ours = await _wakeups_per_request(worker, inherited)
        grpc_default = await _wakeups_per_request(worker, {**inherited, "GRPC_EXPERIMENTS": ""})
    # gRPC's defaults hand each read to an EventEngine thread (~18 wake-ups per request here);
    # ours leaves them nearly asleep.
    assert grpc_default >= 4, f"gRPC's defaults woke EventEngine {grpc_default:.1f}× per request"
    assert ours * 4 <= grpc_default, (ours, grpc_default)


@pytest.mark.unit
def test_users_grpc_setting_wins_over_the_epps(monkeypatch):
    monkeypatch.setenv("GRPC_EXPERIMENTS", "mine")
    load(COMMANDS["epp"])
    assert os.environ["GRPC_EXPERIMENTS"] == "mine"
    monkeypatch.delenv("GRPC_EXPERIMENTS")
    load(COMMANDS["epp"])
    assert os.environ["GRPC_EXPERIMENTS"] == EPP_ENVIRONMENT["GRPC_EXPERIMENTS"]
