"""`dynamograph operator` as a process: the real entry point against the API emulator."""

import pytest

from .emulator import wait_for
from .processes import IMAGE, operator_process
from .test_operator import GRAPH_PATH, GRAPHS, disagg_graph, live

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


async def test_operator_command_reconciles_and_stops_on_sigterm(cluster, tmp_path):
    log = tmp_path / "operator.log"
    async with operator_process(log, "--resync-seconds", "600") as proc:
        await cluster.post(GRAPH_PATH, json=disagg_graph())

        def ready():
            status = (live(cluster, GRAPHS, "g") or {}).get("status") or {}
            return status.get("state") == "ready"

        await wait_for(ready, 60, f"the graph to be ready (log: {log})")
        decode = live(cluster, "apps/v1/deployments", "g-decode")
        image = decode["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image == IMAGE
    assert proc.returncode == 0, log.read_text()[-3000:]
