"""The generated CRD: up to date, structural, and agreeing with the models on examples."""

import copy
import json

import jsonschema
import pytest
import yaml

from dynamograph.operator import crds
from dynamograph.protocol.graph import load_graph

from .emulator import EXAMPLES, REPO
from .schemas import crd_schema, validate_against_crd

pytestmark = pytest.mark.unit

COMMITTED = [REPO / d / crds.CRD_FILE for d in crds.DEFAULT_OUTPUT_DIRS]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: str(p.relative_to(REPO)))
def test_committed_crd_is_current(path):
    assert path.exists(), f"{path} missing: run `dynamograph crds`"
    assert path.read_text() == crds.render_crd(), f"{path} is stale: run `dynamograph crds`"


def test_check_flag_reports_stale_files(tmp_path, capsys):
    args = type("Args", (), {"output_dir": [tmp_path], "check": True})()
    assert crds.run(args) == 1
    assert "stale" in capsys.readouterr().out
    args.check = False
    assert crds.run(args) == 0
    args.check = True
    assert crds.run(args) == 0


def _walk(node, path="openAPIV3Schema"):
    yield path, node
    for key in ("properties",):
        for name, child in node.get(key, {}).items():
            yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    """The apiserver's structural-schema rules, as far as they concern what we generate."""
    crd = crds.build_crd()
    text = json.dumps(crd)
    assert "$ref" not in text and "$defs" not in text and '"const"' not in text
    (version,) = crd["spec"]["versions"]
    for path, node in _walk(version["schema"]["openAPIV3Schema"]):
        int_or_string = node.get("x-kubernetes-int-or-string")
        preserve = node.get("x-kubernetes-preserve-unknown-fields")
        assert node.get("type") or int_or_string or preserve, f"{path} has no type"
        if "anyOf" in node:
            assert int_or_string and node["anyOf"] == [{"type": "integer"}, {"type": "string"}], (
                path
            )
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") not in (True, False), path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound) in (None, True), f"{path}.{bound} must be boolean"
        assert "title" not in node, path
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.scale.replicas",
            "labelSelectorPath": ".status.scale.selector",
        },
    }
    # the /scale paths name fields the schema has
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"replicas", "selector"} <= set(status["scale"]["properties"])
    assert "replicas" in version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert crd["spec"]["names"]["shortNames"] == ["dg"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["State"] == ".status.state"
    assert columns["Ready"] == ".status.readyReplicas"


@pytest.mark.parametrize("example", ["agg.yaml", "disagg.yaml", "vllm-tp.yaml"])
def test_examples_fit_the_crd(example):
    validate_against_crd(yaml.safe_load((EXAMPLES / example).read_text()), crds.build_crd())


def test_status_written_by_the_operator_fits_the_crd():
    from dynamograph.operator.status import ServiceObservation, graph_status, status_body

    status = graph_status(
        {"decode": ServiceObservation(2, None)},
        [],
        generation=3,
        previous=None,
        endpoint="http://g-frontend.ns.svc:8080",
        now="2026-01-01T00:00:00Z",
    )
    graph = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    graph["status"] = status_body(status)
    validate_against_crd(graph, crds.build_crd())


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "backend"), "sglang"),
        (("spec", "kvBlockSize"), 0),
        (("spec", "services", "worker", "replicas"), -1),
        (("spec", "services", "worker", "componentType"), "router"),
        (("spec", "services", "worker", "resources", "cpu"), "two"),
        (("spec", "services", "worker", "engine", "speedup"), 0),
        (("spec", "services", "epp", "router", "mode"), "magic"),
        (("spec", "gateway", "failureMode"), "FailSometimes"),
        (("spec", "services", "worker", "replicsa"), 2),
    ],
)
def test_schema_and_models_refuse_the_same_values(path, value):
    """What the CRD refuses, `load_graph` refuses too (one source of truth)."""
    graph = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    node = graph
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    schema = crd_schema(crds.build_crd(), "v1alpha1")
    body = {k: v for k, v in graph.items() if k != "metadata"}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft4Validator(schema).validate(body)
    with pytest.raises(ValueError) as info:
        load_graph(copy.deepcopy(graph))
    assert ".".join(path) in str(info.value)


def test_cel_rules_mirror_the_cross_field_validators():
    """Each cross-field validator has a CEL rule the apiserver enforces before the operator."""
    (version,) = crds.build_crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rules = [r["message"] for r in spec["x-kubernetes-validations"]]
    service_rules = [
        r["message"]
        for r in spec["properties"]["services"]["additionalProperties"]["x-kubernetes-validations"]
    ]
    assert any("worker (aggregated) or decode" in m for m in rules)
    assert any("at most one epp" in m for m in rules)
    assert any("prefill service needs a decode" in m for m in rules)
    assert any("gateway.parentRef" in m for m in rules)
    for field in ("engine", "router", "resources.gpu", "dataParallelSize", "router.mode"):
        assert any(m.startswith(f"{field}:") for m in service_rules), field
