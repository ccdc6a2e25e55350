"""`dynamograph operator` as a process: the real entry point against the API emulator."""

import asyncio
import os
import signal
import sys

import pytest

from .emulator import wait_for
from .test_operator import GRAPH_PATH, GRAPHS, disagg_graph, live

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


async def test_operator_command_reconciles_and_stops_on_sigterm(cluster, tmp_path):
    env = {
        **os.environ,
        "DYNAMOGRAPH_IMAGE": "registry.example/dynamograph:cli",
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dynamograph.cli.main",
            "operator",
            "--liveness-port",
            "0",
            "--resync-seconds",
            "600",
            env=env,
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await cluster.post(GRAPH_PATH, json=disagg_graph())

            def ready():
                status = (live(cluster, GRAPHS, "g") or {}).get("status") or {}
                return status.get("state") == "ready"

            await wait_for(ready, 60, f"the graph to be ready (log: {log})")
            decode = live(cluster, "apps/v1/deployments", "g-decode")
            image = decode["spec"]["template"]["spec"]["containers"][0]["image"]
            assert image == "registry.example/dynamograph:cli"
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 30)
    assert code == 0, log.read_text()[-3000:]
