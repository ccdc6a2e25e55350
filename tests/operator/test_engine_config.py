"""`spec.engineConfig`: the engine document of workers that serve no `/v1/engine`, given by the
operator to the graph's routers, the EPP and the standalone frontends. What it renders
(ConfigMap, mount, flag, checksum annotation, selector), that nothing of it is rendered without
the field, that the rendered file is what the EPP and a frontend load, and that a wrong document
is refused by the models and by the CRD (schema and CEL) alike."""

import argparse
import copy
import hashlib

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dynamograph.epp.cli import add_arguments
from dynamograph.frontend import cli as frontend_cli
from dynamograph.operator import crds
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import (
    ENGINE_CONFIG_CHECKSUM,
    LABEL_COMPONENT,
    LABEL_GRAPH,
    Owner,
    desired_objects,
)
from dynamograph.operator.reconcile import Create, Delete, Patch, plan, with_last_applied
from dynamograph.protocol.engine import EngineTemplate, KvEventsEndpoint
from dynamograph.protocol.graph import GraphError, load_graph
from dynamograph.protocol.identity import instance_id
from dynamograph.protocol.launch import ENGINE_CONFIG_DIR, ENGINE_CONFIG_FILE
from dynamograph.router.discovery import (
    KubernetesSource,
    pod_target,
    selector_matches,
    source_from_args,
)

from .emulator import EXAMPLES
from .schemas import crd_schema

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

CONFIG = OperatorConfig(image="registry.example/dynamograph:1.2.3")
OWNER = Owner(name="agg", namespace="serving", uid="0c6b3a8e-1111-2222-3333-444455556666")
MOUNTED = f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}"
# llm-d-inference-sim's layout: its publisher dials the EPP's bound SUB; topic kv@<pod IP>@model
SIM = {
    "total_kv_blocks": 4096,
    "engine": "llm-d-inference-sim",
    "kv_events": {"endpoint": "tcp://*:5557", "bind": True, "topic": "kv@{host}@Qwen/Qwen3-0.6B"},
}

cel = pytest.importorskip("tests.operator.cel", reason="cel-python is not installed")


# A standalone frontend that routes without KV events: llm-d's layout (the engines dial the EPP)
# leaves a frontend none, and the operator refuses one that would wait for them.
WITHOUT_EVENTS = {"mode": "kv", "kvEvents": False}


def body(engine_config=None, frontend_router=None) -> dict:
    graph = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    graph["spec"]["services"]["frontend"] = {
        "componentType": "frontend",
        "router": frontend_router or WITHOUT_EVENTS,
    }
    if engine_config is not None:
        graph["spec"]["engineConfig"] = copy.deepcopy(engine_config)
    return graph


def render(graph_body: dict) -> dict:
    graph = load_graph(graph_body)
    return {(o["kind"], o["metadata"]["name"]): o for o in desired_objects(graph, OWNER, CONFIG)}


def epp_pod(objects: dict) -> dict:
    return objects["Deployment", "agg-epp"]["spec"]["template"]


def epp_container(objects: dict) -> dict:
    (container,) = epp_pod(objects)["spec"]["containers"]
    return container


def parsed_epp_args(objects: dict) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(epp_container(objects)["args"][1:])


def test_the_document_reaches_the_epp_as_a_mounted_file_named_on_its_command_line():
    objects = render(body(SIM))
    config_map = objects["ConfigMap", "agg-engine-config"]
    router_map = objects["ConfigMap", "agg-router"]
    # owned and labelled like the EPP's other ConfigMap
    assert config_map["metadata"]["labels"] == router_map["metadata"]["labels"]
    assert config_map["metadata"]["ownerReferences"] == router_map["metadata"]["ownerReferences"]
    assert config_map["metadata"]["namespace"] == "serving"
    assert list(config_map["data"]) == [ENGINE_CONFIG_FILE]

    args = parsed_epp_args(objects)
    assert args.engine_config == MOUNTED
    container = epp_container(objects)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == ENGINE_CONFIG_DIR)
    assert mount["readOnly"] is True
    volume = next(v for v in epp_pod(objects)["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume == {"name": mount["name"], "configMap": {"name": "agg-engine-config"}}
    digest = hashlib.sha256(config_map["data"][ENGINE_CONFIG_FILE].encode()).hexdigest()
    assert epp_pod(objects)["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM] == digest
    # the routers get it (the frontend: tests below); engines describe themselves
    for (kind, name), obj in objects.items():
        if kind == "Deployment" and name not in ("agg-epp", "agg-frontend"):
            pod = obj["spec"]["template"]
            assert ENGINE_CONFIG_CHECKSUM not in pod["metadata"]["annotations"], name
            assert "agg-engine-config" not in yaml.safe_dump(pod), name
    for obj in objects.values():
        if obj["kind"] not in ("InferencePool", "HTTPRoute", "PodMonitor"):
            kubernetes_validate.validate(obj, "1.33", strict=True)


def test_the_rendered_file_is_the_document_the_epp_loads(tmp_path):
    objects = render(body(SIM))
    path = tmp_path / ENGINE_CONFIG_FILE
    path.write_text(objects["ConfigMap", "agg-engine-config"]["data"][ENGINE_CONFIG_FILE])
    template = EngineTemplate.load(path)
    config = template.config_for("http://10.1.2.3:8080", "sim-7d9f-abcde")
    # the graph's model, served name, block size and tokenizer, then the document's own fields
    assert (config.model, config.served_model_name) == ("Qwen/Qwen3-0.6B", "qwen")
    assert config.kv_cache_block_size == 16
    assert (config.total_kv_blocks, config.engine) == (4096, "llm-d-inference-sim")
    assert config.kv_events == KvEventsEndpoint(
        endpoint="tcp://*:5557", bind=True, topic="kv@10.1.2.3@Qwen/Qwen3-0.6B"
    )
    assert (config.name, config.instance_id) == ("sim-7d9f-abcde", instance_id("sim-7d9f-abcde"))

    # the EPP's own flags turn it into a pod source that also asks pods with only `http`
    args = parsed_epp_args(objects)
    args.engine_config = str(path)
    source = source_from_args(args)
    assert isinstance(source, KubernetesSource) and source.fallback == template


def test_what_the_document_says_wins_over_the_graph(tmp_path):
    objects = render(body({"model": "other", "kv_cache_block_size": 32, "tokenizer": "qwen"}))
    path = tmp_path / ENGINE_CONFIG_FILE
    path.write_text(objects["ConfigMap", "agg-engine-config"]["data"][ENGINE_CONFIG_FILE])
    config = EngineTemplate.load(path).config_for("http://10.0.0.1:8080", "p")
    assert (config.model, config.kv_cache_block_size, config.tokenizer) == ("other", 32, "qwen")


def test_the_epp_discovers_foreign_engines_but_not_the_graphs_frontends():
    """With the document the EPP takes a pod with only an `http` port for an engine; its
    selector leaves out the graph's standalone frontends, which serve `http` too."""
    selector = parsed_epp_args(render(body(SIM))).selector
    graph = {LABEL_GRAPH: "agg"}
    assert not selector_matches(selector, {**graph, LABEL_COMPONENT: "frontend"})
    assert selector_matches(selector, {**graph, LABEL_COMPONENT: "worker"})
    assert selector_matches(selector, graph)  # an engine pod of the user's, labelled into it
    assert not selector_matches(selector, {LABEL_GRAPH: "other"})
    pod = {
        "metadata": {"name": "sim-0", "namespace": "serving", "labels": graph},
        "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8080}]}]},
        "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    target = pod_target(pod, foreign=True)
    assert target is not None and target.engine_url == "http://10.1.2.3:8080"


def test_without_the_field_nothing_is_rendered_for_it():
    objects = render(body())
    assert ("ConfigMap", "agg-engine-config") not in objects
    args = parsed_epp_args(objects)
    assert args.engine_config is None
    assert args.selector == f"{LABEL_GRAPH}=agg"
    text = yaml.safe_dump(objects["Deployment", "agg-epp"])
    assert ENGINE_CONFIG_DIR not in text and ENGINE_CONFIG_CHECKSUM not in text


def test_a_changed_document_changes_only_the_routers_templates_and_its_config_map():
    before, after = render(body(SIM)), render(body({**SIM, "total_kv_blocks": 8192}))
    changed = {key for key in before if before[key] != after[key]}
    routers = {("Deployment", "agg-epp"), ("Deployment", "agg-frontend")}
    assert changed == {("ConfigMap", "agg-engine-config"), *routers}
    for key in routers:
        old, new = (objects[key]["spec"]["template"] for objects in (before, after))
        assert old["spec"] == new["spec"]  # the same command line and mounts...
        # ...but a new checksum: the Deployment rolls its pods, which read the new file at start
        assert (
            old["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM]
            != (new["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM])
        )


def frontend_pod(objects: dict) -> dict:
    return objects["Deployment", "agg-frontend"]["spec"]["template"]


def parsed_frontend_args(objects: dict) -> argparse.Namespace:
    (container,) = frontend_pod(objects)["spec"]["containers"]
    parser = argparse.ArgumentParser()
    frontend_cli.add_arguments(parser)
    return parser.parse_args(container["args"][1:])


VLLM_LAYOUT = {"total_kv_blocks": 4096, "kv_events": {"endpoint": "tcp://{host}:5557"}}


@pytest.mark.parametrize(
    ("document", "router"),
    [(SIM, WITHOUT_EVENTS), (SIM, {"mode": "round-robin"}), (VLLM_LAYOUT, {"mode": "kv"})],
    ids=["llm-d layout, kv without events", "llm-d layout, round-robin", "vLLM layout, kv"],
)
def test_a_standalone_frontend_finds_the_engines_the_document_describes(tmp_path, document, router):
    """A gateway-less graph routes by its frontend service: the frontend gets the document as
    the EPP does (the same ConfigMap, mount, flag and checksum), takes pods with only an `http`
    port for engines, and leaves out itself and the other frontends."""
    objects = render(body(document, router))
    pod = frontend_pod(objects)
    (container,) = pod["spec"]["containers"]
    assert {"name": "engine-config", "configMap": {"name": "agg-engine-config"}} in pod["spec"][
        "volumes"
    ]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == ENGINE_CONFIG_DIR)
    assert mount == {"name": "engine-config", "mountPath": ENGINE_CONFIG_DIR, "readOnly": True}
    assert (
        pod["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM]
        == epp_pod(objects)["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM]
    )
    kubernetes_validate.validate(objects["Deployment", "agg-frontend"], "1.33", strict=True)

    args = parsed_frontend_args(objects)
    assert args.engine_config == MOUNTED
    path = tmp_path / ENGINE_CONFIG_FILE
    path.write_text(objects["ConfigMap", "agg-engine-config"]["data"][ENGINE_CONFIG_FILE])
    args.engine_config = str(path)
    source = source_from_args(args)
    assert isinstance(source, KubernetesSource)
    assert source.fallback == EngineTemplate.load(path)
    graph = {LABEL_GRAPH: "agg"}
    assert not selector_matches(args.selector, {**graph, LABEL_COMPONENT: "frontend"})
    assert selector_matches(args.selector, graph)

    # the serving pods' sidecars follow the EPP's picks: they get no document
    sidecar = objects["Deployment", "agg-worker"]["spec"]["template"]
    assert "agg-engine-config" not in yaml.safe_dump(sidecar)


def spec_schema() -> dict:
    (version,) = crds.build_crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


PER_WORKER = "would be the same for every worker; leave them out"


@pytest.mark.parametrize(
    ("document", "message"),
    [({"name": "w-0"}, PER_WORKER), ({"instance_id": 7, "name": "w"}, PER_WORKER)],
)
def test_per_worker_fields_are_refused_by_the_models_and_the_cel_rule(document, message):
    graph = body(document)
    outcome = cel.evaluate(spec_schema(), graph)
    assert [m for _, m in outcome.failures if message in m], outcome.failures
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(graph))
    assert info.value.errors[0][0] == "spec.engineConfig"
    assert message in info.value.errors[0][1]


@pytest.mark.parametrize(
    ("document", "field"),
    [
        ({"kv_cache_block_size": 0}, "spec.engineConfig.kv_cache_block_size"),
        ({"role": "router"}, "spec.engineConfig.role"),
        ({"kv_events": {"topic": "t"}}, "spec.engineConfig.kv_events.endpoint"),
        (
            {"kv_events": {"endpoint": "tcp://{host}:1", "bnid": True}},
            "spec.engineConfig.kv_events.bnid",
        ),
        ({"kv_cache_blocksize": 16}, "spec.engineConfig.kv_cache_blocksize"),
    ],
)
def test_wrong_fields_are_refused_by_the_models_and_the_schema(document, field):
    graph = body(document)
    schema = crd_schema(crds.build_crd(), "v1alpha1")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(
            {k: v for k, v in graph.items() if k != "metadata"}
        )
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(graph))
    assert field in [path for path, _ in info.value.errors], info.value


def test_a_template_naming_anything_but_host_and_port_is_refused_before_the_epp_starts():
    """What only the document's use can tell: the operator's models refuse it (a Degraded
    condition naming the field), so no EPP is rolled out that would refuse its file."""
    graph = body({"kv_events": {"endpoint": "tcp://{pod_ip}:5557"}})
    with pytest.raises(GraphError) as info:
        load_graph(graph)
    ((path, message),) = info.value.errors
    assert path == "spec.engineConfig"
    assert "may name {host} and {port} only" in message and "pod_ip" in message


def test_engines_that_dial_the_epp_reach_its_bound_port_through_its_service():
    """llm-d's layout (`bind`): the EPP binds the SUB and the engines' publishers dial it, so
    the port is on the EPP's container and Service and open to the graph's pods."""
    objects = render(body(SIM))
    (port,) = [p for p in epp_container(objects)["ports"] if p["name"] == "kv-events"]
    assert port["containerPort"] == 5557
    service_ports = objects["Service", "agg-epp"]["spec"]["ports"]
    assert {"name": "kv-events", "port": 5557, "targetPort": "kv-events", "protocol": "TCP"} in (
        service_ports
    )
    rules = objects["NetworkPolicy", "agg-epp"]["spec"]["ingress"]
    (rule,) = [r for r in rules if {"protocol": "TCP", "port": 5557} in r["ports"]]
    assert rule["from"] == [{"podSelector": {"matchLabels": {LABEL_GRAPH: "agg"}}}]

    # vLLM's layout: the engines bind, the EPP connects; nothing opens on the EPP
    plain = render(body({"kv_events": {"endpoint": "tcp://{host}:5557"}}))
    assert [p["name"] for p in epp_container(plain)["ports"]] == [
        p["name"] for p in epp_container(render(body()))["ports"]
    ]
    assert plain["Service", "agg-epp"] == render(body())["Service", "agg-epp"]
    assert plain["NetworkPolicy", "agg-epp"] == render(body())["NetworkPolicy", "agg-epp"]


def bound(endpoint="tcp://*:5557"):
    return {"kv_events": {"endpoint": endpoint, "bind": True, "topic": "kv@{host}@m"}}


def epp_with(**fields):
    def mutate(graph):
        graph["spec"]["services"]["epp"].update(fields)

    return mutate


@pytest.mark.parametrize(
    ("document", "mutate", "field", "words"),
    [
        (bound("tcp://127.0.0.1:5557"), None, "spec.engineConfig.kv_events.endpoint", "tcp://*:"),
        (bound("tcp://*:9002"), None, "spec.engineConfig.kv_events.endpoint", "ext_proc gRPC"),
        (bound(), epp_with(replicas=2), "spec.services.epp.replicas", "one EPP replica"),
        (
            bound(),
            lambda g: g["spec"]["services"]["epp"]["router"].update(processes=2),
            "spec.services.epp.router.processes",
            "one EPP replica of one process",
        ),
        (
            bound(),
            lambda g: g["spec"].update(kvEvents={"curve": True}),
            "spec.kvEvents.curve",
            "CURVE",
        ),
        (
            bound(),
            lambda g: g["spec"]["services"]["frontend"].update(router={"mode": "kv"}),
            "spec.services.frontend.router.kvEvents",
            "would receive no KV event",
        ),
    ],
)
def test_a_bound_endpoint_the_epp_could_not_serve_is_refused_naming_the_field(
    document, mutate, field, words
):
    graph = body(document)
    if mutate:
        mutate(graph)
    with pytest.raises(GraphError) as info:
        render(graph)
    assert [m for p, m in info.value.errors if p == field and words in m], info.value
    # the same graph without the document is fine: it is the document that cannot be served
    del graph["spec"]["engineConfig"]
    render(graph)


def test_without_an_epp_no_port_of_the_epps_is_taken_by_a_bound_endpoint():
    """A gateway-less graph with llm-d's engine document: its frontend does not wait for KV
    events, nothing binds the endpoint, so the EPP's ports are not the document's concern."""
    graph = body(bound("tcp://*:9002"))
    del graph["spec"]["services"]["epp"]
    objects = render(graph)
    assert parsed_frontend_args(objects).kv_events == "off"


def test_the_document_needs_a_router_to_read_it():
    """An EPP or a standalone frontend: a gateway-less graph of foreign engines is routed by its
    frontend alone; a graph with neither has nobody to read the document."""
    graph = body(VLLM_LAYOUT)
    del graph["spec"]["services"]["epp"]
    assert cel.evaluate(spec_schema(), graph).failures == []
    objects = render(graph)
    assert ("ConfigMap", "agg-engine-config") in objects
    assert parsed_frontend_args(objects).engine_config == MOUNTED

    del graph["spec"]["services"]["frontend"]
    outcome = cel.evaluate(spec_schema(), graph)
    assert [m for _, m in outcome.failures if "an epp or a frontend service" in m], outcome.failures
    with pytest.raises(GraphError) as info:
        load_graph(graph)
    assert info.value.errors[0][0] == "spec.engineConfig"


def test_the_llmd_sim_example_joins_unmodified_simulators_to_the_graph():
    """examples/llmd-sim.yaml: the graph and the simulators' own Deployment agree on what the
    EPP needs of them: its pods are in the pool and found by the EPP at their `http` port, they
    dial the EPP's bound port through its Service, publish on the topic the document expects,
    and have the document's block size, capacity and model."""
    graph_doc, deployment = yaml.safe_load_all((EXAMPLES / "llmd-sim.yaml").read_text())
    graph = load_graph(graph_doc)
    owner = Owner(name=graph.name, namespace="serving", uid=OWNER.uid)
    objects = {(o["kind"], o["metadata"]["name"]): o for o in desired_objects(graph, owner, CONFIG)}
    kubernetes_validate.validate(deployment, "1.33", strict=True)
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    pool_selector = objects["InferencePool", "sim"]["spec"]["selector"]["matchLabels"]
    assert pool_selector.items() <= labels.items()
    (engine,) = pod["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in engine["args"] if "=" in a)
    # found by the EPP: a Ready pod with only an `http` port, at the pool's target port
    epp = objects["Deployment", "sim-epp"]["spec"]["template"]["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    selector = parser.parse_args(epp["args"][1:]).selector
    assert selector_matches(selector, labels)
    live = {
        "metadata": {"name": "sim-engines-0", "namespace": "serving", "labels": labels},
        "spec": pod["spec"],
        "status": {"podIP": "10.1.2.3", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    target = pod_target(live, foreign=True)
    assert target is not None and target.serving_endpoint == "10.1.2.3:8080"
    assert [p["number"] for p in objects["InferencePool", "sim"]["spec"]["targetPorts"]] == [
        int(args["port"])
    ]
    # their publishers dial the EPP Service's bound port
    service = objects["Service", "sim-epp"]
    (bound,) = [p for p in service["spec"]["ports"] if p["name"] == "kv-events"]
    assert args["zmq-endpoint"] == f"tcp://{service['metadata']['name']}:{bound['port']}"
    assert "--use-vllm-map-event-format" in engine["args"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
        engine["env"]
    )
    # the document, as the EPP reads it, describes them
    config = EngineTemplate.checked(graph.spec.engine_document()).config_for(
        target.engine_url, "sim-engines-0"
    )
    assert config.kv_events is not None
    assert config.kv_events.topic == f"kv@10.1.2.3@{args['model']}"  # the simulator's own
    assert config.kv_cache_block_size == int(args["block-size"])
    assert config.total_kv_blocks == int(args["kv-cache-size"])
    assert config.context_length == int(args["max-model-len"])
    assert config.served_model_name == args["served-model-name"] == graph.spec.served_model_name


def test_turning_the_field_on_and_off_is_a_create_and_a_delete_and_an_epp_roll():
    """What a reconcile pass does (operator/reconcile.plan, live objects as last applied): on,
    the ConfigMap is created and the EPP's template patched (a new template: a rollout); off,
    the ConfigMap is deleted and the template's annotation, mount and flag go."""

    def desired(graph_body):
        return desired_objects(load_graph(graph_body), OWNER, CONFIG)

    without, with_it = desired(body()), desired(body(SIM))
    key = ("v1", "ConfigMap", "agg-engine-config")
    epp = ("apps/v1", "Deployment", "agg-epp")

    on = plan(with_it, [with_last_applied(o) for o in without], OWNER.uid)
    assert [a.obj["metadata"]["name"] for a in on if isinstance(a, Create)] == [key[2]]
    patched = {a.key: a.patch for a in on if isinstance(a, Patch)}
    template = patched[epp]["spec"]["template"]
    assert ENGINE_CONFIG_CHECKSUM in template["metadata"]["annotations"]

    off = plan(without, [with_last_applied(o) for o in with_it], OWNER.uid)
    assert [a.key for a in off if isinstance(a, Delete)] == [key]
    template = {a.key: a.patch for a in off if isinstance(a, Patch)}[epp]["spec"]["template"]
    assert template["metadata"]["annotations"][ENGINE_CONFIG_CHECKSUM] is None
    assert MOUNTED not in str(template["spec"])
