"""The kopf operator end to end against the API emulator (kmock + the layer in conftest.py)."""

import asyncio

import kopf
import pytest
import yaml
from kopf.testing import KopfRunner

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.handlers import build_registry

from .conftest import EXAMPLES, NAMESPACE, wait_for

pytestmark = pytest.mark.operator

GRAPHS = "dynamograph.io/v1alpha1/dynamographs"


def operator_runner(resync: float = 1.0) -> KopfRunner:
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    config = OperatorConfig(image="example.com/dynamograph:test", resync_seconds=resync)
    return KopfRunner(
        ["run", "-A", "--standalone"],
        registry=build_registry(config),
        settings=settings,
        timeout=30,
    )


def graph_body(name: str = "agg", example: str = "agg.yaml") -> dict:
    body = yaml.safe_load((EXAMPLES / example).read_text())
    body["metadata"] = {"name": name, "namespace": NAMESPACE}
    return body


async def test_smoke(cluster):
    with operator_runner() as runner:
        await asyncio.sleep(1)
        await cluster.post(
            f"/apis/dynamograph.io/v1alpha1/namespaces/{NAMESPACE}/dynamographs", json=graph_body()
        )

        def ready():
            key = (GRAPHS, NAMESPACE, "agg")
            try:
                return (cluster.objects[key].raw.get("status") or {}).get("state") == "ready"
            except KeyError:
                return None

        try:
            await wait_for(ready, 15, "ready")
        finally:
            with open("/tmp/dbg3.txt", "w") as f:
                import json

                for v in cluster.objects[(GRAPHS, NAMESPACE, "agg")].history:
                    print(
                        json.dumps(
                            v
                            and [
                                v.raw["metadata"]["resourceVersion"],
                                v.raw.get("status", {}).get("state"),
                                [
                                    (c["type"], c["status"], c["message"][:80])
                                    for c in v.raw.get("status", {}).get("conditions", [])
                                ],
                            ]
                        ),
                        file=f,
                    )
            with open("/tmp/dbg.txt", "w") as f:
                for r in list(cluster._requests)[:120]:
                    print(r.method, r.url.path_qs, str(r.data)[:300], file=f)
    open("/tmp/dbg2.txt", "w").write(runner.output)
