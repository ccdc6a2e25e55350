"""The CRDs' CEL rules, evaluated: ours agree with the models; generated objects pass upstream's."""

import copy

import pytest
import yaml

from dynamograph.operator import crds
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects
from dynamograph.protocol.graph import GraphError, load_graph

from .emulator import EXAMPLES, upstream_crd

pytestmark = pytest.mark.unit

cel = pytest.importorskip("tests.operator.cel", reason="cel-python is not installed")


def spec_schema(crd: dict, version: str) -> dict:
    entry = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    return entry["schema"]["openAPIV3Schema"]


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


@pytest.mark.parametrize("name", ["agg.yaml", "disagg.yaml", "vllm-tp.yaml"])
def test_examples_pass_every_rule(name):
    outcome = cel.evaluate(spec_schema(crds.build_crd(), "v1alpha1"), example(name))
    assert outcome.failures == []
    assert outcome.evaluated >= 4 + 5 * 2  # graph rules, plus service rules per service


def _services(body):
    return body["spec"]["services"]


@pytest.mark.parametrize(
    ("mutate", "message", "field"),
    [
        (
            lambda b: _services(b).pop("worker"),
            "needs a worker (aggregated) or decode",
            "spec.services",
        ),
        (
            lambda b: _services(b).update(epp2={"componentType": "epp"}),
            "at most one epp",
            "spec.services",
        ),
        (
            lambda b: _services(b).update(p={"componentType": "prefill"}),
            "prefill service needs a decode",
            "spec.services",
        ),
        (
            lambda b: (
                b["spec"]["gateway"].update(parentRef={"name": "gw"}) or _services(b).pop("epp")
            ),
            "gateway.parentRef",
            "spec.gateway.parentRef",
        ),
        (
            lambda b: _services(b)["epp"].update(engine={"numGpuBlocks": 8}),
            "engine:",
            "spec.services.epp.engine",
        ),
        (
            lambda b: _services(b)["worker"].update(router={"mode": "kv"}),
            "router:",
            "spec.services.worker.router",
        ),
        (
            lambda b: _services(b)["epp"].update(resources={"gpu": 1}),
            "resources.gpu:",
            "spec.services.epp.resources.gpu",
        ),
        (
            lambda b: _services(b)["epp"].update(dataParallelSize=2),
            "dataParallelSize:",
            "spec.services.epp.dataParallelSize",
        ),
        (
            lambda b: _services(b).update(
                f={"componentType": "frontend", "router": {"mode": "random"}}
            ),
            "router.mode:",
            "spec.services.f.router.mode",
        ),
        (
            lambda b: _services(b).update(
                f={
                    "componentType": "frontend",
                    "router": {"mode": "round-robin", "maxLoopLagSeconds": 1},
                }
            ),
            "a round-robin frontend picks without a queue",
            "spec.services.f.router.maxLoopLagSeconds",
        ),
    ],
)
def test_rules_and_models_refuse_the_same_graphs(mutate, message, field):
    body = example("agg.yaml")
    mutate(body)
    outcome = cel.evaluate(spec_schema(crds.build_crd(), "v1alpha1"), body)
    assert [m for _, m in outcome.failures if message in m], outcome.failures
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(body))
    assert field in [path for path, _ in info.value.errors], info.value


def _vllm_worker(b):
    return b["spec"]["services"]["worker"]


@pytest.mark.parametrize(
    ("mutate", "message", "field"),
    [
        (
            lambda b: _vllm_worker(b)["engine"]["extraArgs"].append("--max_model_len=8192"),
            "extraArgs:",
            "spec.services.worker.engine.extraArgs",
        ),
        (
            lambda b: _vllm_worker(b)["resources"].update(gpu=8),
            "vllm engine pod uses",
            "spec.services.worker.resources.gpu",
        ),
        (lambda b: b["spec"].update(backend="mock"), "vllm settings", "spec.services.worker"),
        (
            lambda b: b["spec"]["model"]["cache"].update(hostPath="/mnt/hf"),
            "exactly one of claimName and hostPath",
            "spec.model.cache.claimName",
        ),
        (
            lambda b: _vllm_worker(b).update(nodeSelector={"nvidia.com/gpu.product": "x"}),
            "gpuType:",
            "spec.services.worker.gpuType",
        ),
        (
            lambda b: b["spec"]["services"]["epp"].update(startupTimeoutSeconds=60),
            "only worker, prefill and decode",
            "spec.services.epp.startupTimeoutSeconds",
        ),
        (
            lambda b: b["spec"]["services"]["epp"].update(tensorParallelSize=2),
            "tensorParallelSize:",
            "spec.services.epp.tensorParallelSize",
        ),
        (
            lambda b: _vllm_worker(b)["tolerations"].append({"operator": "Equal"}),
            "needs operator Exists",
            "spec.services.worker.tolerations[1].key",
        ),
        (lambda b: b["spec"].update(scaleTarget="nope"), "scaleTarget:", "spec.scaleTarget"),
        (lambda b: b["spec"]["model"].pop("tokenizer"), "tokenizer", "spec.model.tokenizer"),
        (
            lambda b: b["spec"]["services"].update(more={"componentType": "worker"}),
            "replicas:",
            "spec.replicas",
        ),
    ],
)
def test_vllm_rules_and_models_refuse_the_same_graphs(mutate, message, field):
    body = example("vllm-tp.yaml")
    mutate(body)
    outcome = cel.evaluate(spec_schema(crds.build_crd(), "v1alpha1"), body)
    assert [m for _, m in outcome.failures if message in m], outcome.failures
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(body))
    assert field in [path for path, _ in info.value.errors], info.value


def test_generated_pools_and_routes_pass_upstream_rules():
    body = example("disagg.yaml")
    body["spec"]["gateway"]["parentRef"] = {"name": "inference-gateway"}
    objects = desired_objects(
        load_graph(body), Owner("disagg", "ns", "uid"), OperatorConfig(image="i")
    )
    checked = 0
    for obj in objects:
        if obj["kind"] not in ("InferencePool", "HTTPRoute"):
            continue
        schema = spec_schema(upstream_crd(obj["kind"]), obj["apiVersion"].rsplit("/", 1)[1])
        outcome = cel.evaluate(
            schema, {k: v for k, v in obj.items() if k != "metadata"}, strict=False
        )
        assert outcome.failures == [], obj["kind"]
        assert outcome.evaluated > 0
        checked += 1
    assert checked == 2


def test_a_broken_pool_fails_upstream_rules():
    """The evaluator is not vacuous: upstream's own rule catches a pool without an EPP port."""
    body = example("agg.yaml")
    objects = desired_objects(
        load_graph(body), Owner("agg", "ns", "uid"), OperatorConfig(image="i")
    )
    pool = next(o for o in objects if o["kind"] == "InferencePool")
    del pool["spec"]["endpointPickerRef"]["port"]
    outcome = cel.evaluate(spec_schema(upstream_crd("InferencePool"), "v1"), pool, strict=False)
    assert any("port is required" in m for _, m in outcome.failures)
