"""Router settings are checked against the router core's RouterConfig when a graph is applied:
a setting the router would refuse at start-up is refused by the operator, naming the field."""

import argparse
import copy

import pytest
import yaml

from dynamograph.epp import cli as epp_cli
from dynamograph.frontend import cli as frontend_cli
from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, router_config_errors
from dynamograph.protocol.graph import GraphError, RouterSpec, load_graph
from dynamograph.router.admission import AdmissionLimits, admission_limits
from e2e.waiting import wait_for

from .emulator import EXAMPLES
from .test_operator import (
    DEPLOYMENTS,
    condition,
    create_graph,
    disagg_graph,
    graph_status,
    live,
    patch_graph,
    posted_events,
    running_operator,
    wait_quiet,
    wait_ready,
)

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")

OWNER = Owner(name="disagg", namespace="ns", uid="uid-1")
WEIGHTS = {"weights": {"kv-overlap": 2.0, "load": 1.0}}
WEIGHTS_FIELD = "spec.services.epp.router.config.weights"


def disagg(router: dict | None = None, frontend: dict | None = None) -> dict:
    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    if router is not None:
        body["spec"]["services"]["epp"]["router"] = router
    if frontend is not None:
        body["spec"]["services"]["front"] = {"componentType": "frontend", "router": frontend}
    return body


def refusal(body: dict) -> GraphError:
    with pytest.raises(GraphError) as info:
        desired_objects(load_graph(body), OWNER, OperatorConfig(image="img"))
    return info.value


@pytest.mark.unit
def test_an_unknown_router_setting_is_refused_naming_the_field():
    error = refusal(disagg({"mode": "kv", "config": copy.deepcopy(WEIGHTS)}))
    [(field, message)] = error.errors
    assert field == WEIGHTS_FIELD
    assert message.startswith("not a router setting (got {'kv-overlap': 2.0, 'load': 1.0})")
    # What a person can use instead: the settings the router does have.
    assert "temperature" in message


@pytest.mark.unit
def test_a_router_setting_of_the_wrong_type_is_refused():
    error = refusal(disagg({"config": {"temperature": "hot"}}))
    [(field, message)] = error.errors
    assert field == "spec.services.epp.router.config.temperature"
    assert "valid number" in message and "'hot'" in message


@pytest.mark.unit
def test_a_standalone_frontends_router_settings_are_checked_too():
    error = refusal(disagg(frontend={"mode": "round-robin", "config": {"nope": 1}}))
    assert [field for field, _ in error.errors] == ["spec.services.front.router.config.nope"]


def _admission_of(objects: list[dict], deployment: str, module, monkeypatch) -> AdmissionLimits:
    """The admission limits the component's own CLI reads from its rendered command line."""
    (container,) = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment
    )["spec"]["template"]["spec"]["containers"]
    monkeypatch.delenv(f"{module.ENV_PREFIX}_MAX_PENDING_PICKS", raising=False)
    monkeypatch.delenv(f"{module.ENV_PREFIX}_MAX_LOOP_LAG", raising=False)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return admission_limits(parser.parse_args(container["args"][1:]), env_prefix=module.ENV_PREFIX)


@pytest.mark.unit
def test_admission_limits_reach_the_epp_and_a_kv_frontend(monkeypatch):
    """`router.maxPendingPicks` and `router.maxLoopLagSeconds` are what the EPP's and a kv-mode
    frontend's own command lines give them; unset, each keeps its default."""
    limits = {"maxPendingPicks": 32, "maxLoopLagSeconds": 0.25}
    objects = desired_objects(
        load_graph(disagg(limits, frontend={"mode": "kv", "maxLoopLagSeconds": 0})),
        OWNER,
        OperatorConfig(image="img"),
    )
    assert _admission_of(objects, "disagg-epp", epp_cli, monkeypatch) == AdmissionLimits(32, 0.25)
    assert _admission_of(objects, "disagg-front", frontend_cli, monkeypatch) == AdmissionLimits(
        max_loop_lag_s=0.0
    )
    defaults = desired_objects(load_graph(disagg()), OWNER, OperatorConfig(image="img"))
    assert _admission_of(defaults, "disagg-epp", epp_cli, monkeypatch) == AdmissionLimits()


@pytest.mark.unit
def test_valid_router_settings_pass():
    assert router_config_errors(RouterSpec(), "spec.services.epp.router") == []
    graph = load_graph(disagg({"mode": "least-loaded", "config": {"session_ttl_s": 30}}))
    objects = desired_objects(graph, OWNER, OperatorConfig(image="img"))
    assert any(o["kind"] == "ConfigMap" for o in objects)


@pytest.mark.operator
async def test_applying_an_unknown_router_setting_rolls_nothing_out(cluster):
    """A running graph patched with a router setting the EPP would refuse: Degraded and Ready
    false naming the field, a Warning Event, and the EPP's config and Deployment untouched until
    the spec is fixed."""
    with running_operator():
        await create_graph(cluster, disagg_graph())
        await wait_ready(cluster)
        before = copy.deepcopy(live(cluster, "v1/configmaps", "g-router"))
        epp = copy.deepcopy(live(cluster, DEPLOYMENTS, "g-epp"))
        await wait_quiet(cluster)

        await patch_graph(cluster, {"spec": {"services": {"epp": {"router": {"config": WEIGHTS}}}}})

        def degraded():
            cond = condition(graph_status(cluster), "Degraded")
            return cond if cond.get("status") == "True" else None

        cond = await wait_for(degraded, "Degraded=True", within=20)
        assert cond["reason"] == "InvalidSpec"
        assert f"{WEIGHTS_FIELD}: not a router setting" in cond["message"]
        status = graph_status(cluster)
        assert status["state"] == "failed"
        ready = condition(status, "Ready")
        assert ready["status"] == "False" and WEIGHTS_FIELD in ready["message"]
        events = await wait_for(
            lambda: posted_events(cluster, "InvalidSpec"), "an InvalidSpec Event", within=15
        )
        assert WEIGHTS_FIELD in events[0]["message"] and events[0]["type"] == "Warning"
        await wait_quiet(cluster)
        assert live(cluster, "v1/configmaps", "g-router")["data"] == before["data"]
        assert live(cluster, DEPLOYMENTS, "g-epp")["spec"] == epp["spec"]

        # Fixing the spec heals the graph.
        await patch_graph(cluster, {"spec": {"services": {"epp": {"router": {"config": None}}}}})
        await wait_ready(cluster, generation=3)
        assert condition(graph_status(cluster), "Degraded")["status"] == "False"
