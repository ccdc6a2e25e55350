"""Drive a kind cluster for the e2e suite: pinned versions, command builders, setup steps.

Everything that touches the cluster is a command line built by a pure function (unit-tested
without a cluster) and run by `run()`. The pytest fixtures and the `python -m e2e.kind.kindctl`
CLI (`up`, `down`, `status`) call the same steps, so a laptop run and the test run are identical.

Pinned versions (a combination published together by the GAIE getting-started guide and NVIDIA
Dynamo's inference-gateway install script): kind v0.29.0 with node image kindest/node:v1.33.1,
Gateway API v1.4.1 (standard channel), Gateway API Inference Extension v1.2.1 (InferencePool
`inference.networking.k8s.io/v1`), and two gateways, each installed as its own docs say:
- kgateway v2.1.1 (its CRD chart, then the controller with `inferenceExtension.enabled=true`);
- Envoy Gateway v1.7.0 with Envoy AI Gateway v0.6.0 (the pair of AI Gateway's 0.6 docs; Envoy
  Gateway 1.7 is built against Gateway API v1.4.1 and Kubernetes 1.32-1.35): Envoy Gateway's
  chart with AI Gateway's values file and its InferencePool add-on (both from the AI Gateway
  tag), then AI Gateway's CRD chart and controller chart. Its Gateways use a GatewayClass of
  controller `gateway.envoyproxy.io/gatewayclass-controller`.
A Gateway's address comes from a load balancer, which kind lacks: cloud-provider-kind v0.7.0
runs beside the cluster (a container on the `kind` network) and gives every LoadBalancer Service
an address, which the gateway controllers write into their Gateways' `status.addresses`. Override
with the environment variables named in `Versions.from_env`; `E2E_GATEWAYS` picks the gateways.
"""

import argparse
import json
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
ENVOY_GATEWAY_NAMESPACE = "envoy-gateway-system"
AI_GATEWAY_NAMESPACE = "envoy-ai-gateway-system"
OPERATOR_NAMESPACE = "dynamograph-system"
OPERATOR_RELEASE = "dynamograph"


@dataclass(frozen=True)
class Versions:
    kind_node_image: str = "kindest/node:v1.33.1"
    gateway_api: str = "v1.4.1"
    inference_extension: str = "v1.2.1"
    kgateway: str = "v2.1.1"
    envoy_gateway: str = "v1.7.0"
    envoy_ai_gateway: str = "v0.6.0"
    cloud_provider_kind: str = "v0.7.0"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Versions":
        overrides = {
            "kind_node_image": env.get("E2E_KIND_NODE_IMAGE"),
            "gateway_api": env.get("E2E_GATEWAY_API_VERSION"),
            "inference_extension": env.get("E2E_GAIE_VERSION"),
            "kgateway": env.get("E2E_KGATEWAY_VERSION"),
            "envoy_gateway": env.get("E2E_ENVOY_GATEWAY_VERSION"),
            "envoy_ai_gateway": env.get("E2E_AI_GATEWAY_VERSION"),
            "cloud_provider_kind": env.get("E2E_CLOUD_PROVIDER_KIND_VERSION"),
        }
        return replace(cls(), **{k: v for k, v in overrides.items() if v})

    @property
    def cloud_provider_kind_image(self) -> str:
        return (
            "registry.k8s.io/cloud-provider-kind/cloud-controller-manager:"
            f"{self.cloud_provider_kind}"
        )

    def ai_gateway_file(self, path: str) -> str:
        """A file of Envoy AI Gateway's repository at the pinned tag (its install values)."""
        return (
            "https://raw.githubusercontent.com/envoyproxy/ai-gateway/"
            f"{self.envoy_ai_gateway}/{path}"
        )

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
class GatewayProfile:
    """One gateway implementation the suite installs: the Gateway the graphs attach to (in the
    suite's namespace), its class, and where its controller puts the Service of its proxies."""

    name: str  # what E2E_GATEWAYS and the tests' ids call it
    gateway: str  # the Gateway object
    gateway_class: str
    service_namespace: str | None  # None: the Gateway's namespace
    service_labels: tuple[str, ...]  # label keys, valued by the Gateway's name or namespace

    def service_selector(self, namespace: str) -> str:
        values = {
            GATEWAY_LABEL: self.gateway,
            "gateway.envoyproxy.io/owning-gateway-name": self.gateway,
            "gateway.envoyproxy.io/owning-gateway-namespace": namespace,
        }
        return ",".join(f"{key}={values[key]}" for key in self.service_labels)


KGATEWAY = GatewayProfile(
    name="kgateway",
    gateway=GATEWAY_NAME,
    gateway_class="kgateway",
    service_namespace=None,
    service_labels=(GATEWAY_LABEL,),
)
ENVOY_GATEWAY = GatewayProfile(
    name="envoy-gateway",
    gateway="envoy-inference-gateway",
    gateway_class="envoy-gateway",
    service_namespace=ENVOY_GATEWAY_NAMESPACE,
    service_labels=(
        "gateway.envoyproxy.io/owning-gateway-name",
        "gateway.envoyproxy.io/owning-gateway-namespace",
    ),
)
GATEWAYS = {g.name: g for g in (KGATEWAY, ENVOY_GATEWAY)}


def gateways_from(text: str) -> tuple[str, ...]:
    """E2E_GATEWAYS: a comma-separated choice among GATEWAYS."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = sorted(set(names) - set(GATEWAYS))
    if unknown or not names:
        raise ValueError(f"E2E_GATEWAYS={text!r}: choose from {', '.join(GATEWAYS)}")
    return names


@dataclass(frozen=True)
class Settings:
    cluster: str = "dynamograph-e2e"
    image: str = "dynamograph:e2e"
    namespace: str = "dynamograph-e2e"
    versions: Versions = Versions()
    keep: bool = False  # leave the cluster running after the tests
    gateways: tuple[str, ...] = tuple(GATEWAYS)  # which gateways to install and test

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Settings":
        return cls(
            cluster=env.get("E2E_KIND_CLUSTER", cls.cluster),
            image=env.get("E2E_IMAGE", cls.image),
            namespace=env.get("E2E_NAMESPACE", cls.namespace),
            versions=Versions.from_env(env),
            keep=env.get("E2E_KEEP_CLUSTER", "") == "1",
            gateways=gateways_from(env.get("E2E_GATEWAYS") or ",".join(GATEWAYS)),
        )

    @property
    def context(self) -> str:
        return f"kind-{self.cluster}"

    @property
    def cloud_provider(self) -> str:
        """The name of this cluster's cloud-provider-kind container."""
        return f"{self.cluster}-cloud-provider"

    def profiles(self) -> list[GatewayProfile]:
        return [GATEWAYS[name] for name in self.gateways]


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
    values_files: Sequence[str] = (),
    json_values: Mapping[str, Any] | None = None,
    wait: str = "5m",
) -> list[str]:
    args = [
        "upgrade", "--install", release, str(chart), "--namespace", namespace,
        "--create-namespace", "--wait", "--timeout", wait,
    ]  # fmt: skip
    if version:
        args += ["--version", version]
    for path in values_files:
        args += ["-f", path]
    for key, value in (values or {}).items():
        args += ["--set", f"{key}={_helm_value(value)}"]
    for key, value in (json_values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value, separators=(',', ':'))}"]
    return helm(s, *args)


def gateway_from(s: Settings) -> list[dict[str, Any]]:
    """The chart's networkPolicy.gatewayFrom: the namespaces where the selected gateways run
    their proxies (kgateway: the Gateway's; Envoy Gateway: its own), which reach the EPP."""
    namespaces = dict.fromkeys(p.service_namespace or s.namespace for p in s.profiles())
    label = "kubernetes.io/metadata.name"
    return [{"namespaceSelector": {"matchLabels": {label: ns}}} for ns in namespaces]


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


def envoy_gateway_installs(s: Settings) -> list[list[str]]:
    """Envoy Gateway with Envoy AI Gateway's values and its InferencePool add-on (AI Gateway's
    extension server turns an InferencePool backend into the ext_proc filter), then AI Gateway's
    CRD chart and controller, in the order of AI Gateway's install guide. The Gateway API CRDs
    are installed before: Helm leaves existing CRDs alone."""
    v = s.versions
    base = "oci://docker.io/envoyproxy/"
    return [
        helm_install(
            s, "eg", base + "gateway-helm", ENVOY_GATEWAY_NAMESPACE, version=v.envoy_gateway,
            values_files=(
                v.ai_gateway_file("manifests/envoy-gateway-values.yaml"),
                v.ai_gateway_file("examples/inference-pool/envoy-gateway-values-addon.yaml"),
            ),
        ),
        helm_install(
            s, "aieg-crd", base + "ai-gateway-crds-helm", AI_GATEWAY_NAMESPACE,
            version=v.envoy_ai_gateway,
        ),
        helm_install(
            s, "aieg", base + "ai-gateway-helm", AI_GATEWAY_NAMESPACE, version=v.envoy_ai_gateway,
        ),
    ]  # fmt: skip


def gateway_installs(s: Settings, profile: GatewayProfile) -> list[list[str]]:
    installs = {KGATEWAY.name: kgateway_installs, ENVOY_GATEWAY.name: envoy_gateway_installs}
    return installs[profile.name](s)


def docker(*args: str) -> list[str]:
    return ["docker", *args]


def cloud_provider_start(s: Settings) -> list[str]:
    """cloud-provider-kind as its README runs it in a container: on the `kind` network, with
    the Docker socket (it starts a load-balancer container per LoadBalancer Service)."""
    return docker(
        "run", "-d", "--name", s.cloud_provider, "--network", "kind",
        "-v", "/var/run/docker.sock:/var/run/docker.sock", s.versions.cloud_provider_kind_image,
    )  # fmt: skip


def cloud_provider_state(s: Settings) -> list[str]:
    return docker("ps", "-a", "--filter", f"name=^/{s.cloud_provider}$", "--format", "{{.State}}")


def cloud_provider_remove(s: Settings) -> list[str]:
    return docker("rm", "-f", s.cloud_provider)


PROBE = """
import json, sys, urllib.error, urllib.request
url, model = sys.argv[1], sys.argv[2]
headers = {"content-type": "application/json"}
if len(sys.argv) > 3:
    headers["host"] = sys.argv[3]
body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 4,
        "nvext": {"extra_fields": ["worker_id"]}}
request = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions",
                                 data=json.dumps(body).encode(), headers=headers)
try:
    with urllib.request.urlopen(request, timeout=60) as response:
        status, text = response.status, response.read().decode()
except urllib.error.HTTPError as error:
    status, text = error.code, error.read().decode()
print(json.dumps({"status": status, "body": text}))
"""


def probe(s: Settings, pod: str, url: str, model: str, host: str | None = None) -> list[str]:
    """A one-shot pod of the project image that sends one chat completion to `url` (with the
    `Host` header `host`) from inside the cluster, as a client there would, and prints its
    status and body as one JSON line."""
    args = [url, model] + ([host] if host else [])
    return kubectl(
        s, "run", pod, "-n", s.namespace, "--rm", "-i", "--quiet", "--restart=Never",
        f"--image={s.image}", "--image-pull-policy=Never", "--command", "--",
        "python", "-c", PROBE, *args,
    )  # fmt: skip


def probe_result(stdout: str) -> dict[str, Any]:
    """The probe's JSON line (kubectl may print more around it)."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise CommandFailed(f"the probe printed no result: {stdout[-500:]!r}")


# ---- manifests (pure) ----------------------------------------------------------------------


def gateway_manifest(
    namespace: str, name: str = GATEWAY_NAME, gateway_class: str = "kgateway"
) -> dict[str, Any]:
    doc = yaml.safe_load((MANIFESTS / "gateway.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["gatewayClassName"] = gateway_class
    return doc


def gateway_class_manifest(profile: GatewayProfile) -> dict[str, Any] | None:
    """The GatewayClass of a profile's Gateways, where the gateway's install makes none
    (kgateway's chart creates class `kgateway`; Envoy Gateway's leaves it to its user)."""
    if profile.name != ENVOY_GATEWAY.name:
        return None
    doc = yaml.safe_load((MANIFESTS / "envoy-gatewayclass.yaml").read_text())
    doc["metadata"]["name"] = profile.gateway_class
    return doc


def gateway_objects(s: Settings) -> list[dict[str, Any]]:
    """The suite's namespace, then per selected gateway its GatewayClass (if ours) and Gateway."""
    objects = [namespace_manifest(s.namespace)]
    for profile in s.profiles():
        gateway_class = gateway_class_manifest(profile)
        if gateway_class is not None:
            objects.append(gateway_class)
        objects.append(gateway_manifest(s.namespace, profile.gateway, profile.gateway_class))
    return objects


def gateway_address(gateway: dict[str, Any]) -> str | None:
    """The first address the gateway's controller wrote into the Gateway's status."""
    for address in (gateway.get("status") or {}).get("addresses") or []:
        if address.get("value"):
            return str(address["value"])
    return None


def http_url(host: str, port: int = 80) -> str:
    """The URL the operator reports for an HTTP listener (`status.endpoint`): IPv6 in brackets,
    port 80 left out."""
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}" if port == 80 else f"http://{host}:{port}"


def printed_column(table: str, column: str) -> list[str]:
    """One column of kubectl's table output, per row ("" where it is empty): kubectl aligns
    the columns, so a value sits under its header."""
    header, *rows = table.rstrip("\n").splitlines()
    start = header.index(column)
    rest = header[start + len(column) :]
    end = start + len(column) + (len(rest) - len(rest.lstrip())) if rest.strip() else None
    return [row[start:end].strip() for row in rows]


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
    return json.loads(run(argv).stdout)


def apply_objects(s: Settings, objects: list[dict[str, Any]]) -> None:
    text = yaml.safe_dump_all(objects, sort_keys=False)
    run(kubectl(s, "apply", "--server-side", "--force-conflicts", "-f", "-"), input=text)


def cluster_exists(s: Settings) -> bool:
    return s.cluster in run(kind_clusters()).stdout.split()


def start_cloud_provider(s: Settings) -> None:
    """cloud-provider-kind beside the cluster, unless it runs already (a stopped one is
    started again)."""
    state = run(cloud_provider_state(s)).stdout.strip()
    if state == "running":
        return
    if state:
        run(docker("start", s.cloud_provider))
    else:
        run(cloud_provider_start(s), timeout=600)


def up(s: Settings) -> None:
    """Create (or reuse) the cluster and install everything the suite needs. Idempotent."""
    if not cluster_exists(s):
        run(kind_create(s, MANIFESTS / "kind-cluster.yaml"), timeout=600)
    start_cloud_provider(s)
    run(docker_build(s), timeout=1800)
    run(kind_load(s), timeout=600)
    run(kubectl_apply(s, s.versions.gateway_api_url))
    run(kubectl_apply(s, s.versions.inference_extension_url))
    for profile in s.profiles():
        for argv in gateway_installs(s, profile):
            run(argv)
    run(kubectl_apply(s, CRD_DIR))
    # The suite reads pods' /metrics through the API server's pod proxy, which connects from a
    # node, not from a Prometheus namespace: the graphs' NetworkPolicies (kindnet enforces them)
    # let the metrics ports take any source here.
    values = {**image_values(s.image), "networkPolicy.metricsFrom[0].ipBlock.cidr": "0.0.0.0/0"}
    # The EPP takes the ext_proc connection from the proxies of every gateway tested.
    nets = {"networkPolicy.gatewayFrom": gateway_from(s)}
    run(
        helm_install(
            s, OPERATOR_RELEASE, CHART, OPERATOR_NAMESPACE, values=values, json_values=nets
        )
    )
    apply_objects(s, gateway_objects(s))
    for profile in s.profiles():
        run(
            kubectl(
                s, "wait", "--for=condition=Programmed", f"gateway/{profile.gateway}",
                "-n", s.namespace, "--timeout=300s",
            )
        )  # fmt: skip


def down(s: Settings) -> None:
    run(kind_delete(s), check=False)
    run(cloud_provider_remove(s), check=False)


def gateway_service(s: Settings, profile: GatewayProfile = KGATEWAY) -> tuple[str, str]:
    """(namespace, name) of the Service the gateway controller created for the profile's
    Gateway: found by the controller's labels (kgateway: GEP-1762's; Envoy Gateway: its
    owning-gateway labels, in its own namespace), else the Service named like the Gateway
    (kgateway's naming)."""
    namespace = profile.service_namespace or s.namespace
    selector = profile.service_selector(s.namespace)
    services = [
        svc["metadata"]["name"]
        for svc in items(run_json(get_json(s, "services", namespace, "-l", selector)))
    ]
    if not services:
        services = [
            svc["metadata"]["name"]
            for svc in items(run_json(get_json(s, "services", namespace)))
            if svc["metadata"]["name"] == profile.gateway
        ]
    if not services:
        raise CommandFailed(
            f"no Service for Gateway {profile.gateway} in {namespace} (neither labelled "
            f"{selector} nor named so): is {profile.name} running?"
        )
    return namespace, services[0]


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
        print("cloud-provider-kind:", run(cloud_provider_state(s)).stdout.strip() or "absent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
