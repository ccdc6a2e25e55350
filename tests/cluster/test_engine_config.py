"""`spec.engineConfig` against the real control plane: the CRD (installed by our chart) keeps the
engine document through the apiserver's pruning, the EPP objects the operator renders for it are
accepted, and the schema and CEL rule refuse a wrong document with their messages (the same
documents `load_graph` refuses: tests/operator/test_engine_config.py)."""

import copy
import json

import pytest
import yaml

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, discovery_name
from dynamograph.protocol.graph import GraphError, load_graph

from .conftest import WORKLOAD_IMAGE, get
from .controlplane import REPO

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
