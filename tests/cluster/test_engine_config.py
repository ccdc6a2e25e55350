"""`spec.engineConfig` against the real control plane: the CRD (installed by our chart) keeps the
engine document through the apiserver's pruning, the EPP objects the operator renders for it are
accepted, and the schema and CEL rule refuse a wrong document with their messages (the same
documents `load_graph` refuses: tests/operator/test_engine_config.py). With the operator running
(the chart's ServiceAccount token): turned on, the ConfigMap appears owned by the graph and the
EPP mounts it; a changed document rolls the EPP; turned off, the ConfigMap is deleted and the
EPP's template is as before. kwok runs no containers: that the EPP reads the file is the unit
tests' part (the rendered file loaded by EngineTemplate.load, the flag by the EPP's parser)."""

import copy
import json

import pytest
import yaml

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, discovery_name
from dynamograph.protocol.engine import EngineTemplate
from dynamograph.protocol.graph import GraphError, load_graph
from dynamograph.protocol.launch import ENGINE_CONFIG_DIR, ENGINE_CONFIG_FILE

from .conftest import WORKLOAD_IMAGE, describe, get, wait_for
from .controlplane import REPO
from .test_operator import graph_manifest
from .test_production_manifests import owned_by_graph

SIM = {
    "total_kv_blocks": 4096,
    "kv_events": {"endpoint": "tcp://*:5557", "bind": True, "topic": "kv@{host}@Qwen/Qwen3-0.6B"},
}


def graph(namespace: str, engine_config: dict) -> dict:
    body = yaml.safe_load((REPO / "examples" / "agg.yaml").read_text())
    body["metadata"] = {"name": "foreign", "namespace": namespace}
    body["spec"]["engineConfig"] = engine_config
    return body


def test_the_apiserver_keeps_the_document_and_takes_the_epp_objects(
    control_plane, chart_release, namespace
):
    cp = control_plane
    body = graph(namespace, SIM)
    res = cp.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(body), check=False
    )
    assert res.returncode == 0, res.stderr
    stored = json.loads(res.stdout)["spec"]["engineConfig"]
    assert stored["total_kv_blocks"] == 4096
    assert stored["kv_events"]["topic"] == SIM["kv_events"]["topic"] and stored["kv_events"]["bind"]

    cp.kubectl("create", "serviceaccount", discovery_name("foreign"), "-n", namespace)
    owner = Owner(namespace=namespace, name="foreign", uid="0")
    objects = desired_objects(load_graph(body), owner, OperatorConfig(image=WORKLOAD_IMAGE))
    for obj in objects:
        if obj["kind"] == "ConfigMap" or obj["metadata"]["name"] == "foreign-epp":
            res = cp.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
            )
            assert res.returncode == 0, f"{obj['kind']} {obj['metadata']['name']}: {res.stderr}"


def test_a_gateway_less_graph_gives_the_document_to_its_frontend(
    control_plane, chart_release, namespace
):
    """No epp service, a kv-mode frontend service: the CRD's rule takes the document, and the
    frontend's Deployment with its mount and the ConfigMap are accepted as rendered."""
    cp = control_plane
    body = graph(namespace, {"kv_events": {"endpoint": "tcp://{host}:5557"}})
    del body["spec"]["services"]["epp"]
    body["spec"]["services"]["front"] = {"componentType": "frontend", "router": {"mode": "kv"}}
    res = cp.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=json.dumps(body), check=False
    )
    assert res.returncode == 0, res.stderr
    cp.kubectl("create", "serviceaccount", discovery_name("foreign"), "-n", namespace)
    owner = Owner(namespace=namespace, name="foreign", uid="0")
    objects = desired_objects(load_graph(body), owner, OperatorConfig(image=WORKLOAD_IMAGE))
    names = {o["metadata"]["name"] for o in objects}
    assert {"foreign-engine-config", "foreign-front"} <= names
    for obj in objects:
        if obj["metadata"]["name"] in ("foreign-engine-config", "foreign-front"):
            res = cp.kubectl(
                "create", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False
            )
            assert res.returncode == 0, f"{obj['kind']} {obj['metadata']['name']}: {res.stderr}"


INVALID = [
    (
        "a per-worker name",
        {"name": "sim-0"},
        "name, instance_id would be the same for every worker; leave them out",
    ),
    (
        "a zero block size",
        {"kv_cache_block_size": 0},
        "spec.engineConfig.kv_cache_block_size: Invalid value: 0",
    ),
    (
        "an unknown role",
        {"role": "router"},
        'spec.engineConfig.role: Unsupported value: "router"',
    ),
]


@pytest.mark.parametrize(("case", "document", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_a_wrong_document_is_refused_by_the_crd(
    control_plane, chart_release, namespace, case, document, message
):
    cp = control_plane
    body = graph(namespace, document)
    with pytest.raises(GraphError):  # the models refuse it too
        load_graph(copy.deepcopy(body))
    res = cp.kubectl("apply", "-f", "-", input=json.dumps(body), check=False)
    assert res.returncode != 0, f"{case}: accepted\n{res.stdout}"
    assert message in res.stderr, res.stderr
    assert get(cp, "dg", "foreign", "-n", namespace) is None


def epp_template(cp, namespace: str) -> dict | None:
    deployment = get(cp, "deployment", "ec-epp", "-n", namespace)
    return None if deployment is None else deployment["spec"]["template"]


def mounted(template: dict | None) -> bool:
    if template is None:
        return False
    (epp,) = template["spec"]["containers"]
    return f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}" in epp["args"] and any(
        m["mountPath"] == ENGINE_CONFIG_DIR for m in epp.get("volumeMounts", [])
    )


def checksum(template: dict | None) -> str | None:
    annotations = (template or {}).get("metadata", {}).get("annotations", {})
    return annotations.get("dynamograph.io/engine-config-sha256")


def test_the_operator_gives_the_epp_the_document_rolls_it_and_takes_it_back(
    control_plane, operator, namespace, tmp_path
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    manifest = graph_manifest("ec", namespace)
    cp.kubectl_apply(manifest)
    before = wait_for("the EPP Deployment", lambda: epp_template(cp, namespace), 60, describe=show)
    assert not mounted(before) and checksum(before) is None

    def patch(engine_config):
        body = {"spec": {"engineConfig": engine_config}}
        cp.kubectl("patch", "dg", "ec", "-n", namespace, "--type=merge", "-p", json.dumps(body))

    patch(SIM)
    config_map = wait_for(
        "ConfigMap ec-engine-config",
        lambda: get(cp, "configmap", "ec-engine-config", "-n", namespace),
        60,
        describe=show,
    )
    assert owned_by_graph(config_map, get(cp, "dg", "ec", "-n", namespace)), show()
    path = tmp_path / ENGINE_CONFIG_FILE
    path.write_text(config_map["data"][ENGINE_CONFIG_FILE])
    config = EngineTemplate.load(path).config_for("http://10.1.2.3:8080", "sim-0")
    assert (config.model, config.total_kv_blocks) == ("Qwen/Qwen3-0.6B", 4096)
    first = wait_for(
        "the EPP mounting it",
        lambda: mounted(t := epp_template(cp, namespace)) and t,
        60,
        describe=show,
    )

    patch({"total_kv_blocks": 8192})  # a merge patch: the rest of the document stays
    changed = wait_for(
        "the EPP rolled for the new document",
        lambda: checksum(t := epp_template(cp, namespace)) not in (None, checksum(first)) and t,
        60,
        describe=show,
    )
    assert mounted(changed)
    data = get(cp, "configmap", "ec-engine-config", "-n", namespace)["data"][ENGINE_CONFIG_FILE]
    assert "total_kv_blocks: 8192" in data and "kv@{host}@Qwen/Qwen3-0.6B" in data

    patch(None)
    wait_for(
        "ConfigMap ec-engine-config deleted",
        lambda: get(cp, "configmap", "ec-engine-config", "-n", namespace) is None,
        60,
        describe=show,
    )
    after = wait_for(
        "the EPP without it",
        lambda: not mounted(t := epp_template(cp, namespace)) and t,
        60,
        describe=show,
    )
    assert checksum(after) is None
    assert after["spec"] == before["spec"]


def test_the_llmd_sim_example_is_accepted_in_a_restricted_namespace(
    control_plane, chart_release, namespace
):
    """examples/llmd-sim.yaml as `kubectl apply -f` sends it: the graph fits the CRD, and the
    simulators' Deployment and its pods pass Pod Security "restricted" (server-side dry runs)."""
    cp = control_plane
    graph_doc, deployment = yaml.safe_load_all((REPO / "examples" / "llmd-sim.yaml").read_text())
    for obj in (graph_doc, deployment):
        obj["metadata"]["namespace"] = namespace
        res = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(obj), check=False)
        assert res.returncode == 0, f"{obj['kind']}: {res.stderr}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "sim-engines-0", "namespace": namespace},
        "spec": deployment["spec"]["template"]["spec"],
    }
    res = cp.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)
    assert res.returncode == 0 and "violate" not in res.stderr, res.stderr
