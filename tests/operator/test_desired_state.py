"""The controller's pure first step: a graph body -> the validated graph, its objects, problems."""

import pytest
import yaml

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.controller import desired_state, missing_crd_problems
from dynamograph.operator.manifests import Owner

from .emulator import EXAMPLES

pytestmark = pytest.mark.unit

OWNER = Owner(name="disagg", namespace="ns", uid="uid-1")
CONFIG = OperatorConfig(image="img")


def body() -> dict:
    return yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())


def test_a_valid_graph_gives_its_objects():
    graph, desired, problems = desired_state(body(), OWNER, CONFIG)
    assert graph is not None and problems == []
    assert {o["kind"] for o in desired} >= {"Deployment", "ConfigMap", "InferencePool"}


def test_objects_that_cannot_be_built_keep_the_graph_but_apply_nothing():
    # The graph loads (its services, and so the status's, are the spec's), but its objects
    # cannot be built: nothing is applied.
    bad = body()
    bad["spec"]["services"]["decode"]["extraPodSpec"] = {"nodeSelectr": {}}
    graph, desired, problems = desired_state(bad, OWNER, CONFIG)
    assert graph is not None and set(graph.spec.services) == {"prefill", "decode", "epp"}
    assert desired is None
    assert [p.reason for p in problems] == ["InvalidSpec"]
    assert "spec.services.decode.extraPodSpec.nodeSelectr" in problems[0].message


def test_a_graph_that_does_not_load_has_no_graph():
    bad = body()
    bad["spec"]["kvBlockSize"] = 0
    graph, desired, problems = desired_state(bad, OWNER, CONFIG)
    assert graph is None and desired is None
    assert problems[0].reason == "InvalidSpec" and "spec.kvBlockSize" in problems[0].message


def test_only_missing_kinds_the_graph_needs_are_problems():
    desired = [{"kind": "Deployment"}, {"kind": "InferencePool"}]
    problems = missing_crd_problems(desired, {"InferencePool", "HTTPRoute"})
    assert [p.message.split(":")[0] for p in problems] == ["InferencePool"]
