"""The gateway of the cluster-in-a-box: a real Envoy configured as a GAIE inference gateway.

In a cluster, a Gateway controller reads the InferencePool, resolves its `endpointPickerRef`
Service to the EPP pod and programs Envoy's ext_proc cluster with it. Here `epp_endpoint`
does that resolution (InferencePool -> Service -> ready Pod -> podIP:targetPort, as kube-proxy
would route it) and `run_gateway` starts Envoy from `dynamograph.local.envoy` (the same
bootstrap `dynamograph up` uses) pointed at the EPP pod's loopback address, over TLS (unverified, as kgateway does) unless the
EPP Service's port says `kubernetes.io/h2c`.
"""

import contextlib
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from dynamograph.local.envoy import EnvoyProcess, envoy_config, run_envoy

from ..waiting import wait_for
from . import pods as podlib
from .kubeapi import INFERENCEPOOLS, PODS, SERVICES, KubeApi


def _ready(pod: dict[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def epp_endpoint(
    pool: dict[str, Any], services: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> str | None:
    """`ip:port` of a ready EPP pod behind the pool's endpointPickerRef, or None (pure)."""
    ref = pool["spec"]["endpointPickerRef"]
    if ref.get("kind", "Service") != "Service":
        raise ValueError(f"endpointPickerRef kind {ref.get('kind')!r} is not a Service")
    service = next((s for s in services if s["metadata"]["name"] == ref["name"]), None)
    if service is None:
        return None
    number = int(ref["port"]["number"])
    port = next((p for p in service["spec"].get("ports") or [] if int(p["port"]) == number), None)
    if port is None:
        raise ValueError(f"Service {ref['name']!r} has no port {number} (endpointPickerRef)")
    target = port.get("targetPort", number)
    selector = service["spec"].get("selector")
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        labels = pod["metadata"].get("labels") or {}
        ip = (pod.get("status") or {}).get("podIP")
        if ip and _ready(pod) and podlib.service_selects(selector, labels):
            return f"{ip}:{podlib.resolve_port(target, pod['spec'])}"
    return None


def epp_uses_tls(pool: dict[str, Any], services: list[dict[str, Any]]) -> bool:
    """Whether to speak TLS to the EPP (pure): GAIE gateways do by default; a Service port that
    says `appProtocol: kubernetes.io/h2c` (the operator's Plaintext mode) is cleartext HTTP/2."""
    ref = pool["spec"]["endpointPickerRef"]
    service = next((s for s in services if s["metadata"]["name"] == ref["name"]), None)
    ports = (service or {}).get("spec", {}).get("ports") or []
    number = int(ref["port"]["number"])
    port = next((p for p in ports if int(p["port"]) == number), {})
    return port.get("appProtocol") != "kubernetes.io/h2c"


def fail_open(pool: dict[str, Any]) -> bool:
    return pool["spec"]["endpointPickerRef"].get("failureMode") == "FailOpen"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def resolve(api: KubeApi, namespace: str, pool_name: str) -> tuple[dict, str] | None:
    pool = await api.get(INFERENCEPOOLS, namespace, pool_name)
    if pool is None:
        return None
    address = epp_endpoint(
        pool, await api.list(SERVICES, namespace), await api.list(PODS, namespace)
    )
    return (pool, address) if address else None


@contextlib.asynccontextmanager
async def run_gateway(
    api: KubeApi, namespace: str, pool_name: str, workdir: Path, *, within: float = 90.0
) -> AsyncIterator[EnvoyProcess]:
    """Wait for the pool's EPP to be ready, then run Envoy in front of the pool."""
    pool, address = await wait_for(
        lambda: resolve(api, namespace, pool_name),
        f"InferencePool {namespace}/{pool_name} with a ready endpoint picker",
        within=within,
    )
    tls = epp_uses_tls(pool, await api.list(SERVICES, namespace))
    config = envoy_config(
        free_port(), free_port(), address, failure_mode_allow=fail_open(pool), epp_tls=tls
    )
    async with run_envoy(config, workdir=workdir) as envoy:
        yield envoy
