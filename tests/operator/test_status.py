"""Observed Deployments + problems -> status: conditions, state, counts, transition times."""

import pytest

from dynamograph.operator.status import (
    Problem,
    ServiceObservation,
    degraded_message,
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


def status_of(services, problems=(), previous=None, now=T0):
    return status_body(
        graph_status(
            services,
            list(problems),
            generation=4,
            previous=previous,
            endpoint="http://g-frontend.ns.svc:8080",
            now=now,
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
