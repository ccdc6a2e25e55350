"""Unit tests of the kind suite's helpers: versions, command lines, manifests, skip logic."""

from pathlib import Path

import pytest
import yaml

from . import conftest, kindctl
from .kindctl import Settings, Versions

pytestmark = pytest.mark.unit

S = Settings(cluster="c1", image="dynamograph:e2e", namespace="ns1")


def test_versions_are_pinned_and_overridable():
    v = Versions()
    assert v.gateway_api_url.endswith("/gateway-api/releases/download/v1.4.1/standard-install.yaml")
    assert v.inference_extension_url.endswith("/download/v1.2.1/manifests.yaml")
    assert v.kind_node_image == "kindest/node:v1.33.1" and v.kgateway == "v2.1.1"
    env = {"E2E_KGATEWAY_VERSION": "v2.2.0", "E2E_GAIE_VERSION": ""}
    assert Versions.from_env(env) == Versions(kgateway="v2.2.0")
    s = Settings.from_env({"E2E_KIND_CLUSTER": "x", "E2E_KEEP_CLUSTER": "1"})
    assert (s.cluster, s.keep, s.context) == ("x", True, "kind-x")


def test_cluster_and_image_commands():
    assert kindctl.kind_create(S, Path("/k.yaml")) == [
        "kind", "create", "cluster", "--name", "c1", "--image", "kindest/node:v1.33.1",
        "--config", "/k.yaml", "--wait", "180s",
    ]  # fmt: skip
    assert kindctl.kind_load(S) == [
        "kind",
        "load",
        "docker-image",
        "dynamograph:e2e",
        "--name",
        "c1",
    ]
    build = kindctl.docker_build(S)
    assert build[:4] == ["docker", "build", "-t", "dynamograph:e2e"]
    assert build[-1] == str(kindctl.REPO) and Path(build[-2]) == kindctl.REPO / "Dockerfile"
    assert kindctl.kind_delete(S) == ["kind", "delete", "cluster", "--name", "c1"]


def test_kubectl_commands_pin_the_context():
    assert kindctl.kubectl_apply(S, "https://x/y.yaml") == [
        "kubectl", "--context", "kind-c1", "apply", "--server-side", "--force-conflicts",
        "-f", "https://x/y.yaml",
    ]  # fmt: skip
    assert kindctl.port_forward(S, "ns1", "gw", 5000, 80)[-4:] == [
        "svc/gw", "5000:80", "--address", "127.0.0.1",
    ]  # fmt: skip
    patch = kindctl.merge_patch(S, "dynamograph", "ns1", "g", {"spec": {"x": 1}})
    assert patch[-4:] == ["--type", "merge", "-p", '{"spec": {"x": 1}}']
    assert kindctl.delete(S, "dynamograph", "ns1", "g")[-2:] == [
        "--ignore-not-found",
        "--wait=true",
    ]
    assert kindctl.get_json(S, "pods", "ns1", "-l", "a=b") == [
        "kubectl", "--context", "kind-c1", "get", "pods", "-l", "a=b", "-o", "json", "-n", "ns1",
    ]  # fmt: skip


def test_helm_installs():
    cmd = kindctl.helm_install(S, "r", "chart", "ns", version="v1", values={"a.b": True, "c": 2})
    assert cmd[:3] == ["helm", "--kube-context", "kind-c1"]
    assert cmd[3:7] == ["upgrade", "--install", "r", "chart"]
    assert cmd[cmd.index("--version") : cmd.index("--version") + 2] == ["--version", "v1"]
    assert "a.b=true" in cmd and "c=2" in cmd and "--wait" in cmd and "--create-namespace" in cmd
    crds, gateway = kindctl.kgateway_installs(S)
    assert "oci://cr.kgateway.dev/kgateway-dev/charts/kgateway-crds" in crds
    assert "inferenceExtension.enabled=true" in gateway and "v2.1.1" in gateway


def test_image_values_split_repository_and_tag():
    assert kindctl.image_values("dynamograph:e2e") == {
        "image.repository": "dynamograph", "image.tag": "e2e", "image.pullPolicy": "IfNotPresent",
    }  # fmt: skip
    assert kindctl.image_values("localhost:5000/dg")["image.repository"] == "localhost:5000/dg"
    assert kindctl.image_values("reg:5000/dg:1")["image.tag"] == "1"


def test_manifests():
    gateway = kindctl.gateway_manifest("ns1")
    assert gateway["kind"] == "Gateway" and gateway["metadata"]["namespace"] == "ns1"
    assert gateway["spec"]["gatewayClassName"] == "kgateway"
    assert gateway["metadata"]["name"] == kindctl.GATEWAY_NAME
    cluster = yaml.safe_load((kindctl.MANIFESTS / "kind-cluster.yaml").read_text())
    assert cluster["kind"] == "Cluster" and len(cluster["nodes"]) >= 2


def test_ready_pods_and_items():
    ready = {
        "metadata": {"name": "a"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    unready = {
        "metadata": {"name": "b"},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]},
    }
    going = {"metadata": {"name": "c", "deletionTimestamp": "t"}, "status": ready["status"]}
    listing = {"kind": "List", "items": [ready, unready, going]}
    assert [p["metadata"]["name"] for p in kindctl.ready_pods(listing)] == ["a"]
    assert kindctl.items({"kind": "Pod", "metadata": {}}) == [{"kind": "Pod", "metadata": {}}]


def test_missing_requirements_name_each_tool(monkeypatch):
    monkeypatch.setattr(
        kindctl, "tool_path", lambda name: None if name in ("kind", "helm") else f"/bin/{name}"
    )
    monkeypatch.setattr(
        kindctl, "docker_daemon_error", lambda: "the docker daemon is not reachable (x)"
    )
    missing = kindctl.missing_requirements()
    assert missing == [
        "kind (not on PATH or in .local/bin)",
        "helm (not on PATH or in .local/bin)",
        "the docker daemon is not reachable (x)",
    ]
    with pytest.raises(kindctl.CommandFailed, match="kind is not installed"):
        kindctl.resolve(["kind", "get", "clusters"])


def test_skip_reason_asks_for_opt_in_when_everything_is_there(monkeypatch):
    monkeypatch.setattr(kindctl, "missing_requirements", lambda: [])
    assert "make e2e-kind" in conftest.skip_reason({})
    assert conftest.skip_reason({conftest.OPT_IN: "1"}) is None
    monkeypatch.setattr(kindctl, "missing_requirements", lambda: ["kind (x)"])
    assert conftest.skip_reason({conftest.OPT_IN: "1"}).startswith("kind e2e needs: kind (x)")


def test_gateway_service_by_label_then_by_name(monkeypatch):
    def services(*names):
        return {"kind": "List", "items": [{"metadata": {"name": n}} for n in names]}

    answers = {"labelled": services("gw-proxy"), "all": services("other", "inference-gateway")}

    def fake(argv):
        return answers["labelled"] if "-l" in argv else answers["all"]

    monkeypatch.setattr(kindctl, "run_json", fake)
    assert kindctl.gateway_service(S) == "gw-proxy"
    answers["labelled"] = services()
    assert kindctl.gateway_service(S) == "inference-gateway"
    answers["all"] = services("other")
    with pytest.raises(kindctl.CommandFailed, match="no Service for Gateway inference-gateway"):
        kindctl.gateway_service(S)


def test_up_runs_every_step_in_order(monkeypatch):
    calls = []

    def fake_run(argv, *, input=None, timeout=900, check=True):
        calls.append((list(argv), input))

        class Done:
            stdout = "" if argv[:3] != ["kind", "get", "clusters"] else "other\n"

        return Done()

    monkeypatch.setattr(kindctl, "run", fake_run)
    kindctl.up(S)
    argvs = [argv for argv, _ in calls]
    heads = [" ".join(a[:3]) if a[0] != "kubectl" else " ".join(a[3:5]) for a in argvs]
    assert heads == [
        "kind get clusters",
        "kind create cluster",
        "docker build -t",
        "kind load docker-image",
        "apply --server-side",  # Gateway API
        "apply --server-side",  # Inference Extension
        "helm --kube-context kind-c1",  # kgateway CRDs
        "helm --kube-context kind-c1",  # kgateway
        "apply --server-side",  # our CRD
        "helm --kube-context kind-c1",  # the chart
        "apply --server-side",  # namespace + Gateway
        "wait --for=condition=Programmed",
    ]
    assert S.versions.gateway_api_url in argvs[4] and S.versions.inference_extension_url in argvs[5]
    assert str(kindctl.CHART) in argvs[9] and "image.tag=e2e" in argvs[9]
    applied = list(yaml.safe_load_all(calls[10][1]))
    assert [d["kind"] for d in applied] == ["Namespace", "Gateway"]
    calls.clear()

    monkeypatch.setattr(kindctl, "cluster_exists", lambda s: True)
    kindctl.up(S)
    assert not any(argv[:3] == ["kind", "create", "cluster"] for argv, _ in calls)  # reused


def test_dockerfile_installs_every_package_and_runs_dynamograph():
    import tomllib

    pyproject = tomllib.loads((kindctl.REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    text = kindctl.DOCKERFILE.read_text()
    copied = {line.split()[1].rstrip("/") for line in text.splitlines() if line.startswith("COPY ")}
    missing = {f for f in folders if not any(f == c or f.startswith(c + "/") for c in copied)}
    assert not missing, f"the image misses {sorted(missing)}"  # a subfolder comes with its parent
    assert 'ENTRYPOINT ["dynamograph"]' in text
    ignored = (kindctl.REPO / ".dockerignore").read_text().split()
    assert not folders & set(ignored), "a package folder is excluded from the build context"
