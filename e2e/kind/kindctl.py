"""Drive a kind cluster for the e2e suite: pinned versions, command builders, setup steps.

Everything that touches the cluster is a command line built by a pure function (unit-tested
without a cluster) and run by `run()`. The pytest fixtures and the `python -m e2e.kind.kindctl`
CLI (`up`, `down`, `status`) call the same steps, so a laptop run and the test run are identical.

Pinned versions (a combination published together by the GAIE getting-started guide and NVIDIA
Dynamo's inference-gateway install script): kind v0.29.0 with node image kindest/node:v1.33.1,
Gateway API v1.4.1 (standard channel), Gateway API Inference Extension v1.2.1 (InferencePool
`inference.networking.k8s.io/v1`), kgateway v2.1.1 with `inferenceExtension.enabled=true` as the
Envoy-based gateway. Override with the environment variables named in `Versions.from_env`.
"""

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent.parent
HERE = Path(__file__).resolve().parent
MANIFESTS = HERE / "manifests"
LOCAL_BIN = REPO / ".local" / "bin"
DOCKERFILE = REPO / "Dockerfile"
CHART = REPO / "charts" / "dynamograph"
CRD_DIR = REPO / "crds"

TOOLS = ("docker", "kind", "kubectl", "helm")
GATEWAY_NAME = "inference-gateway"
GATEWAY_LABEL = "gateway.networking.k8s.io/gateway-name"
KGATEWAY_NAMESPACE = "kgateway-system"
OPERATOR_NAMESPACE = "dynamograph-system"
OPERATOR_RELEASE = "dynamograph"


@dataclass(frozen=True)
class Versions:
    kind_node_image: str = "kindest/node:v1.33.1"
    gateway_api: str = "v1.4.1"
    inference_extension: str = "v1.2.1"
    kgateway: str = "v2.1.1"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Versions":
        overrides = {
            "kind_node_image": env.get("E2E_KIND_NODE_IMAGE"),
            "gateway_api": env.get("E2E_GATEWAY_API_VERSION"),
            "inference_extension": env.get("E2E_GAIE_VERSION"),
            "kgateway": env.get("E2E_KGATEWAY_VERSION"),
        }
        return replace(cls(), **{k: v for k, v in overrides.items() if v})

    @property
    def gateway_api_url(self) -> str:
        return (
            "https://github.com/kubernetes-sigs/gateway-api/releases/download/"
            f"{self.gateway_api}/standard-install.yaml"
        )

    @property
    def inference_extension_url(self) -> str:
        return (
            "https://github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/"
            f"{self.inference_extension}/manifests.yaml"
        )


@dataclass(frozen=True)
class Settings:
    cluster: str = "dynamograph-e2e"
    image: str = "dynamograph:e2e"
    namespace: str = "dynamograph-e2e"
    versions: Versions = Versions()
    keep: bool = False  # leave the cluster running after the tests

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        return cls(
            cluster=env.get("E2E_KIND_CLUSTER", cls.cluster),
            image=env.get("E2E_IMAGE", cls.image),
            namespace=env.get("E2E_NAMESPACE", cls.namespace),
            versions=Versions.from_env(env),
            keep=env.get("E2E_KEEP_CLUSTER", "") == "1",
        )

    @property
    def context(self) -> str:
        return f"kind-{self.cluster}"


# ---- finding tools -------------------------------------------------------------------------


def tool_path(name: str) -> str | None:
    """A tool on PATH, else in `.local/bin` (where scripts/fetch-helm.sh puts helm and kubectl)."""
    found = shutil.which(name)
    if found:
        return found
    local = LOCAL_BIN / name
    return str(local) if local.is_file() and os.access(local, os.X_OK) else None


def docker_daemon_error() -> str | None:
    """None when `docker info` answers, else why not (a client without a daemon is common)."""
    docker = tool_path("docker")
    if docker is None:
        return "docker is not installed"
    try:
        done = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker info failed: {exc}"
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()
        return f"the docker daemon is not reachable ({reason[-1] if reason else 'no output'})"
    return None


def missing_requirements() -> list[str]:
    """What this machine lacks for the kind suite, each named so a person can fix it."""
    missing = [f"{t} (not on PATH or in .local/bin)" for t in TOOLS if tool_path(t) is None]
    if tool_path("docker") is not None:
        daemon = docker_daemon_error()
        if daemon:
            missing.append(daemon)
    return missing


# ---- command builders (pure) ---------------------------------------------------------------


def kind_create(s: Settings, config: Path) -> list[str]:
    return [
        "kind", "create", "cluster", "--name", s.cluster,
        "--image", s.versions.kind_node_image, "--config", str(config), "--wait", "180s",
    ]  # fmt: skip


def kind_delete(s: Settings) -> list[str]:
    return ["kind", "delete", "cluster", "--name", s.cluster]


def kind_clusters() -> list[str]:
    return ["kind", "get", "clusters"]


def kind_load(s: Settings) -> list[str]:
    return ["kind", "load", "docker-image", s.image, "--name", s.cluster]


def docker_build(s: Settings, dockerfile: Path = DOCKERFILE, context: Path = REPO) -> list[str]:
    return ["docker", "build", "-t", s.image, "-f", str(dockerfile), str(context)]


def kubectl(s: Settings, *args: str) -> list[str]:
    return ["kubectl", "--context", s.context, *args]


def kubectl_apply(s: Settings, source: str | Path, namespace: str | None = None) -> list[str]:
    # Server-side apply: the Gateway API CRDs exceed the client-side annotation size limit.
    args = ["apply", "--server-side", "--force-conflicts", "-f", str(source)]
    if namespace:
        args += ["-n", namespace]
    return kubectl(s, *args)


def helm(s: Settings, *args: str) -> list[str]:
    return ["helm", "--kube-context", s.context, *args]


def helm_install(
    s: Settings,
    release: str,
    chart: str | Path,
    namespace: str,
    *,
    version: str | None = None,
    values: Mapping[str, Any] | None = None,
    wait: str = "5m",
) -> list[str]:
    args = [
        "upgrade", "--install", release, str(chart), "--namespace", namespace,
        "--create-namespace", "--wait", "--timeout", wait,
    ]  # fmt: skip
    if version:
        args += ["--version", version]
    for key, value in (values or {}).items():
        args += ["--set", f"{key}={_helm_value(value)}"]
    return helm(s, *args)


def _helm_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def image_values(image: str) -> dict[str, str]:
    """The chart's image values for a local image (`repo:tag`), never pulled from a registry."""
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:
        repository, tag = image, "latest"
    return {"image.repository": repository, "image.tag": tag, "image.pullPolicy": "IfNotPresent"}


def port_forward(s: Settings, namespace: str, service: str, local: int, remote: int) -> list[str]:
    return kubectl(
        s, "port-forward", "-n", namespace, f"svc/{service}", f"{local}:{remote}",
        "--address", "127.0.0.1",
    )  # fmt: skip


def get_json(s: Settings, kind: str, namespace: str | None, *names_or_flags: str) -> list[str]:
    args = ["get", kind, *names_or_flags, "-o", "json"]
    if namespace:
        args += ["-n", namespace]
    return kubectl(s, *args)


def merge_patch(s: Settings, kind: str, namespace: str, name: str, patch: dict) -> list[str]:
    import json

    return kubectl(
        s, "patch", kind, name, "-n", namespace, "--type", "merge", "-p", json.dumps(patch)
    )


def delete(s: Settings, kind: str, namespace: str, name: str, wait: bool = True) -> list[str]:
    return kubectl(
        s,
        "delete",
        kind,
        name,
        "-n",
        namespace,
        "--ignore-not-found",
        f"--wait={str(wait).lower()}",
    )


def kgateway_installs(s: Settings) -> list[list[str]]:
    """The kgateway CRDs chart, then kgateway with the inference extension."""
    v = s.versions.kgateway
    base = "oci://cr.kgateway.dev/kgateway-dev/charts/"
    return [
        helm_install(s, "kgateway-crds", base + "kgateway-crds", KGATEWAY_NAMESPACE, version=v),
        helm_install(
            s, "kgateway", base + "kgateway", KGATEWAY_NAMESPACE, version=v,
            values={"inferenceExtension.enabled": True},
        ),
    ]  # fmt: skip


# ---- manifests (pure) ----------------------------------------------------------------------


def gateway_manifest(namespace: str, name: str = GATEWAY_NAME) -> dict[str, Any]:
    doc = yaml.safe_load((MANIFESTS / "gateway.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["metadata"]["namespace"] = namespace
    return doc


def namespace_manifest(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}


def items(listing: dict[str, Any]) -> list[dict[str, Any]]:
    return (
        list(listing.get("items") or []) if listing.get("kind", "").endswith("List") else [listing]
    )


def ready_pods(listing: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for pod in items(listing):
        if (pod.get("metadata") or {}).get("deletionTimestamp"):
            continue
        conditions = (pod.get("status") or {}).get("conditions") or []
        if any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions):
            out.append(pod)
    return out


# ---- running -------------------------------------------------------------------------------


class CommandFailed(RuntimeError):
    pass


def resolve(argv: Sequence[str]) -> list[str]:
    """Replace the tool name with its path (PATH, then .local/bin)."""
    path = tool_path(argv[0])
    if path is None:
        raise CommandFailed(f"{argv[0]} is not installed (needed for: {' '.join(argv[:3])} ...)")
    return [path, *argv[1:]]


def run(
    argv: Sequence[str], *, input: str | None = None, timeout: float = 900, check: bool = True
) -> subprocess.CompletedProcess:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    done = subprocess.run(
        resolve(argv), input=input, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise CommandFailed(
            f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr.strip()[-2000:]}"
        )
    return done


def run_json(argv: Sequence[str]) -> dict[str, Any]:
    import json

    return json.loads(run(argv).stdout)


def apply_objects(s: Settings, objects: list[dict[str, Any]]) -> None:
    text = yaml.safe_dump_all(objects, sort_keys=False)
    run(kubectl(s, "apply", "--server-side", "--force-conflicts", "-f", "-"), input=text)


def cluster_exists(s: Settings) -> bool:
    return s.cluster in run(kind_clusters()).stdout.split()


def up(s: Settings) -> None:
    """Create (or reuse) the cluster and install everything the suite needs. Idempotent."""
    if not cluster_exists(s):
        run(kind_create(s, MANIFESTS / "kind-cluster.yaml"), timeout=600)
    run(docker_build(s), timeout=1800)
    run(kind_load(s), timeout=600)
    run(kubectl_apply(s, s.versions.gateway_api_url))
    run(kubectl_apply(s, s.versions.inference_extension_url))
    for argv in kgateway_installs(s):
        run(argv)
    run(kubectl_apply(s, CRD_DIR))
    # The suite reads pods' /metrics through the API server's pod proxy, which connects from a
    # node, not from a Prometheus namespace: the graphs' NetworkPolicies (kindnet enforces them)
    # let the metrics ports take any source here.
    values = {**image_values(s.image), "networkPolicy.metricsFrom[0].ipBlock.cidr": "0.0.0.0/0"}
    run(helm_install(s, OPERATOR_RELEASE, CHART, OPERATOR_NAMESPACE, values=values))
    apply_objects(s, [namespace_manifest(s.namespace), gateway_manifest(s.namespace)])
    run(
        kubectl(
            s, "wait", "--for=condition=Programmed", f"gateway/{GATEWAY_NAME}",
            "-n", s.namespace, "--timeout=300s",
        )
    )  # fmt: skip


def down(s: Settings) -> None:
    run(kind_delete(s), check=False)


def gateway_service(s: Settings) -> str:
    """The Service the gateway controller created for the Gateway: found by the GEP-1762 label,
    else the Service named like the Gateway (kgateway's naming)."""
    listing = run_json(
        get_json(s, "services", s.namespace, "-l", f"{GATEWAY_LABEL}={GATEWAY_NAME}")
    )
    services = [svc["metadata"]["name"] for svc in items(listing)]
    if not services:
        services = [
            svc["metadata"]["name"]
            for svc in items(run_json(get_json(s, "services", s.namespace)))
            if svc["metadata"]["name"] == GATEWAY_NAME
        ]
    if not services:
        raise CommandFailed(
            f"no Service for Gateway {GATEWAY_NAME} in {s.namespace} (neither labelled "
            f"{GATEWAY_LABEL}={GATEWAY_NAME} nor named so): is kgateway running?"
        )
    return services[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.kind.kindctl", description="kind cluster for the dynamograph e2e suite"
    )
    parser.add_argument("step", choices=("up", "down", "status", "check"))
    args = parser.parse_args(argv)
    s = Settings.from_env()
    if args.step == "check":
        missing = missing_requirements()
        for item in missing:
            print(f"missing: {item}")
        return 1 if missing else 0
    if args.step == "up":
        up(s)
    elif args.step == "down":
        down(s)
    else:
        print(run(kubectl(s, "get", "dg,deploy,pods,inferencepool,httproute,gateway", "-A")).stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
