"""The kopf operator end to end against the API emulator (kmock + the layer in emulator.py).

Each test starts the real operator (`build_registry` + kopf's KopfRunner) against an emulated
API server on 127.0.0.1, acts like a user or a cluster would, and waits (bounded polling) for
the operator to converge.
"""

import asyncio
import contextlib
import copy
import logging

import kopf
import pytest
import yaml
from kopf.testing import KopfRunner

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.controller import reconcile
from dynamograph.operator.handlers import build_registry
from dynamograph.operator.kube import KubeApi, login
from dynamograph.operator.manifests import Owner, desired_objects
from dynamograph.protocol.graph import load_graph
from e2e.waiting import wait_for

from .emulator import EXAMPLES, NAMESPACE, upstream_crd
from .schemas import validate_against_crd

pytestmark = [
    pytest.mark.operator,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

GRAPHS = "dynamograph.io/v1alpha1/dynamographs"
DEPLOYMENTS = "apps/v1/deployments"
GRAPH_PATH = f"/apis/dynamograph.io/v1alpha1/namespaces/{NAMESPACE}/dynamographs"
DEPLOYMENT_PATH = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
IMAGE = "example.com/dynamograph:test"

OWNED = {
    "v1/serviceaccounts": ["g-discovery"],
    "rbac.authorization.k8s.io/v1/roles": ["g-discovery"],
    "rbac.authorization.k8s.io/v1/rolebindings": ["g-discovery"],
    "v1/configmaps": ["g-router"],
    "v1/services": ["g-epp", "g-frontend"],
    DEPLOYMENTS: ["g-prefill", "g-decode", "g-epp"],
    "inference.networking.k8s.io/v1/inferencepools": ["g"],
    "gateway.networking.k8s.io/v1/httproutes": ["g"],
}


@contextlib.contextmanager
def running_operator(resync: float = 600.0):
    settings = kopf.OperatorSettings()
    settings.scanning.disabled = True
    config = OperatorConfig(image=IMAGE, resync_seconds=resync)
    runner = KopfRunner(
        ["run", "-A", "--standalone"],
        registry=build_registry(config),
        settings=settings,
        timeout=30,
    )
    with runner:
        yield runner
    assert runner.exception is None
    # No handler failed along the way (kopf logs and retries failures instead of raising).
    assert "failed with an exception" not in runner.output, runner.output[-4000:]


def disagg_graph() -> dict:
    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    body["metadata"] = {"name": "g", "namespace": NAMESPACE}
    body["spec"]["gateway"]["parentRef"] = {"name": "inference-gateway"}
    return body


def live(cluster, resource: str, name: str) -> dict | None:
    try:
        obj = cluster.objects[resource, NAMESPACE, name]
    except KeyError:
        return None
    return None if obj.deleted else obj.raw


def graph_status(cluster) -> dict:
    return (live(cluster, GRAPHS, "g") or {}).get("status") or {}


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


async def create_graph(cluster, body: dict) -> None:
    response = await cluster.post(GRAPH_PATH, json=body)
    assert response.status in (200, 201), await response.text()


async def patch_graph(cluster, patch: dict) -> None:
    response = await cluster.patch(
        f"{GRAPH_PATH}/g", json=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert response.status == 200, await response.text()


async def wait_ready(cluster, generation: int = 1) -> dict:
    def ready():
        status = graph_status(cluster)
        return (
            status
            if status.get("state") == "ready" and status.get("observedGeneration") == generation
            else None
        )

    return await wait_for(ready, f"graph ready at generation {generation}", within=30)


def writes(cluster) -> int:
    return len([r for r in list(cluster) if r.method in ("POST", "PATCH", "DELETE")])


async def wait_quiet(cluster, quiet: float = 1.5, limit: float = 30.0) -> None:
    """Wait until nobody has written to the API for `quiet` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    count = writes(cluster)
    while True:
        await asyncio.sleep(quiet)
        if writes(cluster) == count:
            return
        count = writes(cluster)
        if loop.time() > deadline:
            raise AssertionError(f"still writing to the API after {limit}s")


def posted_events(cluster, reason: str) -> list[dict]:
    """Events the operator posted with `reason`, oldest first."""
    posts = [r.data for r in list(cluster) if r.method == "POST" and r.url.path.endswith("/events")]
    return [e for e in posts if e.get("reason") == reason]


def deployment_patches(cluster, name: str) -> list:
    path = f"{DEPLOYMENT_PATH}/{name}"
    return [r for r in list(cluster) if r.method == "PATCH" and r.url.path == path]


async def test_create_makes_every_object_and_reports_ready(cluster):
    with running_operator():
        await create_graph(cluster, disagg_graph())
        status = await wait_ready(cluster)

        uid = live(cluster, GRAPHS, "g")["metadata"]["uid"]
        for resource, names in OWNED.items():
            for name in names:
                obj = live(cluster, resource, name)
                assert obj is not None, f"{resource} {name} was not created"
                refs = obj["metadata"]["ownerReferences"]
                assert refs == [
                    {
                        "apiVersion": "dynamograph.io/v1alpha1",
                        "kind": "DynamoGraph",
                        "name": "g",
                        "uid": uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ]
                assert obj["metadata"]["labels"]["dynamograph.io/graph"] == "g"
        decode = live(cluster, DEPLOYMENTS, "g-decode")
        assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == IMAGE

        assert status["services"] == {
            "prefill": {
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 2,
                "availableReplicas": 2,
            },
            "decode": {
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 2,
                "availableReplicas": 2,
            },
            "epp": {
                "replicas": 1,
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "availableReplicas": 1,
            },
        }
        assert (status["replicas"], status["readyReplicas"]) == (5, 5)
        assert condition(status, "Ready")["status"] == "True"
        assert condition(status, "Available")["status"] == "True"
        assert condition(status, "Progressing") | {"lastTransitionTime": None} == {
            "type": "Progressing",
            "status": "False",
            "reason": "RolloutComplete",
            "message": "every Deployment is rolled out",
            "lastTransitionTime": None,
            "observedGeneration": 1,
        }
        assert condition(status, "Degraded")["status"] == "False"
        # The graph attaches to Gateway inference-gateway, which does not exist here: no URL
        # (tests/operator/test_gateway_endpoint.py gives it one), and the condition says why.
        assert "endpoint" not in status
        assert condition(status, "EndpointAssigned")["reason"] == "GatewayNotFound"

        # Converged: the operator stops writing (its own changes' events cause no more writes).
        await wait_quiet(cluster, limit=10)


async def test_status_follows_the_deployments(cluster):
    """Status is kept current by the watch on owned Deployments (the timer is 10 minutes away)."""
    cluster.rollouts_complete = False  # pods come up only when this test says so
    with running_operator():
        await create_graph(cluster, disagg_graph())

        def state(expected):
            return lambda: graph_status(cluster).get("state") == expected

        await wait_for(state("pending"), "state pending", within=20)
        assert condition(graph_status(cluster), "Available")["status"] == "False"

        async def report(name: str, ready: int) -> None:
            dep = live(cluster, DEPLOYMENTS, name)
            status = {
                "observedGeneration": dep["metadata"]["generation"],
                "replicas": dep["spec"]["replicas"],
                "updatedReplicas": dep["spec"]["replicas"],
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
            response = await cluster.patch(
                f"{DEPLOYMENT_PATH}/{name}/status",
                json={"status": status},
                headers={"Content-Type": "application/merge-patch+json"},
            )
            assert response.status == 200

        await report("g-decode", 1)
        await wait_for(state("progressing"), "state progressing", within=20)
        status = graph_status(cluster)
        assert status["services"]["decode"]["readyReplicas"] == 1
        progressing = condition(status, "Progressing")
        assert progressing["status"] == "True" and "decode: 1/2 ready" in progressing["message"]

        for name in ("g-decode", "g-prefill", "g-epp"):
            ready = live(cluster, DEPLOYMENTS, name)["spec"]["replicas"]
            await report(name, ready)
        status = await wait_ready(cluster)
        assert condition(status, "Available")["status"] == "True"


async def test_scale_and_image_change_touch_only_what_changed(cluster):
    with running_operator():
        await create_graph(cluster, disagg_graph())
        await wait_ready(cluster)
        templates = {
            name: copy.deepcopy(live(cluster, DEPLOYMENTS, name)["spec"]["template"])
            for name in OWNED[DEPLOYMENTS]
        }
        patched_before = {name: len(deployment_patches(cluster, name)) for name in templates}

        # Scale decode 2 -> 3: spec.replicas only, the pod template (so the pods) untouched.
        await patch_graph(cluster, {"spec": {"services": {"decode": {"replicas": 3}}}})
        status = await wait_ready(cluster, generation=2)
        assert status["services"]["decode"]["replicas"] == 3
        decode = live(cluster, DEPLOYMENTS, "g-decode")
        assert decode["spec"]["replicas"] == 3
        assert decode["spec"]["template"] == templates["g-decode"]
        scale_patches = deployment_patches(cluster, "g-decode")[patched_before["g-decode"] :]
        assert scale_patches and all(
            "template" not in p.data.get("spec", {}) for p in scale_patches
        )

        # New image for prefill only: its template changes (a rolling update), nothing else does.
        counts = {name: len(deployment_patches(cluster, name)) for name in templates}
        await patch_graph(
            cluster, {"spec": {"services": {"prefill": {"image": "example.com/other:2"}}}}
        )
        await wait_ready(cluster, generation=3)
        prefill = live(cluster, DEPLOYMENTS, "g-prefill")
        assert (
            prefill["spec"]["template"]["spec"]["containers"][0]["image"] == "example.com/other:2"
        )
        assert prefill["metadata"]["generation"] > 1
        assert len(deployment_patches(cluster, "g-decode")) == counts["g-decode"]
        assert len(deployment_patches(cluster, "g-epp")) == counts["g-epp"]
        assert live(cluster, DEPLOYMENTS, "g-epp")["spec"]["template"] == templates["g-epp"]


async def test_deleted_or_edited_deployment_is_repaired(cluster):
    with running_operator():
        await create_graph(cluster, disagg_graph())
        await wait_ready(cluster)
        old_uid = live(cluster, DEPLOYMENTS, "g-decode")["metadata"]["uid"]

        response = await cluster.delete(f"{DEPLOYMENT_PATH}/g-decode")
        assert response.status == 200

        def recreated():
            dep = live(cluster, DEPLOYMENTS, "g-decode")
            return dep if dep and dep["metadata"]["uid"] != old_uid else None

        dep = await wait_for(recreated, "the decode Deployment to come back", within=20)
        assert dep["spec"]["replicas"] == 2
        await wait_ready(cluster)

        # Someone edits a pod template by hand: the operator puts the spec's version back.
        hand_edit = {
            "spec": {"template": {"spec": {"containers": [{"name": "engine", "image": "x/y:z"}]}}}
        }
        response = await cluster.patch(
            f"{DEPLOYMENT_PATH}/g-prefill",
            json=hand_edit,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert response.status == 200

        def reverted():
            dep = live(cluster, DEPLOYMENTS, "g-prefill")
            containers = dep["spec"]["template"]["spec"]["containers"]
            return containers[0].get("image") == IMAGE and len(containers[0]["args"]) > 10

        await wait_for(reverted, "the hand edit to be reverted", within=20)


async def test_invalid_spec_is_degraded_with_an_event(cluster):
    body = disagg_graph()
    # Valid for the CRD schema (extraPodSpec keeps unknown fields), not for a PodSpec.
    body["spec"]["services"]["decode"]["extraPodSpec"] = {"nodeSelectr": {"gpu": "h100"}}
    field = "spec.services.decode.extraPodSpec.nodeSelectr"
    with running_operator():
        await create_graph(cluster, body)

        def degraded():
            cond = condition(graph_status(cluster), "Degraded")
            return cond if cond.get("status") == "True" else None

        cond = await wait_for(degraded, "Degraded=True", within=20)
        assert cond["reason"] == "InvalidSpec"
        assert field in cond["message"]
        status = graph_status(cluster)
        assert status["state"] == "failed"
        assert condition(status, "Ready")["status"] == "False"
        # Nothing was created from a spec the operator could not understand.
        assert live(cluster, DEPLOYMENTS, "g-prefill") is None

        events = await wait_for(
            lambda: posted_events(cluster, "InvalidSpec"), "an InvalidSpec Event", within=15
        )
        assert field in events[0]["message"]
        assert events[0]["type"] == "Warning"
        assert events[0]["involvedObject"]["name"] == "g"

        # Fixing the spec heals the graph.
        await patch_graph(cluster, {"spec": {"services": {"decode": {"extraPodSpec": None}}}})
        await wait_ready(cluster, generation=2)
        assert condition(graph_status(cluster), "Degraded")["status"] == "False"


@pytest.mark.parametrize("cluster", [("InferencePool",)], indirect=True)
async def test_missing_crd_and_foreign_object_are_reported(cluster):
    """No InferencePool CRD, and someone else's Service where the graph's frontend Service goes:
    everything else is deployed, both problems are named, the foreign object is left alone."""
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "g-frontend", "namespace": NAMESPACE, "labels": {"team": "other"}},
        "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]},
    }
    response = await cluster.post(f"/api/v1/namespaces/{NAMESPACE}/services", json=foreign)
    assert response.status in (200, 201)
    with running_operator():
        await create_graph(cluster, disagg_graph())

        def degraded():
            cond = condition(graph_status(cluster), "Degraded")
            return (
                cond if cond.get("status") == "True" and "g-frontend" in cond["message"] else None
            )

        cond = await wait_for(degraded, "Degraded naming both problems", within=20)
        assert cond["reason"] == "CRDMissing"
        assert "InferencePool: not served by this cluster" in cond["message"]
        assert "Service g-frontend exists and is not owned by this graph" in cond["message"]
        assert graph_status(cluster)["state"] == "failed"
        for name in OWNED[DEPLOYMENTS]:
            assert live(cluster, DEPLOYMENTS, name) is not None
        assert live(cluster, "v1/services", "g-frontend")["spec"]["selector"] == {"app": "other"}
        await wait_quiet(cluster, limit=15)


async def test_a_graph_deleted_while_its_timer_runs_a_pass_goes_promptly(cluster, caplog):
    """kopf holds its finalizer until the graph's timer has stopped. A timer in the middle of a
    pass cannot stop at once; kopf looks again after `cancellation_polling`, and nothing wakes
    it earlier (the pass writes nothing to a deleting graph). With kopf's default of 60 s the
    graph and everything it owns outlived the deletion by a minute."""
    caplog.set_level(logging.DEBUG, logger="kopf.objects")
    gate = asyncio.Event()
    gate.set()
    held = asyncio.Event()
    handle = cluster._handle

    async def gated(request):
        # Only our controller GETs the graph by name (kopf watches and patches): a pass waits here.
        if request.method == "GET" and request.url.path == f"{GRAPH_PATH}/g" and not gate.is_set():
            held.set()
            await gate.wait()
        return await handle(request)

    cluster._handle = gated
    try:
        with running_operator(resync=0.5):
            await create_graph(cluster, disagg_graph())
            await wait_ready(cluster)
            await wait_quiet(cluster)  # no Deployment events in flight: the next GET is the timer's

            gate.clear()
            await asyncio.wait_for(held.wait(), 30)
            response = await cluster.delete(f"{GRAPH_PATH}/g")
            assert response.status == 200

            def timer_caught_in_a_pass():
                return any("is still exiting" in r.getMessage() for r in caplog.records)

            await wait_for(timer_caught_in_a_pass, "kopf to wait for the graph's timer", within=30)
            gate.set()
            # Well under kopf's default 60 s re-check, well over the 1 s one on a loaded box.
            await wait_for(lambda: live(cluster, GRAPHS, "g") is None, "the graph to go", within=20)
    finally:
        gate.set()
        cluster._handle = handle


async def write_gateway_status(cluster, kind: str, accepted: dict, resolved: dict) -> None:
    """What a gateway controller does: write its verdict per parent into the status of the
    graph's HTTPRoute or InferencePool (checked against the upstream CRD's schema)."""
    resource, group = {
        "HTTPRoute": ("httproutes", "gateway.networking.k8s.io"),
        "InferencePool": ("inferencepools", "inference.networking.k8s.io"),
    }[kind]
    path = f"/apis/{group}/v1/namespaces/{NAMESPACE}/{resource}/g"
    conditions = [
        {"type": "Accepted", "observedGeneration": 1, "lastTransitionTime": "2026-01-01T00:00:00Z"}
        | accepted,
        {
            "type": "ResolvedRefs",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
        | resolved,
    ]
    parents = [
        {
            "parentRef": {
                "group": "gateway.networking.k8s.io",
                "kind": "Gateway",
                "name": "inference-gateway",
            },
            "controllerName": "example.net/gateway",
            "conditions": conditions,
        }
    ]
    response = await cluster.patch(
        f"{path}/status",
        json={"status": {"parents": parents}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status == 200, await response.text()
    validate_against_crd(live(cluster, f"{group}/v1/{resource}", "g"), upstream_crd(kind))


async def test_graph_status_follows_the_gateways_verdict(cluster):
    """The gateway controller's status on the HTTPRoute and InferencePool reaches the graph's
    GatewayAccepted condition through the watches (the timer is 10 minutes away)."""
    ok = {"status": "True", "reason": "Accepted", "message": ""}
    resolved = {"status": "True", "reason": "ResolvedRefs", "message": ""}
    with running_operator():
        await create_graph(cluster, disagg_graph())
        status = await wait_ready(cluster)
        gateway = condition(status, "GatewayAccepted")
        assert (gateway["status"], gateway["reason"]) == ("Unknown", "NoGatewayStatus")

        def gateway_is(expected: str):
            def check():
                cond = condition(graph_status(cluster), "GatewayAccepted")
                return cond if cond.get("status") == expected else None

            return check

        refused = {
            "status": "False",
            "reason": "NotAllowedByListeners",
            "message": "no listener of inference-gateway allows routes from ns1",
        }
        await write_gateway_status(cluster, "HTTPRoute", refused, resolved)
        cond = await wait_for(gateway_is("False"), "GatewayAccepted=False", within=20)
        assert cond["reason"] == "NotAllowedByListeners"
        assert "no listener of inference-gateway allows routes from ns1" in cond["message"]
        status = graph_status(cluster)
        assert status["state"] == "ready"  # the graph's own pods are fine
        assert condition(status, "Ready")["status"] == "True"
        assert "the gateway does not accept the graph" in condition(status, "Degraded")["message"]

        events = await wait_for(
            lambda: posted_events(cluster, "GatewayRejected"), "a GatewayRejected Event", within=15
        )
        assert "NotAllowedByListeners" in events[0]["message"]

        # The gateway admin fixes the listener: route and pool are accepted.
        await write_gateway_status(cluster, "HTTPRoute", ok, resolved)
        await write_gateway_status(cluster, "InferencePool", ok, resolved)
        cond = await wait_for(gateway_is("True"), "GatewayAccepted=True", within=20)
        assert cond["reason"] == "Accepted"
        assert "the gateway" not in condition(graph_status(cluster), "Degraded")["message"]


async def test_a_create_raced_by_the_same_graph_is_no_conflict(cluster):
    """A pass lists, then finds an object it meant to create already there: made meanwhile by
    the same graph's pass in another replica (peered operators overlap for a moment while the
    leader hands over). Owned by the graph, so not a NameConflict; anybody else's still is."""
    await create_graph(cluster, disagg_graph())
    body = live(cluster, GRAPHS, "g")
    meta = body["metadata"]
    owner = Owner(name="g", namespace=NAMESPACE, uid=meta["uid"])
    config = OperatorConfig(image=IMAGE)
    ours = next(
        o for o in desired_objects(load_graph(body), owner, config) if o["kind"] == "ConfigMap"
    )
    # Unlabelled, so this pass's list does not see it: as if created just after the list.
    raced = copy.deepcopy(ours)
    raced["metadata"]["labels"] = {}
    response = await cluster.post(f"/api/v1/namespaces/{NAMESPACE}/configmaps", json=raced)
    assert response.status in (200, 201), await response.text()

    api = KubeApi(lambda: login(kopf.OperatorSettings()))
    try:
        outcome = await reconcile(api, body, config)
    finally:
        await api.close()
    assert outcome.problems == []
    assert condition(outcome.status, "Degraded")["status"] == "False"
