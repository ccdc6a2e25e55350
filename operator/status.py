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

`status.endpoint` is a URL only when one answers a plain request, and a sixth condition,
EndpointAssigned, says where it came from or why there is none (`endpoint_verdict`): with a
Gateway, the Gateway's own address, listener port and scheme (GatewayAddressPending until its
controller has written `status.addresses`); without one, the frontend Service when a standalone
frontend routes requests (the workers' sidecars alone refuse what no endpoint picker routed).
Like GatewayAccepted, it gates nothing.
"""

import ipaddress
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


def _parent_condition_verdict(
    name: str, source: str, kind_of: str, cond: dict[str, Any] | None, generation: int | None
) -> Verdict | None:
    """The verdict of one condition (Accepted or ResolvedRefs) a gateway controller wrote for
    the parent; None when it is True and current."""
    if cond is None:
        return Verdict("Unknown", "NoGatewayStatus", f"{name}: {source} has not reported {kind_of}")
    seen = cond.get("observedGeneration")
    if generation is not None and seen is not None and seen < generation:
        return Verdict(
            "Unknown",
            "StaleGatewayStatus",
            f"{name}: {source} has not seen generation {generation} yet ({kind_of} "
            f"is about generation {seen})",
        )
    reason = cond.get("reason") or ""
    reason = reason if _REASON.match(reason) else f"{kind_of}{cond.get('status')}"
    if cond.get("status") == "False":
        detail = f": {cond['message']}" if cond.get("message") else ""
        return Verdict("False", reason, f"{name}: {source} says {kind_of}=False ({reason}){detail}")
    if cond.get("status") != "True":
        return Verdict("Unknown", reason, f"{name}: {source} says {kind_of}=Unknown ({reason})")
    return None


def _object_verdict(
    kind: str, obj: dict[str, Any] | None, gateway: GatewayObservation, section: bool
) -> Verdict:
    """The gateway's verdict on one object (HTTPRoute or InferencePool) for the spec's parent:
    the first refusal, else the first condition not yet known, else accepted."""
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
    verdicts = []
    for entry in entries:
        by_type = {c.get("type"): c for c in entry.get("conditions") or []}
        controller = entry.get("controllerName")
        source = f"{parent_name} ({controller})" if controller else parent_name
        for kind_of in _PARENT_CONDITIONS:
            verdict = _parent_condition_verdict(
                name, source, kind_of, by_type.get(kind_of), generation
            )
            if verdict is not None:
                verdicts.append(verdict)
    for status in ("False", "Unknown"):
        found = next((v for v in verdicts if v.status == status), None)
        if found is not None:
            return found
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


# ---- status.endpoint: the URL a client can curl ------------------------------------------

ENDPOINT_ASSIGNED = "EndpointAssigned"
# Listener protocols an HTTPRoute attaches to, and the URL scheme of each.
_SCHEMES = {"HTTP": "http", "HTTPS": "https"}
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Gateway address types a URL can be made of (Gateway API core; others are implementation's).
_URL_ADDRESS_TYPES = ("IPAddress", "Hostname")


@dataclass(frozen=True)
class EndpointObservation:
    """What the graph's client URL is made of.

    Without a gateway (`parent` None): the in-cluster URL of the graph's frontend Service and
    whether a standalone frontend serves it (`frontend_routes`); otherwise the Service reaches
    only the workers' direct-mode sidecars, which refuse a request the endpoint picker has not
    routed. With one: the spec's parentRef, the HTTPRoute's hostnames, and the Gateway as read
    (None: it does not exist) or why it could not be read (`error`)."""

    namespace: str
    frontend_url: str
    frontend_routes: bool = False
    parent: dict[str, Any] | None = None
    hostnames: tuple[str, ...] = ()
    gateway: dict[str, Any] | None = None
    error: str | None = None


def _host_matches(pattern: str, host: str) -> bool:
    """Gateway API hostname matching: `*.example.com` matches `a.example.com` and
    `a.b.example.com` (and wildcards under it), not `example.com`."""
    if pattern == host:
        return True
    if pattern.startswith("*."):
        suffix = pattern[1:]
        return host.endswith(suffix) and len(host) > len(suffix)
    return False


def route_hostnames(listener: str | None, route: tuple[str, ...]) -> list[str] | None:
    """The hostnames a request must carry to match the route on this listener: [] for any,
    None when the route cannot attach to it (no hostname in common)."""
    if not route:
        return [listener] if listener else []
    if not listener:
        return list(route)
    common = []
    for host in route:
        if _host_matches(listener, host):
            common.append(host)
        elif _host_matches(host, listener):
            common.append(listener)
    return list(dict.fromkeys(common)) or None


def _admits_route(listener: dict[str, Any], gateway_ns: str, route_ns: str) -> bool:
    """Whether the listener's allowedRoutes admit an HTTPRoute from `route_ns` (a namespace
    selector cannot be judged here: the gateway's own verdict is GatewayAccepted)."""
    allowed = listener.get("allowedRoutes") or {}
    kinds = allowed.get("kinds")
    if kinds and not any(
        k.get("kind") == "HTTPRoute" and (k.get("group") or GATEWAY_GROUP) == GATEWAY_GROUP
        for k in kinds
    ):
        return False
    origin = (allowed.get("namespaces") or {}).get("from") or "Same"
    return origin != "Same" or gateway_ns == route_ns


def _listener_text(listener: dict[str, Any]) -> str:
    return f"{listener.get('name')} ({listener.get('protocol')} {listener.get('port')})"


def _url(scheme: str, host: str, port: Any) -> str:
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a hostname
    if isinstance(port, int) and port != _DEFAULT_PORTS[scheme]:
        return f"{scheme}://{host}:{port}"
    return f"{scheme}://{host}"


def _gateway_address(gateway: dict[str, Any]) -> str | None:
    for address in (gateway.get("status") or {}).get("addresses") or []:
        if (address.get("type") or "IPAddress") in _URL_ADDRESS_TYPES and address.get("value"):
            return str(address["value"])
    return None


def _programmed(gateway: dict[str, Any]) -> str:
    """What the Gateway's Programmed condition says, when it is not True (why no address)."""
    for cond in (gateway.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Programmed" and cond.get("status") != "True":
            detail = f": {cond['message']}" if cond.get("message") else ""
            return (
                f"; its Programmed condition is {cond.get('status')} ({cond.get('reason')}){detail}"
            )
    return ""


def _direct_endpoint(obs: EndpointObservation) -> tuple[str | None, Verdict]:
    if obs.frontend_routes:
        return obs.frontend_url, Verdict(
            "True",
            "FrontendService",
            f"{obs.frontend_url}: the graph's frontend Service, in the cluster; its frontends "
            "pick a worker for every request",
        )
    return None, Verdict(
        "False",
        "NoRoutingFrontend",
        f"no URL serves a plain request: {obs.frontend_url} reaches only the workers' frontend "
        "sidecars, which serve requests the endpoint picker routed (any other gets 400 'Worker "
        "ID required'); set gateway.parentRef to serve through a Gateway, or add a service "
        "with componentType: frontend",
    )


def endpoint_verdict(obs: EndpointObservation) -> tuple[str | None, Verdict]:
    """`status.endpoint` and the EndpointAssigned condition: a URL only when one answers.

    With a Gateway: its first IP or hostname address from `status.addresses`, on the first HTTP
    or HTTPS listener the graph's HTTPRoute can attach to (the parentRef's sectionName when set;
    allowedRoutes and hostnames admit it), the listener's scheme and port, and as host the
    first non-wildcard hostname the route matches on that listener when there is one (a request
    must carry it: the URL says so, and the message names the address it must resolve to).
    Until the Gateway has an address: no URL, reason GatewayAddressPending."""
    if obs.parent is None:
        return _direct_endpoint(obs)
    group = obs.parent.get("group") or GATEWAY_GROUP
    kind = obs.parent.get("kind") or "Gateway"
    name = obs.parent.get("name")
    gateway_ns = obs.parent.get("namespace") or obs.namespace
    label = f"Gateway {gateway_ns}/{name}"
    if (group, kind) != (GATEWAY_GROUP, "Gateway"):
        return None, Verdict(
            "Unknown",
            "NotAGateway",
            f"gateway.parentRef is a {kind} ({group}), not a Gateway: no address to report",
        )
    if obs.error is not None:
        return None, Verdict(
            "Unknown", "GatewayUnreadable", f"{label}: cannot read it: {obs.error}"
        )
    if obs.gateway is None:
        return None, Verdict("False", "GatewayNotFound", f"{label} does not exist")
    listeners = (obs.gateway.get("spec") or {}).get("listeners") or []
    section = obs.parent.get("sectionName")
    if section:
        listeners = [item for item in listeners if item.get("name") == section]
        if not listeners:
            return None, Verdict(
                "False", "ListenerNotFound", f"{label} has no listener named {section!r}"
            )
    choices = []
    for listener in listeners:
        if listener.get("protocol") not in _SCHEMES:
            continue
        if not _admits_route(listener, gateway_ns, obs.namespace):
            continue
        hosts = route_hostnames(listener.get("hostname"), obs.hostnames)
        if hosts is not None:
            choices.append((listener, hosts))
    if not choices:
        known = ", ".join(_listener_text(item) for item in listeners) or "none"
        return None, Verdict(
            "False",
            "NoMatchingListener",
            f"{label} has no HTTP or HTTPS listener the graph's HTTPRoute can attach to "
            f"(hostnames {list(obs.hostnames) or 'any'}, namespace {obs.namespace}; "
            f"listeners: {known})",
        )
    listener, hosts = choices[0]
    scheme = _SCHEMES[listener["protocol"]]
    port = listener.get("port")
    concrete = [h for h in hosts if not h.startswith("*")]
    address = _gateway_address(obs.gateway)
    if address is None:
        return None, Verdict(
            "False",
            "GatewayAddressPending",
            f"{label} has no address yet (its status.addresses is empty){_programmed(obs.gateway)}",
        )
    where = f"{label}, listener {_listener_text(listener)}"
    if hosts and not concrete:
        return None, Verdict(
            "False",
            "WildcardHostname",
            f"the route matches only the hostnames {hosts} on {where} at {address}: a URL needs "
            "one name under them (set gateway.hostnames to it)",
        )
    if concrete:
        url = _url(scheme, concrete[0], port)
        resolve = f"{concrete[0]}:{port}:{address}"
        return url, Verdict(
            "True",
            "GatewayAddress",
            f"{url}: {where} at {address}; the route matches host {concrete[0]}, which must "
            f"resolve to {address} (or: curl --resolve {resolve} {url}/v1/models)",
        )
    url = _url(scheme, address, port)
    return url, Verdict("True", "GatewayAddress", f"{url}: the address of {where}")


def _kept_endpoint(
    previous: dict[str, Any] | None, previous_conditions: dict[str, dict[str, Any]]
) -> tuple[str | None, Verdict | None]:
    """The endpoint and its condition as the last pass wrote them (an invalid spec says
    nothing new about where the graph's running objects answer)."""
    before = previous_conditions.get(ENDPOINT_ASSIGNED)
    verdict = None
    if before and before.get("status") and _REASON.match(before.get("reason") or ""):
        verdict = Verdict(before["status"], before["reason"], before.get("message") or "")
    endpoint = (previous or {}).get("endpoint")
    return (endpoint if isinstance(endpoint, str) else None), verdict


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


def failed_rollouts(services: dict[str, ServiceObservation]) -> list[Problem]:
    """A problem per Deployment that gave up its rollout."""
    problems = []
    for name, obs in services.items():
        failure = _deployment_failure(obs.deployment)
        if failure:
            problems.append(Problem("DeploymentFailed", f"{name}: {failure}"))
    return problems


def pending_rollouts(services: dict[str, ServiceObservation]) -> dict[str, str]:
    """Service -> what its rollout still waits for, for every service not rolled out."""
    pending = {}
    for name, obs in services.items():
        done, detail = _rollout_done(obs)
        if not done:
            pending[name] = detail
    return pending


def unavailable_services(
    services: dict[str, ServiceObservation], per_service: dict[str, ServiceStatus]
) -> list[str]:
    """`name: 0/N available` for every service that wants pods and has none available."""
    return [
        f"{name}: 0/{obs.desired} available"
        for name, obs in services.items()
        if obs.desired > 0 and per_service[name].available_replicas < 1
    ]


def _holds(ok: bool) -> str:
    return "True" if ok else "False"


def degraded_verdict(problems: list[Problem], gateway: Verdict | None) -> Verdict:
    """Degraded: True with the first problem's reason when there is any problem. A gateway's
    rejection is named in the message but does not make the graph Degraded by itself."""
    reason = problems[0].reason if problems else "AsExpected"
    message = "; ".join(p.message for p in problems) if problems else "no problems found"
    if gateway is not None and gateway.status == "False":
        message += f"; the gateway does not accept the graph: {gateway.message}"
    return Verdict(_holds(bool(problems)), reason, message)


def ready_verdict(degraded: Verdict, pending: dict[str, str]) -> Verdict:
    """Ready: nothing degraded and every rollout done; else why not (the problems first)."""
    if degraded.status == "True":
        return Verdict("False", "NotReady", degraded.message)
    if pending:
        return Verdict("False", "NotReady", _progress_message(pending))
    return Verdict("True", "AllReplicasReady", "every service is up to date and ready")


def available_verdict(unavailable: list[str]) -> Verdict:
    """Available: every service that wants pods has one available."""
    if unavailable:
        return Verdict("False", "ServicesUnavailable", "; ".join(unavailable))
    return Verdict("True", "MinimumReplicasAvailable", "every service has an available pod")


def progressing_verdict(pending: dict[str, str]) -> Verdict:
    """Progressing: some rollout is not done yet."""
    if pending:
        return Verdict("True", "RollingOut", _progress_message(pending))
    return Verdict("False", "RolloutComplete", "every Deployment is rolled out")


def _progress_message(pending: dict[str, str]) -> str:
    return "; ".join(f"{name}: {detail}" for name, detail in sorted(pending.items()))


def graph_state(degraded: bool, pending: bool, ready_pods: int) -> GraphState:
    """The one-word state: failed (degraded), ready, pending (no pod ready yet), progressing."""
    if degraded:
        return GraphState.FAILED
    if not pending:
        return GraphState.READY
    return GraphState.PENDING if ready_pods == 0 else GraphState.PROGRESSING


def _conditions_by_type(previous: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {
        c["type"]: c
        for c in (previous or {}).get("conditions") or []
        if isinstance(c, dict) and isinstance(c.get("type"), str)
    }


def _condition(
    kind: str,
    verdict: Verdict,
    previous: dict[str, dict[str, Any]],
    generation: int | None,
    now: str,
) -> Condition:
    """The condition for `verdict`; its transition time is kept while its status is unchanged."""
    before = previous.get(kind)
    unchanged = before and before.get("status") == verdict.status
    since = before.get("lastTransitionTime") if before and unchanged else None
    return Condition(
        type=kind,
        status=verdict.status,
        reason=verdict.reason,
        message=verdict.message,
        last_transition_time=since or now,
        observed_generation=generation,
    )


def graph_status(
    services: dict[str, ServiceObservation],
    problems: list[Problem],
    *,
    generation: int | None,
    previous: dict[str, Any] | None,
    endpoint: EndpointObservation | str | None,
    now: str,
    gateway: GatewayObservation | None = None,
) -> DynamoGraphStatus:
    """The status for the observed services and problems; `previous` keeps transition times.
    With `gateway`, a GatewayAccepted condition too (see the module's docstring).

    `endpoint`: what the client URL is made of (an EndpointAssigned condition says what came of
    it, see `endpoint_verdict`), or a URL as it is, or None to keep the previous status's (the
    spec is invalid: the running objects still answer where they did)."""
    per_service = {name: service_status(obs) for name, obs in services.items()}
    problems = [*problems, *failed_rollouts(services)]
    pending = pending_rollouts(services)
    accepted = gateway_verdict(gateway) if gateway is not None else None
    degraded = degraded_verdict(problems, accepted)
    verdicts = {
        "Ready": ready_verdict(degraded, pending),
        "Available": available_verdict(unavailable_services(services, per_service)),
        "Progressing": progressing_verdict(pending),
        "Degraded": degraded,
    }
    if accepted is not None:
        verdicts[GATEWAY_ACCEPTED] = accepted
    previous_conditions = _conditions_by_type(previous)
    reach: Verdict | None
    if isinstance(endpoint, EndpointObservation):
        url, reach = endpoint_verdict(endpoint)
    elif endpoint is None:
        url, reach = _kept_endpoint(previous, previous_conditions)
    else:
        url, reach = endpoint, None
    if reach is not None:
        verdicts[ENDPOINT_ASSIGNED] = reach
    ready_pods = sum(s.ready_replicas for s in per_service.values())
    return DynamoGraphStatus(
        observed_generation=generation,
        state=graph_state(bool(problems), bool(pending), ready_pods),
        conditions=[
            _condition(kind, verdict, previous_conditions, generation, now)
            for kind, verdict in verdicts.items()
        ],
        services=per_service,
        replicas=sum(s.replicas for s in per_service.values()),
        ready_replicas=ready_pods,
        endpoint=url,
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
