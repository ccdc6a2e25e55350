"""The EPP's InferenceObjective watch (epp/objectives.py) against the real control plane, with
the token of the ServiceAccount the operator makes for a graph's EPP: the Role it renders lets
the watch list and follow the pool's objectives (RBAC enforced by the real apiserver).

The InferenceObjective CRD is a stand-in written here (GAIE's group, version, names, and the
`spec.poolRef` / `spec.priority` fields the EPP reads): GAIE's own CRD file is not among the
upstream copies this repository carries (tests/operator/data/upstream-crds)."""

import asyncio

from kubernetes_asyncio import client, config

from dynamograph.epp.objectives import GROUP, PLURAL, VERSION, ObjectiveTable, objective_watch
from dynamograph.operator.manifests import discovery_name
from e2e.waiting import wait_for as wait_async

from .conftest import describe, service_account_kubeconfig, wait_for
from .test_operator import graph_manifest

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"{PLURAL}.{GROUP}"},
    "spec": {
        "group": GROUP,
        "names": {
            "kind": "InferenceObjective",
            "listKind": "InferenceObjectiveList",
            "plural": PLURAL,
            "singular": "inferenceobjective",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["poolRef"],
                                "properties": {
                                    "poolRef": {
                                        "type": "object",
                                        "required": ["name"],
                                        "properties": {
                                            "group": {"type": "string"},
                                            "kind": {"type": "string"},
                                            "name": {"type": "string"},
                                        },
                                    },
                                    "priority": {"type": "integer"},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def objective(name: str, namespace: str, pool: str, priority: int) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"poolRef": {"name": pool}, "priority": priority},
    }


async def test_the_epps_service_account_watches_its_pools_objectives(
    control_plane, operator, namespace, tmp_path
):
    cp = control_plane
    cp.kubectl_apply(CRD)
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PLURAL}.{GROUP}")
    services = {"worker": {"componentType": "worker"}, "epp": {"componentType": "epp"}}
    cp.kubectl_apply(graph_manifest("obj", namespace, services))
    account = discovery_name("obj")
    wait_for(
        "the EPP's ServiceAccount and Role",
        lambda: (
            cp.kubectl("get", "role", account, "-n", namespace, check=False).returncode == 0
            and cp.kubectl("get", "sa", account, "-n", namespace, check=False).returncode == 0
        ),
        60,
        describe=lambda: describe(cp, namespace, operator),
    )
    cp.kubectl_apply(objective("chat", namespace, "obj", 4))
    kubeconfig = service_account_kubeconfig(cp, namespace, account, tmp_path / "kubeconfig")
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    table = ObjectiveTable()
    watch = objective_watch(namespace, "obj", configuration, retry_interval=0.2)
    task = asyncio.create_task(watch.run(table))
    try:
        await wait_async(lambda: table.priority("chat") == 4, "the listed objective", within=30)
        cp.kubectl_apply(objective("batch", namespace, "obj", -2))
        cp.kubectl_apply(objective("other", namespace, "not-obj", 9))
        await wait_async(lambda: table.priority("batch") == -2, "the watched one", within=30)
        assert table.priority("other") == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
