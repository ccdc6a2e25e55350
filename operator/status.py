"""Observed Deployments + problems -> the graph's status: pure logic.

Tells the truth about the graph in the shape of DynamoGraphStatus: per-service replica counts
from the Deployments' own status, four conditions with reasons and messages, the generation it
describes and a one-word state:

- Degraded: the spec is invalid in a way the schema could not say, an object could not be
  applied (missing CRD, name conflict, API error), or a Deployment gave up its rollout.
- Progressing: some Deployment is missing, has not seen its latest spec, or has pods on an
  old template or not ready.
- Available: every service that wants pods has at least one available.
- Ready: every wanted pod is up to date and ready, and nothing is degraded.

state: failed (degraded), ready, pending (no pod ready anywhere yet) or progressing.
"""

from dataclasses import dataclass
from typing import Any

from .models import Condition, DynamoGraphStatus, GraphState, ServiceStatus


@dataclass(frozen=True)
class Problem:
    """Something wrong with the graph; `reason` is CamelCase, `message` names the field/object."""

    reason: str
    message: str


@dataclass(frozen=True)
class ServiceObservation:
    """One service: how many pods the spec wants, and its Deployment as last read (or None)."""

    desired: int
    deployment: dict[str, Any] | None


def service_status(observation: ServiceObservation) -> ServiceStatus:
    status = (observation.deployment or {}).get("status") or {}
    return ServiceStatus(
        replicas=observation.desired,
        ready_replicas=status.get("readyReplicas", 0),
        updated_replicas=status.get("updatedReplicas", 0),
        available_replicas=status.get("availableReplicas", 0),
    )


def _rollout_done(observation: ServiceObservation) -> tuple[bool, str]:
    dep = observation.deployment
    if dep is None:
        return False, "Deployment not created yet"
    status = dep.get("status") or {}
    generation = dep.get("metadata", {}).get("generation")
    if generation is not None and status.get("observedGeneration", 0) < generation:
        return False, "Deployment controller has not seen the latest spec"
    want = observation.desired
    counts = [
        ("updated", status.get("updatedReplicas", 0)),
        ("ready", status.get("readyReplicas", 0)),
        ("available", status.get("availableReplicas", 0)),
    ]
    for label, count in counts:
        if count < want:
            return False, f"{count}/{want} {label}"
    if status.get("replicas", 0) > want:
        return False, f"{status['replicas'] - want} old pods terminating"
    return True, f"{want}/{want} ready"


def _deployment_failure(dep: dict[str, Any] | None) -> str | None:
    """The message of a Deployment that gave up (deadline exceeded, or pods cannot be created)."""
    for cond in (dep or {}).get("status", {}).get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return cond.get("message") or "progress deadline exceeded"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("message") or cond.get("reason") or "replica failure"
    return None


def _condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    previous: dict[str, dict[str, Any]],
    generation: int | None,
    now: str,
) -> Condition:
    status = "True" if ok else "False"
    before = previous.get(kind)
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since or now,
        observed_generation=generation,
    )


def graph_status(
    services: dict[str, ServiceObservation],
    problems: list[Problem],
    *,
    generation: int | None,
    previous: dict[str, Any] | None,
    endpoint: str | None,
    now: str,
) -> DynamoGraphStatus:
    """The status for the observed services and problems; `previous` keeps transition times."""
    previous_conditions = {
        c.get("type"): c for c in (previous or {}).get("conditions") or [] if isinstance(c, dict)
    }
    per_service = {name: service_status(obs) for name, obs in services.items()}
    problems = list(problems)
    for name, obs in services.items():
        failure = _deployment_failure(obs.deployment)
        if failure:
            problems.append(Problem("DeploymentFailed", f"{name}: {failure}"))

    pending = {}
    for name, obs in services.items():
        done, detail = _rollout_done(obs)
        if not done:
            pending[name] = detail
    unavailable = [
        f"{name}: 0/{obs.desired} available"
        for name, obs in services.items()
        if obs.desired > 0 and per_service[name].available_replicas < 1
    ]
    degraded = bool(problems)

    def cond(kind: str, ok: bool, reason: str, message: str) -> Condition:
        return _condition(kind, ok, reason, message, previous_conditions, generation, now)

    degraded_reason = problems[0].reason if problems else "AsExpected"
    degraded_message = "; ".join(p.message for p in problems) if problems else "no problems found"
    progress_message = "; ".join(f"{n}: {d}" for n, d in sorted(pending.items()))
    conditions = [
        cond(
            "Ready",
            not degraded and not pending,
            "AllReplicasReady" if not degraded and not pending else "NotReady",
            "every service is up to date and ready"
            if not degraded and not pending
            else (degraded_message if degraded else progress_message),
        ),
        cond(
            "Available",
            not unavailable,
            "MinimumReplicasAvailable" if not unavailable else "ServicesUnavailable",
            "every service has an available pod" if not unavailable else "; ".join(unavailable),
        ),
        cond(
            "Progressing",
            bool(pending),
            "RollingOut" if pending else "RolloutComplete",
            progress_message or "every Deployment is rolled out",
        ),
        cond("Degraded", degraded, degraded_reason, degraded_message),
    ]
    ready_total = sum(s.ready_replicas for s in per_service.values())
    if degraded:
        state = GraphState.FAILED
    elif not pending:
        state = GraphState.READY
    elif ready_total == 0:
        state = GraphState.PENDING
    else:
        state = GraphState.PROGRESSING
    return DynamoGraphStatus(
        observed_generation=generation,
        state=state,
        conditions=conditions,
        services=per_service,
        replicas=sum(s.replicas for s in per_service.values()),
        ready_replicas=ready_total,
        endpoint=endpoint,
    )


def status_body(status: DynamoGraphStatus) -> dict[str, Any]:
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


def degraded_message(status: dict[str, Any] | None) -> str | None:
    """The Degraded condition's message when it is True (what an Event repeats), else None."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("status") == "True":
            return cond.get("message")
    return None
