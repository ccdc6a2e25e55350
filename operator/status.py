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

When the graph attaches to a gateway (an HTTPRoute to `spec.gateway.parentRef`), a fifth
condition, GatewayAccepted, repeats the gateway's own verdict: True when its controller has
accepted and resolved both the HTTPRoute and the InferencePool for that Gateway, False with the
gateway's reason and message when it refused either, Unknown while no controller has written
status for the latest generation. It describes another controller's work, so it does not gate
Ready, Available or state (a gateway that never writes InferencePool status would otherwise
keep every graph from being Ready); a rejection is named in the Degraded message instead.
"""

import re
from dataclasses import dataclass
from typing import Any

from dynamograph.protocol.graph import Condition, DynamoGraphStatus, GraphState, ServiceStatus


@dataclass(frozen=True)
class Problem:
    """Something wrong with the graph; `reason` is CamelCase, `message` names the field/object."""

    reason: str
    message: str


@dataclass(frozen=True)
class GatewayObservation:
    """The Gateway the graph attaches to (its parentRef, as the spec gives it) and the graph's
    HTTPRoute and InferencePool as last read (None: not there)."""

    parent: dict[str, Any]
    namespace: str
    route: dict[str, Any] | None
    pool: dict[str, Any] | None


@dataclass(frozen=True)
class Verdict:
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


GATEWAY_ACCEPTED = "GatewayAccepted"
GATEWAY_GROUP = "gateway.networking.k8s.io"
# The conditions a Gateway API controller writes per parent on an HTTPRoute, and a GAIE v1
# controller on an InferencePool; both must be True for traffic to flow.
_PARENT_CONDITIONS = ("Accepted", "ResolvedRefs")
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")  # metav1.Condition's rule


def _same_parent(ref: dict[str, Any], want: dict[str, Any], namespace: str, section: bool) -> bool:
    """Whether a status entry's parentRef names the spec's parent (defaults as Gateway API's)."""
    return (
        (ref.get("group") or GATEWAY_GROUP) == (want.get("group") or GATEWAY_GROUP)
        and (ref.get("kind") or "Gateway") == (want.get("kind") or "Gateway")
        and ref.get("name") == want.get("name")
        and (ref.get("namespace") or namespace) == (want.get("namespace") or namespace)
        and (not section or ref.get("sectionName") == want.get("sectionName"))
    )


def _object_verdict(
    kind: str, obj: dict[str, Any] | None, gateway: GatewayObservation, section: bool
) -> Verdict:
    """The gateway's verdict on one object (HTTPRoute or InferencePool) for the spec's parent."""
    parent_name = f"{gateway.parent.get('kind') or 'Gateway'} {gateway.parent.get('name')}"
    if obj is None:
        return Verdict("Unknown", "NotCreated", f"{kind} does not exist")
    name = f"{kind} {obj.get('metadata', {}).get('name')}"
    entries = [
        entry
        for entry in (obj.get("status") or {}).get("parents") or []
        if _same_parent(entry.get("parentRef") or {}, gateway.parent, gateway.namespace, section)
    ]
    if not entries:
        return Verdict("Unknown", "NoGatewayStatus", f"{name}: no status from {parent_name} yet")
    generation = obj.get("metadata", {}).get("generation")
    unknown: Verdict | None = None
    for entry in entries:
        by_type = {c.get("type"): c for c in entry.get("conditions") or []}
        controller = entry.get("controllerName")
        source = f"{parent_name} ({controller})" if controller else parent_name
        for kind_of in _PARENT_CONDITIONS:
            cond = by_type.get(kind_of)
            if cond is None:
                unknown = unknown or Verdict(
                    "Unknown", "NoGatewayStatus", f"{name}: {source} has not reported {kind_of}"
                )
                continue
            seen = cond.get("observedGeneration")
            if generation is not None and seen is not None and seen < generation:
                unknown = unknown or Verdict(
                    "Unknown",
                    "StaleGatewayStatus",
                    f"{name}: {source} has not seen generation {generation} yet ({kind_of} "
                    f"is about generation {seen})",
                )
                continue
            reason = cond.get("reason") or ""
            reason = reason if _REASON.match(reason) else f"{kind_of}{cond.get('status')}"
            if cond.get("status") == "False":
                detail = f": {cond['message']}" if cond.get("message") else ""
                return Verdict(
                    "False", reason, f"{name}: {source} says {kind_of}=False ({reason}){detail}"
                )
            if cond.get("status") != "True":
                unknown = unknown or Verdict(
                    "Unknown", reason, f"{name}: {source} says {kind_of}=Unknown ({reason})"
                )
    if unknown is not None:
        return unknown
    return Verdict("True", "Accepted", f"{name}: accepted by {parent_name}")


def gateway_verdict(gateway: GatewayObservation) -> Verdict:
    """The gateway's verdict on the graph: False if it refused the HTTPRoute or the
    InferencePool, else Unknown if either lacks current status, else True."""
    verdicts = [
        _object_verdict("HTTPRoute", gateway.route, gateway, section=True),
        _object_verdict("InferencePool", gateway.pool, gateway, section=False),
    ]
    for status in ("False", "Unknown"):
        found = [v for v in verdicts if v.status == status]
        if found:
            return Verdict(status, found[0].reason, "; ".join(v.message for v in found))
    return Verdict("True", "Accepted", "; ".join(v.message for v in verdicts))


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
    status: str,
    reason: str,
    message: str,
    previous: dict[str, dict[str, Any]],
    generation: int | None,
    now: str,
) -> Condition:
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
    gateway: GatewayObservation | None = None,
) -> DynamoGraphStatus:
    """The status for the observed services and problems; `previous` keeps transition times.
    With `gateway`, a GatewayAccepted condition too (see the module's docstring)."""
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
        status = "True" if ok else "False"
        return _condition(kind, status, reason, message, previous_conditions, generation, now)

    verdict = gateway_verdict(gateway) if gateway is not None else None
    degraded_reason = problems[0].reason if problems else "AsExpected"
    degraded_message = "; ".join(p.message for p in problems) if problems else "no problems found"
    if verdict is not None and verdict.status == "False":
        degraded_message += f"; the gateway does not accept the graph: {verdict.message}"
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
    if verdict is not None:
        conditions.append(
            _condition(
                GATEWAY_ACCEPTED,
                verdict.status,
                verdict.reason,
                verdict.message,
                previous_conditions,
                generation,
                now,
            )
        )
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


def gateway_rejection(status: dict[str, Any] | None) -> str | None:
    """The GatewayAccepted condition's message when it is False (what an Event repeats)."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == GATEWAY_ACCEPTED and cond.get("status") == "False":
            return cond.get("message")
    return None


def degraded_message(status: dict[str, Any] | None) -> str | None:
    """The Degraded condition's message when it is True (what an Event repeats), else None."""
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("status") == "True":
            return cond.get("message")
    return None
