"""Observed Deployments + problems -> status: conditions, state, counts, transition times."""

import pytest

from dynamograph.operator.status import (
    GatewayObservation,
    Problem,
    ServiceObservation,
    degraded_message,
    gateway_rejection,
    gateway_verdict,
    graph_status,
    status_body,
)

pytestmark = pytest.mark.unit

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(
    replicas, ready, updated=None, available=None, generation=1, observed=1, conditions=()
):
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": ready if updated is None else updated,
            "availableReplicas": ready if available is None else available,
            "conditions": list(conditions),
        },
    }


def status_of(services, problems=(), previous=None, now=T0, gateway=None):
    return status_body(
        graph_status(
            services,
            list(problems),
            generation=4,
            previous=previous,
            endpoint="http://g-frontend.ns.svc:8080",
            now=now,
            gateway=gateway,
        )
    )


def conditions(status):
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_all_ready():
    status = status_of(
        {
            "decode": ServiceObservation(2, deployment(2, 2)),
            "epp": ServiceObservation(1, deployment(1, 1)),
        }
    )
    assert status["state"] == "ready"
    assert status["observedGeneration"] == 4
    assert conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
    }
    assert status["services"]["decode"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "availableReplicas": 2,
    }
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert all(c["lastTransitionTime"] == T0 for c in status["conditions"])


def test_nothing_created_yet_is_pending():
    status = status_of({"decode": ServiceObservation(2, None)})
    assert status["state"] == "pending"
    assert conditions(status)["Progressing"] == ("True", "RollingOut")
    assert conditions(status)["Available"] == ("False", "ServicesUnavailable")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "decode: Deployment not created yet"


def test_partial_rollout_is_progressing_but_available():
    status = status_of(
        {
            "decode": ServiceObservation(4, deployment(4, 2, updated=3)),
            "epp": ServiceObservation(1, deployment(1, 1)),
        }
    )
    assert status["state"] == "progressing"
    assert conditions(status)["Available"] == ("True", "MinimumReplicasAvailable")
    progressing = next(c for c in status["conditions"] if c["type"] == "Progressing")
    assert progressing["message"] == "decode: 3/4 updated"


def test_stale_deployment_generation_is_progressing():
    status = status_of(
        {"decode": ServiceObservation(2, deployment(2, 2, generation=3, observed=2))}
    )
    assert status["state"] == "progressing"
    assert "has not seen the latest spec" in status["conditions"][0]["message"]


def test_scaled_to_zero_is_ready():
    status = status_of({"decode": ServiceObservation(0, deployment(0, 0))})
    assert status["state"] == "ready"
    assert conditions(status)["Available"][0] == "True"


def test_problems_make_it_failed_and_degraded():
    problem = Problem(
        "InvalidSpec", "spec.services.decode.extraPodSpec.nodeSelectr: not a PodSpec field"
    )
    status = status_of({"decode": ServiceObservation(2, deployment(2, 2))}, [problem])
    assert status["state"] == "failed"
    assert conditions(status)["Degraded"] == ("True", "InvalidSpec")
    assert conditions(status)["Ready"] == ("False", "NotReady")
    assert degraded_message(status) == problem.message


def test_deployment_that_gave_up_is_degraded():
    stuck = deployment(
        2,
        1,
        conditions=[
            {
                "type": "Progressing",
                "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": 'ReplicaSet "g-decode-1" has timed out progressing.',
            }
        ],
    )
    status = status_of({"decode": ServiceObservation(2, stuck)})
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "DeploymentFailed")
    assert degraded["message"].startswith("decode: ReplicaSet")


def test_transition_times_survive_unchanged_conditions():
    services = {"decode": ServiceObservation(2, deployment(2, 2))}
    first = status_of(services, now=T0)
    again = status_of(services, previous=first, now=T1)
    assert again == first  # nothing changed: a status patch would be empty
    broken = status_of(services, [Problem("ApplyFailed", "x")], previous=first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in broken["conditions"]}
    assert times == {"Ready": T1, "Available": T0, "Progressing": T0, "Degraded": T1}
    assert degraded_message(first) is None


# -- the gateway's verdict (GatewayAccepted) ------------------------------------------------------

PARENT = {"name": "inference-gateway", "group": "gateway.networking.k8s.io", "kind": "Gateway"}
CONTROLLER = "example.net/gateway-controller"


def cond(kind, status="True", reason=None, message="", observed=1):
    return {
        "type": kind,
        "status": status,
        "reason": reason or ("Accepted" if kind == "Accepted" else "ResolvedRefs"),
        "message": message,
        "observedGeneration": observed,
        "lastTransitionTime": T0,
    }


def parent_status(*conditions, ref=None):
    return {
        "parentRef": ref or {"name": "inference-gateway", "namespace": "ns"},
        "controllerName": CONTROLLER,
        "conditions": list(conditions),
    }


def obj(kind, *parents, generation=1):
    return {
        "kind": kind,
        "metadata": {"name": "g", "generation": generation},
        "status": {"parents": list(parents)} if parents else {},
    }


def accepted(kind, generation=1):
    return obj(kind, parent_status(cond("Accepted"), cond("ResolvedRefs")), generation=generation)


def gateway(route, pool, parent=PARENT):
    return GatewayObservation(parent=parent, namespace="ns", route=route, pool=pool)


def verdict(route, pool, parent=PARENT):
    v = gateway_verdict(gateway(route, pool, parent))
    return v.status, v.reason, v.message


def test_gateway_accepts_route_and_pool():
    status, reason, message = verdict(accepted("HTTPRoute"), accepted("InferencePool"))
    assert (status, reason) == ("True", "Accepted")
    assert "HTTPRoute g: accepted by Gateway inference-gateway" in message
    assert "InferencePool g: accepted" in message


def test_no_gateway_status_yet_is_unknown():
    assert verdict(None, None)[:2] == ("Unknown", "NotCreated")
    status, reason, message = verdict(obj("HTTPRoute"), obj("InferencePool"))
    assert (status, reason) == ("Unknown", "NoGatewayStatus")
    assert message == (
        "HTTPRoute g: no status from Gateway inference-gateway yet; "
        "InferencePool g: no status from Gateway inference-gateway yet"
    )
    # The route is accepted but no controller has written the pool's status (yet).
    status, reason, message = verdict(accepted("HTTPRoute"), obj("InferencePool"))
    assert (status, reason) == ("Unknown", "NoGatewayStatus")
    assert message == "InferencePool g: no status from Gateway inference-gateway yet"


def test_rejection_carries_the_gateways_reason_and_message():
    refused = obj(
        "HTTPRoute",
        parent_status(
            cond("Accepted", "False", "NotAllowedByListeners", "no listener allows namespace ns"),
            cond("ResolvedRefs"),
        ),
    )
    status, reason, message = verdict(refused, accepted("InferencePool"))
    assert (status, reason) == ("False", "NotAllowedByListeners")
    assert message == (
        f"HTTPRoute g: Gateway inference-gateway ({CONTROLLER}) says Accepted=False "
        "(NotAllowedByListeners): no listener allows namespace ns"
    )
    # An InferencePool whose endpoint picker the gateway cannot resolve: False even though the
    # route is fine, and a refusal outranks another object's missing status.
    pool = obj(
        "InferencePool",
        parent_status(
            cond("Accepted"), cond("ResolvedRefs", "False", "InvalidExtensionRef", "no g-epp")
        ),
    )
    status, reason, message = verdict(obj("HTTPRoute"), pool)
    assert (status, reason) == ("False", "InvalidExtensionRef")
    assert "InferencePool g: " in message and "ResolvedRefs=False" in message
    assert "no g-epp" in message


def test_stale_or_unknown_gateway_conditions_are_unknown():
    stale_route = accepted("HTTPRoute", generation=2)  # conditions are about generation 1
    status, reason, message = verdict(stale_route, accepted("InferencePool"))
    assert (status, reason) == ("Unknown", "StaleGatewayStatus")
    assert "has not seen generation 2 yet" in message
    pending = obj("HTTPRoute", parent_status(cond("Accepted", "Unknown", "Pending")))
    assert verdict(pending, accepted("InferencePool"))[:2] == ("Unknown", "Pending")
    half = obj("HTTPRoute", parent_status(cond("Accepted")))  # no ResolvedRefs reported
    assert verdict(half, accepted("InferencePool"))[:2] == ("Unknown", "NoGatewayStatus")


def test_only_the_specs_parent_counts():
    other = parent_status(
        cond("Accepted", "False", "NotAllowedByListeners"),
        cond("ResolvedRefs"),
        ref={"name": "inference-gateway", "namespace": "elsewhere"},
    )
    route = obj("HTTPRoute", other, parent_status(cond("Accepted"), cond("ResolvedRefs")))
    assert verdict(route, accepted("InferencePool"))[0] == "True"
    # A sectionName in the spec selects that listener's entry on the route.
    section = {**PARENT, "sectionName": "https"}
    assert verdict(route, accepted("InferencePool"), parent=section)[:2] == (
        "Unknown",
        "NoGatewayStatus",
    )
    listener = parent_status(
        cond("Accepted"),
        cond("ResolvedRefs"),
        ref={"name": "inference-gateway", "sectionName": "https"},
    )
    assert verdict(obj("HTTPRoute", listener), accepted("InferencePool"), parent=section)[0] == (
        "True"
    )


def test_a_malformed_gateway_reason_is_replaced():
    bad = obj(
        "HTTPRoute", parent_status(cond("Accepted", "False", "not a reason!"), cond("ResolvedRefs"))
    )
    assert verdict(bad, accepted("InferencePool"))[:2] == ("False", "AcceptedFalse")


def test_gateway_condition_in_status_does_not_gate_ready():
    services = {"decode": ServiceObservation(2, deployment(2, 2))}
    ok = status_of(services, gateway=gateway(accepted("HTTPRoute"), accepted("InferencePool")))
    assert conditions(ok)["GatewayAccepted"] == ("True", "Accepted")
    assert ok["state"] == "ready"

    refused = obj(
        "HTTPRoute",
        parent_status(cond("Accepted", "False", "NotAllowedByListeners", "wrong namespace")),
    )
    status = status_of(
        services, previous=ok, now=T1, gateway=gateway(refused, accepted("InferencePool"))
    )
    # The graph's own workloads are ready; the gateway's refusal is its own condition, named
    # in the Degraded message and repeated by an Event (gateway_rejection), not a failure.
    assert status["state"] == "ready"
    assert conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Available": ("True", "MinimumReplicasAvailable"),
        "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected"),
        "GatewayAccepted": ("False", "NotAllowedByListeners"),
    }
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "the gateway does not accept the graph" in degraded["message"]
    assert "wrong namespace" in degraded["message"]
    assert "wrong namespace" in gateway_rejection(status)
    assert gateway_rejection(ok) is None
    times = {c["type"]: c["lastTransitionTime"] for c in status["conditions"]}
    assert times["GatewayAccepted"] == T1 and times["Ready"] == T0

    # Without a gateway in the spec there is no such condition.
    assert "GatewayAccepted" not in conditions(status_of(services))
