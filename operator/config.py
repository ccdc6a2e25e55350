"""Operator-wide settings: which image the pods run, how often graphs are re-checked, and the
cluster's side of each graph's NetworkPolicy and PodMonitor (docs/operator.md).

Read from the environment (the Helm chart sets them on the operator Deployment) and overridable
by `dynamograph operator` flags. A service's own `image` field wins over the operator's image.
The network settings are the platform's, not a graph's: where the gateway's proxies and
Prometheus run, and which labels make Prometheus pick up a PodMonitor.
"""

import importlib.metadata
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

IMAGE_REPOSITORY = "ghcr.io/dynamograph/dynamograph"
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
# kube-prometheus-stack's (and most clusters') namespace for Prometheus; the label is the one
# Kubernetes puts on every namespace.
DEFAULT_METRICS_FROM = (
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
)


def default_image() -> str:
    """The image of this very release: pods run the same dynamograph as the operator."""
    try:
        version = importlib.metadata.version("dynamograph")
    except importlib.metadata.PackageNotFoundError:
        version = "latest"
    return f"{IMAGE_REPOSITORY}:{version}"


@dataclass(frozen=True)
class OperatorConfig:
    image: str
    image_pull_policy: str = "IfNotPresent"
    # Timer period for drift repair and status refresh; Deployment events act sooner.
    resync_seconds: float = 30.0
    # A NetworkPolicy per graph: only its EPP and frontends reach the engines' ports.
    network_policy: bool = True
    # NetworkPolicyPeers (as in a rule's `from`) allowed to the EPP's gRPC port. Empty: the
    # namespace of the graph's Gateway (its parentRef), else anyone.
    gateway_from: tuple[dict[str, Any], ...] = ()
    # NetworkPolicyPeers allowed to the metrics ports (Prometheus). Empty: nobody outside.
    metrics_from: tuple[dict[str, Any], ...] = DEFAULT_METRICS_FROM
    # A PodMonitor per graph where the Prometheus Operator's CRD is served, with these labels
    # besides the graph's (a Prometheus selects PodMonitors by label, e.g. `release: ...`).
    pod_monitor: bool = True
    pod_monitor_labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.image:
            raise ValueError("the operator needs a default image (DYNAMOGRAPH_IMAGE)")
        if self.image_pull_policy not in PULL_POLICIES:
            raise ValueError(
                f"image pull policy must be one of {', '.join(PULL_POLICIES)}, "
                f"not {self.image_pull_policy!r}"
            )
        if self.resync_seconds <= 0:
            raise ValueError("the resync period must be positive")
        for name, peers in (
            ("gateway_from", self.gateway_from),
            ("metrics_from", self.metrics_from),
        ):
            if not all(isinstance(peer, dict) for peer in peers):
                raise ValueError(f"{name} must be a list of NetworkPolicyPeer mappings")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "OperatorConfig":
        """DYNAMOGRAPH_IMAGE, DYNAMOGRAPH_IMAGE_PULL_POLICY, DYNAMOGRAPH_RESYNC_SECONDS,
        DYNAMOGRAPH_NETWORK_POLICY (true/false), DYNAMOGRAPH_GATEWAY_FROM and
        DYNAMOGRAPH_METRICS_FROM (JSON lists of NetworkPolicyPeers), DYNAMOGRAPH_POD_MONITOR
        (true/false) and DYNAMOGRAPH_POD_MONITOR_LABELS (a JSON mapping)."""
        try:
            resync = float(env.get("DYNAMOGRAPH_RESYNC_SECONDS", "30"))
        except ValueError:
            raise ValueError("DYNAMOGRAPH_RESYNC_SECONDS must be a number of seconds") from None
        metrics = _json_env(env, "DYNAMOGRAPH_METRICS_FROM", list)
        return cls(
            image=env.get("DYNAMOGRAPH_IMAGE") or default_image(),
            image_pull_policy=env.get("DYNAMOGRAPH_IMAGE_PULL_POLICY", "IfNotPresent"),
            resync_seconds=resync,
            network_policy=_flag_env(env, "DYNAMOGRAPH_NETWORK_POLICY"),
            gateway_from=tuple(_json_env(env, "DYNAMOGRAPH_GATEWAY_FROM", list) or ()),
            metrics_from=DEFAULT_METRICS_FROM if metrics is None else tuple(metrics),
            pod_monitor=_flag_env(env, "DYNAMOGRAPH_POD_MONITOR"),
            pod_monitor_labels=_json_env(env, "DYNAMOGRAPH_POD_MONITOR_LABELS", dict) or {},
        )


def _flag_env(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "true").strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value == "true"


def _json_env(env: Mapping[str, str], name: str, kind: type) -> Any:
    """The JSON value of `name` (None when unset or empty), which must be a `kind`."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        raise ValueError(f"{name} is not valid JSON: {text[:80]!r}") from None
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be a JSON {'list' if kind is list else 'mapping'}")
    return value
