"""Unit tests of the kind suite's helpers: versions, command lines, manifests, skip logic."""

from dataclasses import replace
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
    # Envoy Gateway 1.7 with AI Gateway 0.6 (AI Gateway's 0.6 docs), cloud-provider-kind 0.7
    assert (v.envoy_gateway, v.envoy_ai_gateway, v.cloud_provider_kind) == (
        "v1.7.0",
        "v0.6.0",
        "v0.7.0",
    )
    assert v.cloud_provider_kind_image == (
        "registry.k8s.io/cloud-provider-kind/cloud-controller-manager:v0.7.0"
    )
    assert v.ai_gateway_file("manifests/envoy-gateway-values.yaml") == (
        "https://raw.githubusercontent.com/envoyproxy/ai-gateway/v0.6.0/"
        "manifests/envoy-gateway-values.yaml"
    )
    env = {"E2E_KGATEWAY_VERSION": "v2.2.0", "E2E_GAIE_VERSION": ""}
    assert Versions.from_env(env) == Versions(kgateway="v2.2.0")
    env = {"E2E_ENVOY_GATEWAY_VERSION": "v1.8.1", "E2E_AI_GATEWAY_VERSION": "v1.1.0"}
    assert Versions.from_env(env) == Versions(envoy_gateway="v1.8.1", envoy_ai_gateway="v1.1.0")
    s = Settings.from_env({"E2E_KIND_CLUSTER": "x", "E2E_KEEP_CLUSTER": "1"})
    assert (s.cluster, s.keep, s.context) == ("x", True, "kind-x")
    assert s.gateways == ("kgateway", "envoy-gateway") and s.cloud_provider == "x-cloud-provider"
    assert Settings.from_env({"E2E_GATEWAYS": "envoy-gateway"}).gateways == ("envoy-gateway",)
    with pytest.raises(ValueError, match="choose from kgateway, envoy-gateway"):
        Settings.from_env({"E2E_GATEWAYS": "istio"})


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
    assert kindctl.gateway_installs(S, kindctl.KGATEWAY) == [crds, gateway]


def test_envoy_gateway_installs_as_ai_gateways_guide_says():
    eg, ai_crds, ai = kindctl.gateway_installs(S, kindctl.ENVOY_GATEWAY)
    assert eg[3:6] == ["upgrade", "--install", "eg"]
    assert eg[6] == "oci://docker.io/envoyproxy/gateway-helm"
    assert eg[eg.index("--namespace") + 1] == "envoy-gateway-system"
    assert eg[eg.index("--version") + 1] == "v1.7.0"
    files = [eg[i + 1] for i, arg in enumerate(eg) if arg == "-f"]
    base = "https://raw.githubusercontent.com/envoyproxy/ai-gateway/v0.6.0/"
    assert files == [  # the base values, then the InferencePool add-on (order matters to helm)
        base + "manifests/envoy-gateway-values.yaml",
        base + "examples/inference-pool/envoy-gateway-values-addon.yaml",
    ]
    assert ai_crds[5:7] == ["aieg-crd", "oci://docker.io/envoyproxy/ai-gateway-crds-helm"]
    assert ai[5:7] == ["aieg", "oci://docker.io/envoyproxy/ai-gateway-helm"]
    for argv in (ai_crds, ai):
        assert argv[argv.index("--namespace") + 1] == "envoy-ai-gateway-system"
        assert argv[argv.index("--version") + 1] == "v0.6.0"


def test_cloud_provider_kind_commands():
    assert kindctl.cloud_provider_start(S) == [
        "docker", "run", "-d", "--name", "c1-cloud-provider", "--network", "kind",
        "-v", "/var/run/docker.sock:/var/run/docker.sock",
        "registry.k8s.io/cloud-provider-kind/cloud-controller-manager:v0.7.0",
    ]  # fmt: skip
    state = kindctl.cloud_provider_state(S)
    assert state[:3] == ["docker", "ps", "-a"] and "name=^/c1-cloud-provider$" in state
    assert kindctl.cloud_provider_remove(S) == ["docker", "rm", "-f", "c1-cloud-provider"]


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


def test_gateway_objects_per_selected_gateway():
    """What `up` applies: the namespace, kgateway's Gateway (its chart makes the class), Envoy
    Gateway's GatewayClass and Gateway; each Gateway fits Gateway API's own CRD."""
    from tests.operator.emulator import upstream_crd
    from tests.operator.schemas import validate_against_crd

    objects = kindctl.gateway_objects(S)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("Namespace", "ns1"),
        ("Gateway", "inference-gateway"),
        ("GatewayClass", "envoy-gateway"),
        ("Gateway", "envoy-inference-gateway"),
    ]
    _, kgateway, eg_class, eg = objects
    assert kgateway["spec"]["gatewayClassName"] == "kgateway"
    assert eg["spec"]["gatewayClassName"] == eg_class["metadata"]["name"] == "envoy-gateway"
    assert eg_class["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    for gateway in (kgateway, eg):
        assert gateway["metadata"]["namespace"] == "ns1"
        assert gateway["spec"]["listeners"] == [{"name": "http", "protocol": "HTTP", "port": 80}]
        validate_against_crd(gateway, upstream_crd("Gateway"))
    only = kindctl.gateway_objects(replace(S, gateways=("kgateway",)))
    assert [o["kind"] for o in only] == ["Namespace", "Gateway"]


def test_the_endpoint_the_tests_expect():
    gateway = {"status": {"addresses": [{"type": "IPAddress", "value": "172.18.0.9"}]}}
    assert kindctl.gateway_address(gateway) == "172.18.0.9"
    assert kindctl.gateway_address({"status": {}}) is None and kindctl.gateway_address({}) is None
    # as the operator writes status.endpoint (operator/status.py)
    from dynamograph.operator.status import EndpointObservation, endpoint_verdict

    listener = {"name": "http", "protocol": "HTTP", "port": 80}
    for address in ("172.18.0.9", "fc00:f853:ccd:e793::5"):
        live = {"spec": {"listeners": [listener]}, "status": {"addresses": [{"value": address}]}}
        parent = {"name": "gw"}
        obs = EndpointObservation("ns1", "http://x", parent=parent, gateway=live)
        assert endpoint_verdict(obs)[0] == kindctl.http_url(address)
    assert kindctl.http_url("slow.e2e.example") == "http://slow.e2e.example"
    assert kindctl.http_url("10.0.0.1", 8080) == "http://10.0.0.1:8080"
    table = (
        "NAME     STATE   READY   REPLICAS   BACKEND   ENDPOINT             AGE\n"
        "agg-kg   ready   3       3          mock      http://172.18.0.9    5m\n"
        "other    ready   3       3          mock                           1m\n"
    )
    assert kindctl.printed_column(table, "ENDPOINT") == ["http://172.18.0.9", ""]
    assert kindctl.printed_column(table, "AGE") == ["5m", "1m"]


def test_probe_pod_command():
    argv = kindctl.probe(S, "probe-1", "http://172.18.0.9", "qwen", "slow.e2e.example")
    assert argv[:6] == ["kubectl", "--context", "kind-c1", "run", "probe-1", "-n"]
    assert "--rm" in argv and "--restart=Never" in argv and "--image-pull-policy=Never" in argv
    assert "--image=dynamograph:e2e" in argv
    assert argv[argv.index("--") + 1 :] == [
        "python", "-c", kindctl.PROBE, "http://172.18.0.9", "qwen", "slow.e2e.example",
    ]  # fmt: skip
    assert kindctl.probe(S, "p", "http://a", "qwen")[-2:] == ["http://a", "qwen"]
    compile(kindctl.PROBE, "probe", "exec")
    assert kindctl.probe_result('pod default/p created\n{"status": 200, "body": "x"}\n') == {
        "status": 200,
        "body": "x",
    }
    with pytest.raises(kindctl.CommandFailed, match="no result"):
        kindctl.probe_result("error: pod failed\n")


@pytest.mark.integration
def test_the_probe_script_sends_a_chat_completion(tmp_path):
    """The probe's Python, run here against a loopback server: what it sends (path, Host,
    body) and what it prints, for an answer and for an error status."""
    import http.server
    import json
    import subprocess
    import sys
    import threading

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            seen.append((self.path, self.headers["host"], body))
            status = 200 if body["model"] == "qwen" else 503
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:

        def probe(*args):
            done = subprocess.run(
                [sys.executable, "-c", kindctl.PROBE, *args],
                capture_output=True,
                text=True,
                timeout=60,
            )
            return kindctl.probe_result(done.stdout)

        assert probe(url, "qwen", "slow.e2e.example") == {"status": 200, "body": '{"ok": true}'}
        assert probe(url + "/", "other")["status"] == 503
    finally:
        server.shutdown()
    (path, host, body), (_, plain_host, _) = seen
    assert path == "/v1/chat/completions" and host == "slow.e2e.example"
    assert plain_host == url.removeprefix("http://")
    assert body["messages"] == [{"role": "user", "content": "ping"}]
    assert body["nvext"] == {"extra_fields": ["worker_id"]}


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
    assert kindctl.gateway_service(S) == ("ns1", "gw-proxy")
    answers["labelled"] = services()
    assert kindctl.gateway_service(S) == ("ns1", "inference-gateway")
    answers["all"] = services("other")
    with pytest.raises(kindctl.CommandFailed, match="no Service for Gateway inference-gateway"):
        kindctl.gateway_service(S)


def test_envoy_gateways_service_is_found_by_its_owning_gateway_labels(monkeypatch):
    """Envoy Gateway puts the proxies' Service in its own namespace, labelled with the owning
    Gateway's name and namespace."""
    calls = []

    def fake(argv):
        calls.append(argv)
        return {"kind": "List", "items": [{"metadata": {"name": "envoy-ns1-envoy-inference-x"}}]}

    monkeypatch.setattr(kindctl, "run_json", fake)
    found = kindctl.gateway_service(S, kindctl.ENVOY_GATEWAY)
    assert found == ("envoy-gateway-system", "envoy-ns1-envoy-inference-x")
    (argv,) = calls
    selector = argv[argv.index("-l") + 1]
    assert selector == (
        "gateway.envoyproxy.io/owning-gateway-name=envoy-inference-gateway,"
        "gateway.envoyproxy.io/owning-gateway-namespace=ns1"
    )
    assert argv[-2:] == ["-n", "envoy-gateway-system"]
    assert kindctl.KGATEWAY.service_selector("ns1") == (
        "gateway.networking.k8s.io/gateway-name=inference-gateway"
    )


def fake_runner(calls, answers=None):
    def fake_run(argv, *, input=None, timeout=900, check=True):
        calls.append((list(argv), input))

        class Done:
            stdout = (answers or {}).get(" ".join(argv[:3]), "")

        return Done()

    return fake_run


def test_up_runs_every_step_in_order(monkeypatch):
    calls = []
    monkeypatch.setattr(kindctl, "run", fake_runner(calls, {"kind get clusters": "other\n"}))
    kindctl.up(S)
    argvs = [argv for argv, _ in calls]
    heads = [" ".join(a[:3]) if a[0] != "kubectl" else " ".join(a[3:5]) for a in argvs]
    assert heads == [
        "kind get clusters",
        "kind create cluster",
        "docker ps -a",  # cloud-provider-kind: there?
        "docker run -d",  # ... no: started
        "docker build -t",
        "kind load docker-image",
        "apply --server-side",  # Gateway API
        "apply --server-side",  # Inference Extension
        "helm --kube-context kind-c1",  # kgateway CRDs
        "helm --kube-context kind-c1",  # kgateway
        "helm --kube-context kind-c1",  # Envoy Gateway
        "helm --kube-context kind-c1",  # AI Gateway CRDs
        "helm --kube-context kind-c1",  # AI Gateway
        "apply --server-side",  # our CRD
        "helm --kube-context kind-c1",  # the chart
        "apply --server-side",  # namespace, GatewayClass, Gateways
        "wait --for=condition=Programmed",
        "wait --for=condition=Programmed",
    ]
    assert S.versions.gateway_api_url in argvs[6] and S.versions.inference_extension_url in argvs[7]
    assert "kgateway-crds" in " ".join(argvs[8]) and "gateway-helm" in " ".join(argvs[10])
    assert "ai-gateway-helm" in " ".join(argvs[12])
    assert str(kindctl.CHART) in argvs[14] and "image.tag=e2e" in argvs[14]
    # the EPP's NetworkPolicy admits the proxies of both gateways (Envoy Gateway's run in its
    # own namespace, not the Gateway's)
    nets = argvs[14][argvs[14].index("--set-json") + 1]
    assert nets == (
        "networkPolicy.gatewayFrom=["
        '{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ns1"}}},'
        '{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":'
        '"envoy-gateway-system"}}}]'
    )
    applied = list(yaml.safe_load_all(calls[15][1]))
    assert [d["kind"] for d in applied] == ["Namespace", "Gateway", "GatewayClass", "Gateway"]
    assert argvs[16][-4] == "gateway/inference-gateway"
    assert argvs[17][-4] == "gateway/envoy-inference-gateway"
    calls.clear()

    # Reused: the cluster exists and cloud-provider-kind runs
    monkeypatch.setattr(kindctl, "cluster_exists", lambda s: True)
    monkeypatch.setattr(kindctl, "run", fake_runner(calls, {"docker ps -a": "running\n"}))
    kindctl.up(S)
    assert not any(argv[:3] == ["kind", "create", "cluster"] for argv, _ in calls)
    assert not any(argv[:2] == ["docker", "run"] for argv, _ in calls)
    calls.clear()

    # One gateway only; a stopped cloud-provider-kind is started again
    monkeypatch.setattr(kindctl, "run", fake_runner(calls, {"docker ps -a": "exited\n"}))
    kindctl.up(replace(S, gateways=("envoy-gateway",)))
    argvs = [argv for argv, _ in calls]
    assert ["docker", "start", "c1-cloud-provider"] in argvs
    assert not any("kgateway" in " ".join(a) for a in argvs)
    waits = [a for a in argvs if "wait" in a]
    assert [a[-4] for a in waits] == ["gateway/envoy-inference-gateway"]
    assert kindctl.gateway_from(replace(S, gateways=("kgateway",))) == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns1"}}}
    ]


def test_down_removes_the_cluster_and_its_load_balancer_controller(monkeypatch):
    calls = []
    monkeypatch.setattr(kindctl, "run", fake_runner(calls))
    kindctl.down(S)
    assert [argv for argv, _ in calls] == [
        ["kind", "delete", "cluster", "--name", "c1"],
        ["docker", "rm", "-f", "c1-cloud-provider"],
    ]


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
