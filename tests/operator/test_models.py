"""The DynamoGraph models: the examples load, and bad graphs fail naming the field."""

import copy
from pathlib import Path

import pytest

from dynamograph.protocol.graph import (
    ComponentType,
    GraphError,
    load_graph,
)

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_examples_load():
    agg = load_graph(EXAMPLES / "agg.yaml")
    assert agg.name == "agg"
    assert agg.spec.services["worker"].component_type == ComponentType.WORKER
    assert agg.spec.services["worker"].replicas == 4
    assert agg.spec.served_model_name == "qwen"
    disagg = load_graph(str(EXAMPLES / "disagg.yaml"))
    kinds = {n: s.component_type for n, s in disagg.spec.services.items()}
    assert kinds == {"prefill": "prefill", "decode": "decode", "epp": "epp"}
    assert disagg.spec.services["prefill"].replicas == 2


def test_defaults_are_plain_values():
    graph = load_graph(EXAMPLES / "agg.yaml")
    dumped = graph.spec.model_dump(by_alias=True, exclude_none=True)
    assert dumped["backend"] == "mock" and type(dumped["backend"]) is str
    assert dumped["services"]["epp"]["dataParallelSize"] == 1


@pytest.fixture
def agg_dict():
    import yaml

    return yaml.safe_load((EXAMPLES / "agg.yaml").read_text())


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (
            lambda g: g["spec"]["services"]["worker"].update(replicas=-1),
            "spec.services.worker.replicas",
            "greater than or equal to 0",
        ),
        (lambda g: g["spec"].update(backend="sglang"), "spec.backend", "mock"),
        (
            lambda g: g["spec"]["services"]["epp"].update(resources={"gpu": 1}),
            "spec.services.epp.resources.gpu",
            "no GPU",
        ),
        (
            lambda g: g["spec"]["services"]["worker"].update(router={"mode": "kv"}),
            "spec.services.worker.router",
            "do not route",
        ),
        (
            lambda g: g["spec"]["services"]["worker"].update(resources={"cpu": "two"}),
            "spec.services.worker.resources.cpu",
            "pattern",
        ),
        (
            lambda g: g["spec"]["services"]["worker"].update(componentType="prefill"),
            "spec.services",
            "worker (aggregated) or decode",
        ),
        (
            lambda g: g["spec"]["services"].update(Bad_Name={"componentType": "decode"}),
            "spec.services",
            "DNS label",
        ),
        (
            lambda g: g["spec"]["services"]["worker"].update(replicsa=2),
            "spec.services.worker.replicsa",
            "not permitted",
        ),
        (
            lambda g: (
                g["spec"]["gateway"].update(parentRef={"name": "gw"})
                or g["spec"]["services"].pop("epp")
            ),
            "spec.gateway.parentRef",
            "needs an epp",
        ),
        (
            lambda g: (
                g["metadata"].update(name="x" * 30)
                or g["spec"]["services"].update({"y" * 40: {"componentType": "decode"}})
            ),
            "spec.services." + "y" * 40,
            "longer than 63",
        ),
    ],
)
def test_invalid_graph_names_the_field(agg_dict, mutate, field, words):
    graph = copy.deepcopy(agg_dict)
    mutate(graph)
    with pytest.raises(GraphError) as info:
        load_graph(graph)
    paths = [path for path, _ in info.value.errors]
    assert field in paths, info.value
    assert words in str(info.value)


def test_cpu_number_becomes_quantity(agg_dict):
    agg_dict["spec"]["services"]["worker"]["resources"] = {"gpu": 1, "cpu": 2, "memory": "8Gi"}
    graph = load_graph(agg_dict)
    assert graph.spec.services["worker"].resources.cpu == "2"


def test_error_field_is_the_wire_path(agg_dict):
    agg_dict["spec"]["kvBlockSize"] = 0
    with pytest.raises(GraphError) as info:
        load_graph(agg_dict)
    assert info.value.field == "spec.kvBlockSize"


def test_unreadable_and_multi_document_files(tmp_path):
    with pytest.raises(GraphError, match="cannot read"):
        load_graph(tmp_path / "missing.yaml")
    two = tmp_path / "two.yaml"
    two.write_text("a: 1\n---\nb: 2\n")
    with pytest.raises(GraphError, match="one YAML document"):
        load_graph(two)
