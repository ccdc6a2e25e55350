"""`dynamograph operator` as a process, logging in with a kubeconfig whose user has an `exec`
credential plugin (as EKS and GKE kubeconfigs do), read by the official `kubernetes` client
through kopf's `login_via_client`; it stops cleanly (exit 0) on SIGTERM.

The emulator refuses every request without the plugin's current token, so the graph becomes
ready only if kopf (watches, graph patches, Events) and the operator's own client (owned
objects, status) both authenticate with it.
"""

import pytest

from e2e.waiting import wait_for

from .emulator import authorization
from .processes import IMAGE, exec_credentials, operator_process
from .test_operator import GRAPH_PATH, GRAPHS, disagg_graph, live

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


def authorizations(cluster) -> set:
    return {authorization(r) for r in list(cluster)}


async def test_exec_plugin_token_is_used_and_renewed(cluster, tmp_path):
    creds = exec_credentials(tmp_path / "creds", str(cluster.url), "token-one")
    cluster.required_token = "token-one"
    auth = {"Authorization": "Bearer token-one"}
    log = tmp_path / "operator.log"
    env = {"KUBECONFIG": str(creds.kubeconfig)}
    async with operator_process(log, "--resync-seconds", "600", env=env) as proc:
        body = disagg_graph()
        response = await cluster.post(GRAPH_PATH, json=body, headers=auth)
        assert response.status in (200, 201), await response.text()

        def ready(name: str):
            return lambda: (
                ((live(cluster, GRAPHS, name) or {}).get("status") or {}).get("state") == "ready"
            )

        await wait_for(ready("g"), f"graph g ready with the plugin's token (log: {log})", within=60)
        assert creds.runs() >= 1
        # Deployments are written by the operator's own client, the graph's finalizer by kopf.
        decode = live(cluster, "apps/v1/deployments", "g-decode")
        assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE  # from env
        assert live(cluster, GRAPHS, "g")["metadata"]["finalizers"]
        assert authorizations(cluster) == {"Bearer token-one"}

        # The token expires: the cluster now wants another one, which the plugin now prints.
        # Both kopf and the operator's client get a 401, run the plugin again and carry on.
        runs = creds.runs()
        creds.set_token("token-two")
        cluster.required_token = "token-two"
        second = disagg_graph()
        second["metadata"]["name"] = "h"
        response = await cluster.post(
            GRAPH_PATH, json=second, headers={"Authorization": "Bearer token-two"}
        )
        assert response.status in (200, 201), await response.text()
        await wait_for(ready("h"), f"graph h ready with the renewed token (log: {log})", within=60)
        assert creds.runs() > runs
        assert live(cluster, "apps/v1/deployments", "h-decode") is not None
    assert proc.returncode == 0, log.read_text()[-3000:]
