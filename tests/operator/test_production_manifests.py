"""What a graph renders for a production cluster, object by object, without a cluster: the
NetworkPolicies, the EPP's draining rollout and default resources, the PodDisruptionBudgets, the
PodMonitor and the admin-token wiring (tests/cluster/test_production_manifests.py has the real
apiserver accept them)."""

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dynamograph.epp.cli import add_arguments
from dynamograph.operator import controller
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.kube import ApiError
from dynamograph.operator.manifests import (
    EPP_RESOURCES,
    Owner,
    admin_token_secret_object,
    desired_objects,
)
from dynamograph.protocol.graph import GraphError, load_graph
from dynamograph.protocol.launch import ADMIN_TOKEN_ENV

from .schemas import validate_against_crd

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

PODMONITOR_CRD = (
    Path(__file__).parent / "data/prometheus-operator/monitoring.coreos.com_podmonitors.yaml"
)
CONFIG = OperatorConfig(image="img")
OWNER = Owner(name="g", namespace="serving", uid="uid-1")
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def graph_body(**services) -> dict:
    return {
        "apiVersion": "dynamograph.io/v1alpha1",
        "kind": "DynamoGraph",
        "metadata": {"name": "g"},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B"},
            "services": services
            or {
                "decode": {"componentType": "decode", "replicas": 2, "dataParallelSize": 2},
                "prefill": {"componentType": "prefill"},
                "epp": {"componentType": "epp"},
                "frontend": {"componentType": "frontend"},
            },
        },
    }


def render(body: dict | None = None, config: OperatorConfig = CONFIG) -> dict:
    graph = load_graph(body or graph_body())
    return {(o["kind"], o["metadata"]["name"]): o for o in desired_objects(graph, OWNER, config)}


def containers(deployment: dict) -> dict[str, dict]:
    return {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}


def pod_labels(deployment: dict) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector's verdict on `labels` (matchLabels and In expressions)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def allows(policy: dict, source_labels: dict[str, str] | None, port: int) -> bool:
    """Does the NetworkPolicy let a pod of the graph's namespace with `source_labels` (None: a
    pod of another namespace that no rule names) reach `port` on a selected pod?"""
    for rule in policy["spec"]["ingress"]:
        ports = rule.get("ports")
        if ports is not None and not any(
            p["port"] <= port <= p.get("endPort", p["port"]) for p in ports
        ):
            continue
        peers = rule.get("from")
        if peers is None:
            return True
        for peer in peers:
            same_namespace = "podSelector" in peer and "namespaceSelector" not in peer
            if same_namespace and source_labels and selects(peer["podSelector"], source_labels):
                return True
    return False


# ---- NetworkPolicy ---------------------------------------------------------------------


def test_only_the_graphs_epp_and_frontends_reach_every_engine_port():
    objs = render()
    policy = objs["NetworkPolicy", "g-engines"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    epp = pod_labels(objs["Deployment", "g-epp"])
    frontend = pod_labels(objs["Deployment", "g-frontend"])
    decode = pod_labels(objs["Deployment", "g-decode"])
    prefill = pod_labels(objs["Deployment", "g-prefill"])
    other_graph = {**epp, "dynamograph.io/graph": "other"}
    stranger = {"app": "curious"}
    for name in ("g-decode", "g-prefill"):
        deployment = objs["Deployment", name]
        assert selects(policy["spec"]["podSelector"], pod_labels(deployment)), name
        engine = containers(deployment)["engine"]
        # every port the engine declares: HTTP, and KV events and replay of every DP rank
        ports = [p["containerPort"] for p in engine["ports"]]
        assert len(ports) == (5 if name == "g-decode" else 3)
        for port in ports:
            assert allows(policy, epp, port) and allows(policy, frontend, port), (name, port)
            assert not allows(policy, other_graph, port), (name, port)
            assert not allows(policy, stranger, port), (name, port)
            assert not allows(policy, None, port), (name, port)
    # the hand-off: engines of the graph reach each other on any port (vLLM's NIXL ports)
    assert allows(policy, decode, 5600) and allows(policy, prefill, 8000)
    assert not allows(policy, epp, 5600)
    assert not selects(policy["spec"]["podSelector"], epp)
    assert not selects(policy["spec"]["podSelector"], frontend)


def test_the_serving_port_stays_open_and_prometheus_scrapes_the_engine_port():
    policy = render()["NetworkPolicy", "g-engines"]
    assert allows(policy, {"app": "client"}, 8080) and allows(policy, None, 8080)
    metrics_rules = [r for r in policy["spec"]["ingress"] if r.get("from") == [MONITORING]]
    assert metrics_rules == [{"from": [MONITORING], "ports": [{"protocol": "TCP", "port": 8000}]}]


def test_the_epp_takes_grpc_from_the_gateways_namespace_and_metrics_from_prometheus():
    body = graph_body()
    body["spec"]["gateway"] = {"parentRef": {"name": "gw", "namespace": "gateways"}}
    policy = render(body)["NetworkPolicy", "g-epp"]
    gateway = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}
    assert policy["spec"]["podSelector"]["matchLabels"]["dynamograph.io/component-type"] == "epp"
    rules = policy["spec"]["ingress"]
    assert {
        "from": [gateway],
        "ports": [{"protocol": "TCP", "port": 9002}, {"protocol": "TCP", "port": 9003}],
    } in rules
    assert {"from": [MONITORING], "ports": [{"protocol": "TCP", "port": 9090}]} in rules
    # nothing else opens the gateway's or the metrics port
    for port in (9002, 9003, 9090):
        assert len([r for r in rules if any(p["port"] == port for p in r.get("ports", []))]) == 1
        assert all("ports" in r for r in rules)
    # a parentRef without a namespace: the graph's own
    body["spec"]["gateway"] = {"parentRef": {"name": "gw"}}
    rule = render(body)["NetworkPolicy", "g-epp"]["spec"]["ingress"][0]
    assert rule["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "serving"
    }


def test_gateway_and_metrics_peers_come_from_the_operator_config():
    proxies = {
        "namespaceSelector": {
            "matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}
        },
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "envoy"}},
    }
    config = dataclasses.replace(CONFIG, gateway_from=(proxies,), metrics_from=())
    objs = render(config=config)
    epp_rules = objs["NetworkPolicy", "g-epp"]["spec"]["ingress"]
    assert [r["from"] for r in epp_rules if r["ports"][0]["port"] in (9002, 9090)] == [
        [proxies]
    ]  # and no metrics rule
    assert all(
        r.get("from") != [MONITORING] for r in objs["NetworkPolicy", "g-engines"]["spec"]["ingress"]
    )
    # No parentRef and no configured peers: the gateway is not known here, anyone may connect.
    assert render()["NetworkPolicy", "g-epp"]["spec"]["ingress"][0].keys() == {"ports"}


def test_network_policies_can_be_turned_off():
    objs = render(config=dataclasses.replace(CONFIG, network_policy=False))
    assert not [k for k in objs if k[0] == "NetworkPolicy"]
    assert not [
        k
        for k in render(graph_body(w={"componentType": "worker"}))
        if k == ("NetworkPolicy", "g-epp")
    ]


# ---- EPP rollout, resources, disruption budgets --------------------------------------------


def epp_args(deployment: dict) -> list[str]:
    return containers(deployment)["epp"]["args"]


def test_the_epp_rolls_out_surge_first_and_drains_its_streams():
    epp = render()["Deployment", "g-epp"]
    assert epp["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = epp["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 130
    main = containers(epp)["epp"]
    assert main["lifecycle"] == {"preStop": {"sleep": {"seconds": 10}}}
    args = epp_args(epp)
    # preStop sleep + drain + 5 s to stop fit in the grace period
    assert args[args.index("--drain-grace") + 1] == "115"


def test_the_epp_takes_its_drain_grace_from_the_rendered_command_line():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(epp_args(render()["Deployment", "g-epp"])[1:])
    assert args.drain_grace == 115.0


@pytest.mark.parametrize(("grace", "sleep", "drain"), [(600, 10, 585), (20, 5, 10), (2, 0, 0)])
def test_the_grace_period_of_extra_pod_spec_sets_sleep_and_drain(grace, sleep, drain):
    body = graph_body(
        w={"componentType": "worker"},
        epp={"componentType": "epp", "extraPodSpec": {"terminationGracePeriodSeconds": grace}},
    )
    epp = render(body)["Deployment", "g-epp"]
    assert epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    args = epp_args(epp)
    assert args[args.index("--drain-grace") + 1] == str(drain)
    lifecycle = containers(epp)["epp"].get("lifecycle")
    assert lifecycle == ({"preStop": {"sleep": {"seconds": sleep}}} if sleep else None)


def test_a_grace_period_that_is_no_number_names_the_field():
    body = graph_body(
        w={"componentType": "worker"},
        epp={"componentType": "epp", "extraPodSpec": {"terminationGracePeriodSeconds": "2m"}},
    )
    with pytest.raises(GraphError) as err:
        render(body)
    assert err.value.field == "spec.services.epp.extraPodSpec.terminationGracePeriodSeconds"


def test_containers_without_gpus_get_default_resources_the_spec_overrides():
    objs = render()
    assert containers(objs["Deployment", "g-epp"])["epp"]["resources"] == EPP_RESOURCES
    sidecar = containers(objs["Deployment", "g-decode"])["frontend"]["resources"]
    frontend = containers(objs["Deployment", "g-frontend"])["frontend"]["resources"]
    for res in (sidecar, frontend):
        assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
        assert "cpu" not in res["limits"]  # no CFS throttling on the request path
    # engines get only what the spec says: their needs depend on the model
    assert containers(objs["Deployment", "g-decode"])["engine"].get("resources", {}) == {}
    body = graph_body(
        w={"componentType": "worker"},
        epp={"componentType": "epp", "resources": {"cpu": "2", "memory": "4Gi"}},
    )
    given = {"cpu": "2", "memory": "4Gi"}
    assert containers(render(body)["Deployment", "g-epp"])["epp"]["resources"] == {
        "requests": given,
        "limits": given,
    }


def test_disruption_budgets_for_the_epp_and_services_of_several_replicas():
    objs = render()
    budgets = {k[1]: o for k, o in objs.items() if k[0] == "PodDisruptionBudget"}
    assert set(budgets) == {"g-epp", "g-decode"}  # prefill and frontend run one replica
    for name, budget in budgets.items():
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        deployment = objs["Deployment", name]
        assert budget["spec"]["selector"] == deployment["spec"]["selector"]


# ---- PodMonitor ------------------------------------------------------------------------


def test_one_pod_monitor_scrapes_every_pod_of_the_graph():
    config = dataclasses.replace(CONFIG, pod_monitor_labels={"release": "kube-prometheus-stack"})
    objs = render(config=config)
    monitor = objs["PodMonitor", "g"]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"]["dynamograph.io/graph"] == "g"
    validate_against_crd(monitor, yaml.safe_load(PODMONITOR_CRD.read_text()))
    scraped = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    deployments = [o for k, o in objs.items() if k[0] == "Deployment"]
    assert len(deployments) == 4
    for deployment in deployments:
        assert selects(monitor["spec"]["selector"], pod_labels(deployment))
        ports = {p["name"] for c in containers(deployment).values() for p in c["ports"]}
        assert ports & scraped, deployment["metadata"]["name"]
    assert {e["path"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"/metrics"}
    assert not [
        k
        for k in render(config=dataclasses.replace(CONFIG, pod_monitor=False))
        if k[0] == "PodMonitor"
    ]


def test_a_missing_monitoring_crd_is_no_problem():
    desired = [{"kind": "Deployment"}, {"kind": "PodMonitor"}]
    assert controller.missing_crd_problems(desired, {"PodMonitor"}) == []


def test_built_in_objects_validate_strictly():
    body = graph_body()
    body["spec"]["gateway"] = {"parentRef": {"name": "gw", "namespace": "gateways"}}
    objs = render(body)
    kinds = set()
    for obj in [*objs.values(), admin_token_secret_object(load_graph(body), OWNER, "t")]:
        if obj["kind"] in ("NetworkPolicy", "PodDisruptionBudget", "Deployment", "Secret"):
            kubernetes_validate.validate(obj, "1.33", strict=True)
            kinds.add(obj["kind"])
    assert kinds == {"NetworkPolicy", "PodDisruptionBudget", "Deployment", "Secret"}


# ---- admin token -------------------------------------------------------------------------


def test_every_engine_reads_the_admin_token_from_the_graphs_secret_and_nothing_else_does():
    objs = render()
    ref = {"secretKeyRef": {"name": "g-admin-token", "key": "token"}}
    for (kind, name), obj in objs.items():
        if kind != "Deployment":
            continue
        for container in containers(obj).values():
            env = {e["name"]: e for e in container.get("env", [])}
            if container["name"] == "engine":
                assert env[ADMIN_TOKEN_ENV] == {"name": ADMIN_TOKEN_ENV, "valueFrom": ref}, name
            else:
                assert ADMIN_TOKEN_ENV not in env, (name, container["name"])
            assert not any("admin-token" in arg for arg in container["args"])


def test_the_admin_token_secret_belongs_to_the_graph():
    graph = load_graph(graph_body())
    secret = admin_token_secret_object(graph, OWNER, "s3cret")
    assert secret["metadata"]["name"] == "g-admin-token"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["stringData"] == {"token": "s3cret"}
    # the desired objects (and so the last-applied annotations and the plan) never hold it
    assert "s3cret" not in json.dumps(list(render().values()))


class Api:
    """Records creates; answers each with the next status (201, or an ApiError's)."""

    def __init__(self, *statuses: int):
        self.statuses = list(statuses)
        self.created: list[dict] = []

    async def create(self, obj: dict) -> dict:
        self.created.append(obj)
        status = self.statuses.pop(0)
        if status >= 400:
            raise ApiError(status, "X", "refused")
        return obj


def test_the_operator_creates_a_random_token_once_and_lets_an_existing_one_be(caplog):
    graph = load_graph(graph_body())
    controller._admin_tokens_ensured.clear()
    api = Api(201, 409)
    with caplog.at_level("DEBUG"):
        assert asyncio.run(controller._ensure_admin_token(api, graph, OWNER)) == []
        # the next passes write nothing (the resync timer runs every few seconds)
        assert asyncio.run(controller._ensure_admin_token(api, graph, OWNER)) == []
        assert len(api.created) == 1
        # a restarted operator tries once; the Secret exists (409): kept, fine
        controller._admin_tokens_ensured.clear()
        assert asyncio.run(controller._ensure_admin_token(api, graph, OWNER)) == []
    first, second = (c["stringData"]["token"] for c in api.created)
    assert len(first) >= 40 and first != second  # random, 32 bytes
    assert first not in caplog.text and second not in caplog.text
    controller._admin_tokens_ensured.clear()
    problems = asyncio.run(controller._ensure_admin_token(Api(403), graph, OWNER))
    assert [p.reason for p in problems] == ["ApplyFailed"]
    assert "Secret g-admin-token" in problems[0].message
    # a refused create is tried again on the next pass
    assert asyncio.run(controller._ensure_admin_token(Api(201), graph, OWNER)) == []


# ---- configuration ---------------------------------------------------------------------


def test_config_from_the_charts_environment():
    peer = {"namespaceSelector": {"matchLabels": {"team": "gw"}}}
    config = OperatorConfig.from_env(
        {
            "DYNAMOGRAPH_IMAGE": "img",
            "DYNAMOGRAPH_NETWORK_POLICY": "false",
            "DYNAMOGRAPH_GATEWAY_FROM": json.dumps([peer]),
            "DYNAMOGRAPH_METRICS_FROM": "[]",
            "DYNAMOGRAPH_POD_MONITOR_LABELS": '{"release": "prom"}',
        }
    )
    assert config.network_policy is False and config.pod_monitor is True
    assert config.gateway_from == (peer,) and config.metrics_from == ()
    assert config.pod_monitor_labels == {"release": "prom"}
    defaults = OperatorConfig.from_env({"DYNAMOGRAPH_IMAGE": "img"})
    assert defaults.network_policy and defaults.metrics_from == (MONITORING,)
    assert defaults.gateway_from == ()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DYNAMOGRAPH_NETWORK_POLICY", "yes", "must be true or false"),
        ("DYNAMOGRAPH_GATEWAY_FROM", "{", "not valid JSON"),
        ("DYNAMOGRAPH_METRICS_FROM", '{"a": 1}', "must be a JSON list"),
        ("DYNAMOGRAPH_METRICS_FROM", "[1]", "NetworkPolicyPeer mappings"),
        ("DYNAMOGRAPH_POD_MONITOR_LABELS", "[]", "must be a JSON mapping"),
    ],
)
def test_bad_config_is_refused_saying_why(name, value, message):
    with pytest.raises(ValueError, match=message):
        OperatorConfig.from_env({"DYNAMOGRAPH_IMAGE": "img", name: value})
