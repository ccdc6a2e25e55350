"""Spec -> desired objects on the example graphs: contents, and validity against real schemas."""

import argparse
import copy
import hashlib

import kubernetes_validate
import pytest
import yaml

from dynamograph.frontend import cli as frontend_cli
from dynamograph.operator import crds
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import (
    ROUTER_CONFIG_CHECKSUM,
    Owner,
    desired_objects,
    merge_extra_pod_spec,
)
from dynamograph.protocol.graph import GraphError, load_graph
from dynamograph.protocol.router_config import RouterConfig

from .emulator import EXAMPLES, upstream_crd
from .schemas import validate_against_crd

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

CONFIG = OperatorConfig(image="registry.example/dynamograph:1.2.3")
OWNER_UID = "0c6b3a8e-1111-2222-3333-444455556666"
K8S_VERSION = "1.33"


def build(example: str, mutate=None, name: str | None = None):
    body = yaml.safe_load((EXAMPLES / example).read_text())
    if mutate:
        mutate(body)
    graph = load_graph(body)
    owner = Owner(name=graph.name, namespace="serving", uid=OWNER_UID)
    return graph, {
        (o["kind"], o["metadata"]["name"]): o for o in desired_objects(graph, owner, CONFIG)
    }


def with_gateway(body):
    body["spec"]["gateway"]["parentRef"] = {"name": "inference-gateway", "namespace": "gw"}


def args_of(container) -> dict[str, str | bool]:
    """`--flag value` pairs (and bare `--flag`s) of a container's args after the subcommand."""
    args = container["args"][1:]
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[args[i]] = args[i + 1]
            i += 2
        else:
            out[args[i]] = True
            i += 1
    return out


def container(obj, name):
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_disagg_objects():
    _, objs = build("disagg.yaml", with_gateway)
    assert set(objs) == {
        ("ServiceAccount", "disagg-discovery"),
        ("Role", "disagg-discovery"),
        ("RoleBinding", "disagg-discovery"),
        ("ConfigMap", "disagg-router"),
        ("Service", "disagg-epp"),
        ("Service", "disagg-frontend"),
        ("Deployment", "disagg-prefill"),
        ("Deployment", "disagg-decode"),
        ("Deployment", "disagg-epp"),
        ("NetworkPolicy", "disagg-engines"),
        ("NetworkPolicy", "disagg-epp"),
        ("PodDisruptionBudget", "disagg-epp"),
        ("PodDisruptionBudget", "disagg-prefill"),  # 2 replicas
        ("PodDisruptionBudget", "disagg-decode"),  # 2 replicas
        ("InferencePool", "disagg"),
        ("HTTPRoute", "disagg"),
        ("PodMonitor", "disagg"),
    }
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "serving"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "dynamograph.io/v1alpha1",
                "kind": "DynamoGraph",
                "name": "disagg",
                "uid": OWNER_UID,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert meta["labels"]["app.kubernetes.io/name"] == "dynamograph"
        assert meta["labels"]["app.kubernetes.io/instance"] == "disagg"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "dynamograph-operator"
        assert meta["labels"]["dynamograph.io/graph"] == "disagg"


def test_worker_pods_follow_the_contract():
    _, objs = build("disagg.yaml")
    decode = objs["Deployment", "disagg-decode"]
    pod = decode["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert labels["dynamograph.io/service"] == "decode"
    assert labels["dynamograph.io/component-type"] == "decode"
    assert labels["dynamograph.io/serving"] == "true"
    assert decode["spec"]["replicas"] == 2
    assert decode["spec"]["selector"]["matchLabels"].items() <= labels.items()

    engine = container(decode, "engine")
    assert engine["command"] == ["dynamograph"] and engine["args"][0] == "worker"
    assert engine["image"] == CONFIG.image
    assert args_of(engine) == {
        "--engine": "mock",
        "--model": "Qwen/Qwen3-0.6B",
        "--served-model-name": "qwen",
        "--role": "decode",
        "--host": "0.0.0.0",
        "--port": "8000",
        "--kv-events-port": "5557",
        "--kv-replay-port": "5558",
        "--block-size": "16",
        "--data-parallel-size": "1",
        "--num-gpu-blocks": "2048",
        "--max-num-seqs": "64",
    }
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
        "engine": 8000,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in engine["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"] == {"path": "/health", "port": "engine"}

    frontend = container(decode, "frontend")
    assert frontend["args"][0] == "frontend"
    assert args_of(frontend) == {
        "--host": "0.0.0.0",
        "--port": "8080",
        "--engine-url": "http://127.0.0.1:8000",
        "--mode": "direct",
        "--discovery": "kubernetes",
        "--namespace": "serving",
        "--selector": "dynamograph.io/graph=disagg",
    }
    assert frontend["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert frontend["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert {"POD_NAME", "POD_IP"} <= {e["name"] for e in frontend["env"]}
    assert "nvidia.com/gpu" not in str(frontend["resources"])

    # Prefill pods: an engine only, no sidecar, not in the pool.
    prefill = objs["Deployment", "disagg-prefill"]
    assert [c["name"] for c in prefill["spec"]["template"]["spec"]["containers"]] == ["engine"]
    assert args_of(container(prefill, "engine"))["--role"] == "prefill"
    assert "dynamograph.io/serving" not in prefill["spec"]["template"]["metadata"]["labels"]
    # A GPU rollout must not need a spare GPU.
    assert prefill["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_epp_pod_service_and_config():
    _, objs = build("disagg.yaml")
    epp = objs["Deployment", "disagg-epp"]
    main = container(epp, "epp")
    args = args_of(main)
    assert args["--grpc-port"] == "9002" and args["--health-port"] == "9003"
    assert args["--metrics-port"] == "9090"
    assert args["--discovery"] == "kubernetes" and args["--namespace"] == "serving"
    assert args["--selector"] == "dynamograph.io/graph=disagg"
    assert args["--pool-name"] == "disagg"  # its InferencePool: the objectives it watches
    assert args["--config"] == "/etc/dynamograph/router/router.yaml"
    assert args["--overlap-weight"] == "1.0" and args["--temperature"] == "0.0"
    assert args["--kv-events"] == "on"
    assert {p["name"]: p["containerPort"] for p in main["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
        "replica-sync": 9004,
    }
    assert main["readinessProbe"]["grpc"] == {"port": 9003, "service": "readiness"}
    assert main["livenessProbe"]["grpc"] == {"port": 9003, "service": "liveness"}
    pod = epp["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "disagg-discovery"
    assert pod["volumes"] == [{"name": "router-config", "configMap": {"name": "disagg-router"}}]

    config = yaml.safe_load(objs["ConfigMap", "disagg-router"]["data"]["router.yaml"])
    assert config == {
        "picker": {"type": "kv", "parameters": {"home_margin": 0.25}},
        "scorers": [
            {"type": "kv-overlap", "parameters": {}, "weight": 1.0},
            {"type": "load", "parameters": {}, "weight": 0.0025},
            {"type": "kv-overflow", "parameters": {}, "weight": 1.0},
            {"type": "queue-delay", "parameters": {}, "weight": 1.0},
            {"type": "prefill-work", "parameters": {}, "weight": 8.0},
        ],
        "temperature": 0.0,
        "use_kv_events": True,
        "enforce_disagg": False,
    }
    service = objs["Service", "disagg-epp"]
    assert service["spec"]["selector"] == {
        "dynamograph.io/graph": "disagg",
        "dynamograph.io/service": "epp",
    }
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    role = objs["Role", "disagg-discovery"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives"],
            "verbs": ["get", "list", "watch"],
        },
    ]
    binding = objs["RoleBinding", "disagg-discovery"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "disagg-discovery", "namespace": "serving"}
    ]


def test_inference_pool_and_route():
    _, objs = build("disagg.yaml", with_gateway)
    pool = objs["InferencePool", "disagg"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["spec"]["selector"]["matchLabels"] == {
        "dynamograph.io/graph": "disagg",
        "dynamograph.io/serving": "true",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8080}]
    assert pool["spec"]["endpointPickerRef"] == {
        "kind": "Service",
        "name": "disagg-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    route = objs["HTTPRoute", "disagg"]
    assert route["spec"]["parentRefs"] == [
        {
            "name": "inference-gateway",
            "namespace": "gw",
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
        }
    ]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "disagg"}
    ]
    # Streams last minutes: no gateway default (15 s on some) may cut them; only the OpenAI API.
    assert route["spec"]["rules"][0]["timeouts"] == {"request": "0s"}
    assert route["spec"]["rules"][0]["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/v1"}}
    ]
    assert "hostnames" not in route["spec"]
    # The pool selects exactly the pods carrying the frontend sidecar on its targetPort.
    for (kind, _), obj in objs.items():
        if kind != "Deployment":
            continue
        labels = obj["spec"]["template"]["metadata"]["labels"]
        selected = pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
        names = [c["name"] for c in obj["spec"]["template"]["spec"]["containers"]]
        assert selected == ("frontend" in names)


def test_route_hostnames_and_timeout_from_the_gateway_spec():
    def mutate(body):
        with_gateway(body)
        body["spec"]["gateway"].update(hostnames=["llm.example.com"], requestTimeout="20m")

    _, objs = build("disagg.yaml", mutate)
    route = objs["HTTPRoute", "disagg"]["spec"]
    assert route["hostnames"] == ["llm.example.com"]
    assert route["rules"][0]["timeouts"] == {"request": "20m"}
    with pytest.raises(GraphError, match="requestTimeout"):
        build("disagg.yaml", lambda b: b["spec"]["gateway"].update(requestTimeout="soon"))


def test_no_route_without_parent_ref():
    _, objs = build("agg.yaml")
    assert ("HTTPRoute", "agg") not in objs
    assert objs["InferencePool", "agg"]["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"
    worker = objs["Deployment", "agg-worker"]
    assert worker["spec"]["replicas"] == 4
    assert args_of(container(worker, "engine"))["--role"] == "aggregated"
    assert args_of(container(worker, "engine"))["--speedup"] == "1.0"


def all_examples():
    for example in ("agg.yaml", "disagg.yaml"):
        for mutate in (None, with_gateway):
            _, objs = build(example, mutate)
            yield from objs.values()


def test_builtin_objects_validate_strictly():
    checked = 0
    for obj in all_examples():
        if obj["kind"] in ("InferencePool", "HTTPRoute", "PodMonitor"):
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 30


def test_custom_objects_validate_against_upstream_crds():
    kinds = set()
    for obj in all_examples():
        if obj["kind"] in ("InferencePool", "HTTPRoute"):
            validate_against_crd(obj, upstream_crd(obj["kind"]))
            kinds.add(obj["kind"])
    assert kinds == {"InferencePool", "HTTPRoute"}


def test_service_features_render_and_validate():
    def mutate(body):
        worker = body["spec"]["services"]["worker"]
        worker["dataParallelSize"] = 2
        worker["resources"] = {"gpu": 2, "cpu": 8, "memory": "64Gi"}
        worker["envs"] = [
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            {"name": "LOG", "value": "debug"},
        ]
        worker["image"] = "registry.example/custom:9"
        worker["extraPodSpec"] = {
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "containers": [
                {"name": "engine", "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}
            ],
        }
        body["spec"]["backend"] = "vllm"
        body["spec"]["model"]["tokenizer"] = "qwen"

    _, objs = build("agg.yaml", mutate)
    worker = objs["Deployment", "agg-worker"]
    pod = worker["spec"]["template"]["spec"]
    engine = container(worker, "engine")
    assert engine["image"] == "registry.example/custom:9"
    assert args_of(engine)["--engine"] == "vllm"
    assert args_of(engine)["--data-parallel-size"] == "2"
    # Two ranks: events on 5557-5558, replay on 5559-5560 (no port bound twice).
    assert args_of(engine)["--kv-replay-port"] == "5559"
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
        "engine": 8000,
        "kv-events": 5557,
        "kv-events-1": 5558,
        "kv-replay": 5559,
        "kv-replay-1": 5560,
    }
    assert args_of(engine)["--tokenizer"] == "qwen"
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi"},
        "limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    # extraPodSpec's items come after ours (a vllm engine's /dev/shm)
    assert engine["volumeMounts"] == [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/cache"},
    ]
    assert engine["startupProbe"]["failureThreshold"] > 100  # vLLM loads for minutes
    assert {e["name"] for e in engine["env"]} >= {"POD_NAME", "POD_IP", "HF_TOKEN", "LOG"}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    assert pod["volumes"] == [
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
        {"name": "cache", "emptyDir": {}},
    ]
    assert [c["name"] for c in pod["containers"]] == ["engine", "frontend"]
    kubernetes_validate.validate(worker, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("router", "policy", "events"),
    [
        ({"mode": "kv"}, "kv", True),
        ({"mode": "approx", "config": {"approx_ttl_s": 30}}, "kv", False),
        ({"mode": "least-loaded", "kvEvents": False, "busyThreshold": 0.9}, "least-loaded", False),
        ({"mode": "round-robin", "config": {"session_ttl_s": 60, "seed": 7}}, "round-robin", True),
    ],
)
def test_router_config_is_what_the_epp_loads(router, policy, events):
    """Contract test: the ConfigMap's router.yaml loads as the EPP's own RouterConfig."""

    def mutate(body):
        body["spec"]["services"]["epp"]["router"] = router

    _, objs = build("disagg.yaml", mutate)
    data = yaml.safe_load(objs["ConfigMap", "disagg-router"]["data"]["router.yaml"])
    loaded = RouterConfig.model_validate(data)
    assert (loaded.picker.type, loaded.use_kv_events) == (policy, events)
    for key, value in router.get("config", {}).items():
        assert getattr(loaded, key) == value
    epp = container(objs["Deployment", "disagg-epp"], "epp")
    assert args_of(epp)["--kv-events"] == ("on" if events else "off")


def test_a_changed_router_config_rolls_the_epp_and_nothing_else():
    """The EPP reads router.yaml once, at start: the pod template carries the document's
    SHA-256, so a changed `router.config` rolls the EPP's pods."""

    def mutate(body):
        body["spec"]["services"]["epp"]["router"]["config"] = {"session_ttl_s": 60}

    _, before = build("disagg.yaml")
    _, after = build("disagg.yaml", mutate)
    changed = {key for key in before if before[key] != after[key]}
    assert changed == {("ConfigMap", "disagg-router"), ("Deployment", "disagg-epp")}
    old, new = (objs["Deployment", "disagg-epp"]["spec"]["template"] for objs in (before, after))
    assert old["spec"] == new["spec"]  # the same command line and mounts, but:
    for objs, template in ((before, old), (after, new)):
        document = objs["ConfigMap", "disagg-router"]["data"]["router.yaml"]
        digest = hashlib.sha256(document.encode()).hexdigest()
        assert template["metadata"]["annotations"][ROUTER_CONFIG_CHECKSUM] == digest
    assert old["metadata"]["annotations"] != new["metadata"]["annotations"]


def test_enforce_disagg_reaches_epp_and_sidecars():
    def mutate(body):
        body["spec"]["services"]["epp"]["router"]["enforceDisagg"] = True

    _, objs = build("disagg.yaml", mutate)
    assert args_of(container(objs["Deployment", "disagg-epp"], "epp"))["--enforce-disagg"] is True
    sidecar = container(objs["Deployment", "disagg-decode"], "frontend")
    assert args_of(sidecar)["--enforce-disagg"] is True


def test_standalone_frontend_service():
    def mutate(body):
        body["spec"]["services"]["frontend"] = {
            "componentType": "frontend",
            "replicas": 2,
            "router": {"mode": "round-robin"},
        }

    _, objs = build("agg.yaml", mutate)
    frontend = objs["Deployment", "agg-frontend"]
    main = container(frontend, "frontend")
    assert "--engine-url" not in args_of(main)
    assert args_of(main)["--mode"] == "round-robin"
    assert objs["Service", "agg-frontend"]["spec"]["selector"] == {
        "dynamograph.io/graph": "agg",
        "dynamograph.io/component-type": "frontend",
    }
    kubernetes_validate.validate(frontend, K8S_VERSION, strict=True)


def test_a_kv_standalone_frontend_routes_by_its_own_router_section(tmp_path):
    """Its `router` section (not the EPP's) becomes its router config file, mounted from a
    ConfigMap of its own, with KV events on or off as the section says; a changed section
    rolls its pods. A round-robin frontend gets no config."""

    def mutate(router):
        def apply(body):
            body["spec"]["services"]["front"] = {"componentType": "frontend", "router": router}
            body["spec"]["services"]["epp"]["router"]["overlapWeight"] = 5.0

        return apply

    router = {"mode": "kv", "overlapWeight": 2.0, "busyThreshold": 0.9, "kvEvents": False}
    _, objs = build("agg.yaml", mutate(router))
    deployment = objs["Deployment", "agg-front"]
    args = args_of(container(deployment, "frontend"))
    assert args["--mode"] == "kv" and args["--kv-events"] == "off"
    assert args["--router-config"] == "/etc/dynamograph/router/router.yaml"
    document = objs["ConfigMap", "agg-front-router"]["data"]["router.yaml"]
    loaded = RouterConfig.model_validate(yaml.safe_load(document))
    assert loaded.busy_threshold == 0.9 and not loaded.use_kv_events
    assert [s.weight for s in loaded.scorers] != [
        s.weight
        for s in RouterConfig.model_validate(
            yaml.safe_load(objs["ConfigMap", "agg-router"]["data"]["router.yaml"])
        ).scorers
    ]  # its own overlap weight (2), not the EPP's (5)
    pod = deployment["spec"]["template"]
    assert {"name": "router-config", "configMap": {"name": "agg-front-router"}} in pod["spec"][
        "volumes"
    ]
    mounts = container(deployment, "frontend")["volumeMounts"]
    assert {"name": "router-config", "mountPath": "/etc/dynamograph/router", "readOnly": True} in (
        mounts
    )
    digest = hashlib.sha256(document.encode()).hexdigest()
    assert pod["metadata"]["annotations"][ROUTER_CONFIG_CHECKSUM] == digest
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)

    # the frontend's own CLI reads that command line and that file as the operator meant them
    parser = argparse.ArgumentParser()
    frontend_cli.add_arguments(parser)
    parsed = parser.parse_args(container(deployment, "frontend")["args"][1:])
    file = tmp_path / "router.yaml"
    file.write_text(document)
    parsed.router_config = str(file)
    read = frontend_cli.config_from_args(parsed)
    assert read.router is not None and read.router.busy_threshold == 0.9 and not read.kv_events
    # its pods share their bookings: each other pod of the service is a replica-sync peer
    assert read.replicas.pod_selector == "dynamograph.io/graph=agg,dynamograph.io/service=front"
    assert read.replicas.bind == "tcp://0.0.0.0:9005" and read.replicas.namespace == "serving"
    ports = container(deployment, "frontend")["ports"]
    assert {"name": "replica-sync", "containerPort": 9005, "protocol": "TCP"} in ports

    _, changed = build("agg.yaml", mutate({**router, "busyThreshold": 0.8}))
    template = changed["Deployment", "agg-front"]["spec"]["template"]
    assert template["metadata"]["annotations"][ROUTER_CONFIG_CHECKSUM] != digest

    _, objs = build("agg.yaml", mutate({"mode": "round-robin"}))
    assert ("ConfigMap", "agg-front-router") not in objs
    args = args_of(container(objs["Deployment", "agg-front"], "frontend"))
    assert args["--mode"] == "round-robin" and "--router-config" not in args
    assert "--replica-selector" not in args  # no bookings to share


def test_unknown_pod_spec_field_names_the_field():
    def mutate(body):
        body["spec"]["services"]["worker"]["extraPodSpec"] = {"nodeSelectr": {}, "tolerations": {}}

    with pytest.raises(GraphError) as info:
        build("agg.yaml", mutate)
    paths = [path for path, _ in info.value.errors]
    assert paths == ["spec.services.worker.extraPodSpec.nodeSelectr"]
    assert "not a PodSpec field" in str(info.value)


@pytest.mark.parametrize(
    ("extra", "path"),
    [
        ({"tolerations": {"key": "x"}}, "x.tolerations"),
        ({"containers": [{"image": "nameless"}]}, "x.containers[0]"),
        ({"nodeSelector": ["a"]}, "x.nodeSelector"),
        ({"containers": [{"name": "frontend", "args": ["x"]}]}, "x.containers[0].image"),
        ({"initContainers": [{"name": "engine"}]}, "x.initContainers[0].image"),
    ],
)
def test_malformed_extra_pod_spec(extra, path):
    base = {"containers": [{"name": "engine"}], "nodeSelector": {"a": "b"}}
    with pytest.raises(GraphError) as info:
        merge_extra_pod_spec(copy.deepcopy(base), extra, "x")
    assert info.value.field == path


def test_crd_itself_validates():
    kubernetes_validate.validate(crds.build_crd(), K8S_VERSION, strict=True)
