"""The process kubelet against the emulator: real worker pods from the operator's manifests,
and Secret volumes.

The worker Deployment is exactly what the operator generates for `examples/agg.yaml` (engine
plus frontend sidecar per pod, downward-API env, probes), so this pins the contract between the
operator's pod specs and the cluster-in-a-box that runs them.
"""

import base64
import stat

import aiohttp
import pytest

from dynamograph.local.procs import is_live
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, admin_token_secret_object, desired_objects
from dynamograph.protocol.graph import load_graph
from dynamograph.protocol.identity import instance_id

from ..graphs import load_example, renamed, with_engine, with_replicas, without_gpus
from ..waiting import wait_for
from .kubeapi import CONFIGMAPS, DEPLOYMENTS, PODS, SECRETS, write_kubeconfig
from .kubelet import ProcessKubelet

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NS = "kubelet-test"


def worker_objects(replicas: int) -> tuple[dict, dict]:
    """The worker Deployment and the admin-token Secret its engines read (which the operator
    creates beside its desired objects)."""
    manifest = renamed(load_example("agg"), "agg", NS)
    manifest = with_replicas(with_engine(without_gpus(manifest), speedup=50.0), "worker", replicas)
    graph = load_graph(manifest)
    owner = Owner("agg", NS, "graph-uid")
    objects = desired_objects(graph, owner, OperatorConfig(image="x:y"))
    deployment = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "agg-worker"
    )
    secret = admin_token_secret_object(graph, owner, "token")
    # No graph object exists here: an owner reference to it would have the GC collect them.
    for obj in (deployment, secret):
        del obj["metadata"]["ownerReferences"]
    return deployment, secret


async def test_deployment_becomes_ready_loopback_pods_that_scale_and_go(api_server, tmp_path):
    url, api, _ = api_server
    kubelet = ProcessKubelet(api, tmp_path / "pods", write_kubeconfig(tmp_path / "kc.yaml", url))
    async with kubelet, aiohttp.ClientSession() as http:

        async def ready_pods(n: int):
            pods = await api.list(PODS, NS)
            ready = [
                p
                for p in pods
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in p.get("status", {}).get("conditions", [])
                )
            ]
            # A one-item tuple: truthy even when the expected set is empty.
            # Pods leave the kubelet's table only once their processes are gone.
            settled = len(ready) == len(pods) == len(kubelet.pods) == n
            return (ready,) if settled else None

        deployment, secret = worker_objects(2)
        await api.create(SECRETS, NS, secret)
        await api.create(DEPLOYMENTS, NS, deployment)
        (pods,) = await wait_for(
            lambda: ready_pods(2), "2 ready pods", within=120, detail=kubelet.describe
        )

        ips = [p["status"]["podIP"] for p in pods]
        assert len(set(ips)) == 2 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
        for pod in pods:
            name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
            assert pod["metadata"]["ownerReferences"][0]["kind"] == "Deployment"
            async with http.get(f"http://{ip}:8000/v1/engine") as r:
                engine = await r.json()
            # POD_NAME from the downward API became the engine's name and instance id.
            assert engine["name"] == name and engine["instance_id"] == instance_id(name)
            assert ip in engine["kv_events"]["endpoint"]  # POD_IP advertised for KV events
            async with http.get(f"http://{ip}:8080/health") as r:
                assert r.status == 200  # the frontend sidecar on the same pod address

        deployment = await api.get(DEPLOYMENTS, NS, "agg-worker")
        assert deployment["status"]["readyReplicas"] == 2
        assert deployment["status"]["updatedReplicas"] == 2

        await api.patch(DEPLOYMENTS, NS, "agg-worker", {"spec": {"replicas": 3}})
        (pods3,) = await wait_for(
            lambda: ready_pods(3), "3 ready pods", within=120, detail=kubelet.describe
        )
        assert {p["metadata"]["name"] for p in pods} < {p["metadata"]["name"] for p in pods3}

        await api.patch(DEPLOYMENTS, NS, "agg-worker", {"spec": {"replicas": 1}})
        await wait_for(lambda: ready_pods(1), "1 pod left", within=60, detail=kubelet.describe)
        assert kubelet.stopped_pids and not any(is_live(pid) for pid in kubelet.stopped_pids)

        await api.delete(DEPLOYMENTS, NS, "agg-worker")

        await wait_for(
            lambda: ready_pods(0), "no pods, no processes", within=60, detail=kubelet.describe
        )
        assert not any(is_live(pid) for pid in kubelet.stopped_pids)


def reader_deployment(namespace: str) -> dict:
    """A pod mounting a required Secret (items with modes), an optional one that does not exist
    and a ConfigMap; its env names a file inside the Secret's mount."""
    mounts = [
        {"name": "tls", "mountPath": "/etc/tls", "readOnly": True},
        {"name": "extra", "mountPath": "/etc/extra"},
        {"name": "cfg", "mountPath": "/etc/cfg"},
    ]
    items = [
        {"key": "tls.key", "path": "private/key", "mode": 0o400},
        {"key": "tls.crt", "path": "tls.crt"},
    ]
    spec = {
        "containers": [
            {
                "name": "main",
                "command": ["dynamograph"],
                "args": ["--help"],  # exits at once: this test looks at what the pod was given
                "env": [{"name": "KEY_FILE", "value": "/etc/tls/private/key"}],
                "volumeMounts": mounts,
            }
        ],
        "volumes": [
            {"name": "tls", "secret": {"secretName": "tls", "defaultMode": 0o440, "items": items}},
            {"name": "extra", "secret": {"secretName": "not-there", "optional": True}},
            {"name": "cfg", "configMap": {"name": "cfg"}},
        ],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "reader", "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "reader"}},
            "template": {"metadata": {"labels": {"app": "reader"}}, "spec": spec},
        },
    }


async def test_secret_volume_waits_for_its_secret_then_holds_its_bytes(api_server, tmp_path):
    url, api, _ = api_server
    ns = "secret-volumes"
    key = bytes(range(256))  # not text: nothing on the way may decode it
    kubelet = ProcessKubelet(api, tmp_path / "pods", write_kubeconfig(tmp_path / "kc.yaml", url))
    try:
        await api.create(
            CONFIGMAPS, ns, {"metadata": {"name": "cfg", "namespace": ns}, "data": {"a": "1"}}
        )
        await api.create(DEPLOYMENTS, ns, reader_deployment(ns))
        # Rounds driven by hand: each is one level-triggered pass of the kubelet's loop.
        await kubelet.reconcile()
        assert not kubelet.pods and await api.list(PODS, ns) == []
        assert kubelet.errors[-1].endswith(
            f"deployment {ns}/reader: volume 'tls': secret 'tls' not found"
        ), kubelet.errors
        assert list((tmp_path / "pods" / ns).iterdir()) == []  # nothing of the unstarted pod

        # As `kubectl create secret tls` stores it: base64 `data`, type kubernetes.io/tls.
        data = {"tls.crt": b"CERT", "tls.key": key}
        await api.create(
            SECRETS,
            ns,
            {
                "metadata": {"name": "tls", "namespace": ns},
                "type": "kubernetes.io/tls",
                "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
            },
        )
        await kubelet.reconcile()
        (pod,) = kubelet.pods.values()
        assert [p["metadata"]["name"] for p in await api.list(PODS, ns)] == [pod.name]
        volumes = pod.directory / "volumes"
        files = {
            str(f.relative_to(volumes)): (f.read_bytes(), stat.S_IMODE(f.stat().st_mode))
            for f in volumes.rglob("*")
            if f.is_file()
        }
        assert files == {
            "tls/private/key": (key, 0o400),
            "tls/tls.crt": (b"CERT", 0o440),
            "cfg/a": (b"1", 0o644),
        }
        assert (volumes / "extra").is_dir()  # the optional Secret that is not there: empty
        (container,) = pod.containers
        assert container.env["KEY_FILE"] == str(volumes / "tls" / "private" / "key")
    finally:
        await kubelet.stop()
