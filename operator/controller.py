"""One reconcile pass for one graph: read, decide (pure modules), write. The I/O glue.

`sync_graph` is what every kopf handler calls: it validates the graph, builds the desired objects
(`manifests`), makes sure the graph's created-once Secrets exist (its admin token; with
`spec.kvEvents.curve`, its KV-event CURVE keys), lists what the graph owns,
applies the plan (`reconcile`), computes the status
(`status`), patches it when it changed and posts an Event when the graph newly becomes Degraded
or its gateway newly rejects it.
A graph being deleted, or whose namespace is being deleted, is left alone (`being_deleted`):
the apiserver refuses every create in a namespace being deleted, and the namespace controller
removes what is there. A pass the namespace's deletion overtakes stops at the first create so
refused, writing no status and posting no Event.
Idempotent: running it twice in a row changes nothing the second time. Passes for one graph are
serialised by a lock, because the create handler, the timer and Deployment events can overlap.
"""

import asyncio
import datetime
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dynamograph.protocol.graph import (
    API_VERSION,
    KIND,
    ComponentType,
    DynamoGraph,
    GraphError,
    ScaleStatus,
    load_graph,
)
from dynamograph.protocol.kv_curve import key_files
from dynamograph.protocol.launch import HTTP_PORT

from .config import OperatorConfig
from .kube import ApiError, KubeApi
from .manifests import (
    LABEL_GRAPH,
    LABEL_MANAGED_BY,
    LABEL_SERVICE,
    MANAGED_BY,
    Owner,
    admin_token_secret_object,
    deployment_name,
    desired_objects,
    frontend_service_name,
    kv_curve_secret_object,
    object_key,
)
from .reconcile import (
    Action,
    Conflict,
    Create,
    Delete,
    Patch,
    being_deleted,
    merge_patch,
    owned_by,
    plan,
)
from .status import (
    GATEWAY_GROUP,
    EndpointObservation,
    GatewayObservation,
    Problem,
    ServiceObservation,
    degraded_message,
    gateway_rejection,
    graph_status,
    status_body,
)

log = logging.getLogger(__name__)

# Every kind a graph may own, in creation order; the last three come from CRDs that may be absent.
# (Its Secrets are not listed: the operator only creates them, see _ensure_created_once.)
MANAGED_KINDS: list[tuple[str, str]] = [
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
]
# Kinds rendered only where their CRD is served, without a problem where it is not: a cluster
# without the Prometheus Operator simply gets no PodMonitor.
OPTIONAL_KINDS = frozenset({"PodMonitor"})
_CRD_SOURCES = {
    "InferencePool": "the Gateway API Inference Extension CRDs (inference.networking.k8s.io)",
    "HTTPRoute": "the Gateway API CRDs (gateway.networking.k8s.io)",
}

# The Gateway a graph's HTTPRoute attaches to is read (never written): its address is the
# graph's status.endpoint.
GATEWAY_API_VERSION = f"{GATEWAY_GROUP}/v1"

# Posts a Kubernetes Event about the graph: (graph body, reason, message).
Announce = Callable[[dict[str, Any], str, str], None]


@dataclass
class Operator:
    """What the handlers share (kept in kopf's memo)."""

    api: KubeApi
    config: OperatorConfig
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # Graphs with a pass already waiting for the lock: it will read the latest state anyway.
    queued: set[tuple[str, str]] = field(default_factory=set)

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        return self.locks.setdefault((namespace, name), asyncio.Lock())


@dataclass
class Outcome:
    status: dict[str, Any]
    problems: list[Problem]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _verb(action: Create | Patch | Delete) -> str:
    return {Create: "create", Patch: "patch", Delete: "delete"}[type(action)]


def owner_of(body: dict[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def desired_state(
    body: dict[str, Any], owner: Owner, config: OperatorConfig
) -> tuple[DynamoGraph | None, list[dict[str, Any]] | None, list[Problem]]:
    """The validated graph (None if it does not load) and the objects it should own, or the
    problem that the spec is invalid: then no objects (nothing is applied, what runs keeps
    running until the spec is fixed)."""
    graph = None
    try:
        # Validate what the user wrote; status is ours and may come from another version.
        graph = load_graph({k: v for k, v in body.items() if k != "status"})
        return graph, desired_objects(graph, owner, config), []
    except GraphError as exc:
        message = "; ".join(f"{path}: {message}" for path, message in exc.errors)
        return graph, None, [Problem("InvalidSpec", message)]


def missing_crd_problems(desired: list[dict[str, Any]], missing: set[str]) -> list[Problem]:
    """A problem per kind the graph needs whose CRD this cluster does not serve."""
    return [
        Problem(
            "CRDMissing",
            f"{kind}: not served by this cluster; install {_CRD_SOURCES.get(kind, 'its CRD')}",
        )
        for kind in sorted((missing - OPTIONAL_KINDS) & {o["kind"] for o in desired})
    ]


def frontend_endpoint(owner: Owner) -> str:
    """The in-cluster URL of the graph's OpenAI frontend Service."""
    return f"http://{frontend_service_name(owner.name)}.{owner.namespace}.svc:{HTTP_PORT}"


async def reconcile(api: KubeApi, body: dict[str, Any], config: OperatorConfig) -> Outcome:
    """Validate, apply the plan towards the desired objects, and compute the status."""
    owner = owner_of(body)
    graph, desired, problems = desired_state(body, owner, config)
    actual, missing = await _list_owned(api, owner)
    live = {object_key(o): o for o in actual if owned_by(o, owner.uid)}
    wants_route = False
    if desired is not None:
        assert graph is not None  # objects come from a graph that loaded
        problems += await _ensure_admin_token(api, graph, owner)
        if graph.spec.kv_events.curve:
            problems += await _ensure_kv_curve_keys(api, graph, owner)
        problems += missing_crd_problems(desired, missing)
        wants_route = any(o["kind"] == "HTTPRoute" for o in desired)
        servable = [o for o in desired if o["kind"] not in missing]
        problems += await _apply_plan(api, owner, plan(servable, actual, owner.uid), live)
    status = graph_status(
        _observe(graph, owner.name, live),
        problems,
        generation=body["metadata"].get("generation"),
        previous=body.get("status"),
        endpoint=await _observe_endpoint(api, graph, owner),
        now=_now(),
        gateway=_observe_gateway(graph, wants_route, owner, live),
    )
    status.scale = scale_status(graph, owner.name, live)
    return Outcome(status_body(status), problems)


# Graphs (by uid) whose admin-token / KV-event CURVE Secret this process has seen created or
# existing: a pass writes nothing when nothing changed (the resync timer runs every few
# seconds). Bounded by the graphs one operator process meets; a restart checks each graph once
# again.
_admin_tokens_ensured: set[str] = set()
_kv_curve_keys_ensured: set[str] = set()


async def _ensure_created_once(
    api: KubeApi,
    owner: Owner,
    ensured: set[str],
    make: Callable[[], dict[str, Any]],
    what: str,
) -> list[Problem]:
    """Create the Secret `make()` builds (new random content), once per graph and operator
    process, `ensured` remembering the graphs done; a 409 means it exists (made by an earlier
    pass, or beforehand by someone who chose its content), which is fine. Create is the
    operator's only right on Secrets: it never reads one, and the content is never logged."""
    if owner.uid in ensured:
        return []
    secret = make()
    name = secret["metadata"]["name"]
    try:
        await api.create(secret)
    except ApiError as exc:
        if exc.namespace_terminating:
            raise  # no problem of the graph's: the pass stops (sync_graph)
        if exc.status != 409:
            return [Problem("ApplyFailed", f"create Secret {name}: {exc}")]
    else:
        log.info("created Secret %s/%s (%s)", owner.namespace, name, what)
    ensured.add(owner.uid)
    return []


async def _ensure_admin_token(api: KubeApi, graph: DynamoGraph, owner: Owner) -> list[Problem]:
    """The graph's admin-token Secret, with a random token (32 bytes)."""
    return await _ensure_created_once(
        api,
        owner,
        _admin_tokens_ensured,
        lambda: admin_token_secret_object(graph, owner, secrets.token_urlsafe(32)),
        "the graph's admin token",
    )


async def _ensure_kv_curve_keys(api: KubeApi, graph: DynamoGraph, owner: Owner) -> list[Problem]:
    """The graph's KV-event CURVE Secret, with a new server and client key pair (the files
    `dynamograph kv-curve-keys` writes)."""
    return await _ensure_created_once(
        api,
        owner,
        _kv_curve_keys_ensured,
        lambda: kv_curve_secret_object(graph, owner, key_files()),
        "the graph's KV-event CURVE keys",
    )


async def _list_owned(api: KubeApi, owner: Owner) -> tuple[list[dict[str, Any]], set[str]]:
    """Every object of a managed kind labelled as the graph's (owned or not: the plan touches
    only what this graph owns, and reports the rest), and the kinds this cluster lacks."""
    selector = {LABEL_GRAPH: owner.name, LABEL_MANAGED_BY: MANAGED_BY}
    actual: list[dict[str, Any]] = []
    missing: set[str] = set()
    for api_version, kind in MANAGED_KINDS:
        try:
            actual += await api.list(api_version, kind, owner.namespace, selector)
        except ApiError as exc:
            if exc.status != 404:
                raise
            missing.add(kind)
    return actual, missing


async def _apply_plan(
    api: KubeApi,
    owner: Owner,
    actions: list[Action],
    live: dict[tuple[str, str, str], dict[str, Any]],
) -> list[Problem]:
    """Carry out the plan; every action that cannot be done is a problem, not an exception."""
    problems = []
    for action in actions:
        if isinstance(action, Conflict):
            problems.append(Problem("NameConflict", action.message))
            continue
        try:
            await _apply(api, owner.namespace, action, live)
        except ApiError as exc:
            if exc.namespace_terminating:
                raise  # no problem of the graph's: the pass stops (sync_graph)
            if isinstance(action, Create) and exc.status == 409:
                problem = await _adopt_if_ours(api, owner, object_key(action.obj), live)
            else:
                key = object_key(action.obj) if isinstance(action, Create) else action.key
                problem = Problem("ApplyFailed", f"{_verb(action)} {key[1]} {key[2]}: {exc}")
            if problem is not None:
                problems.append(problem)
    return problems


async def _adopt_if_ours(
    api: KubeApi,
    owner: Owner,
    key: tuple[str, str, str],
    live: dict[tuple[str, str, str], dict[str, Any]],
) -> Problem | None:
    """A create answered 409: created meanwhile by this graph's own pass elsewhere (a peered
    replica handing over) is no conflict; anybody else's object is."""
    try:
        existing = await api.get(key[0], key[1], owner.namespace, key[2])
    except ApiError as read:
        return Problem("ApplyFailed", f"create {key[1]} {key[2]}: exists, and reading it: {read}")
    if existing is not None and owned_by(existing, owner.uid):
        live[key] = {"apiVersion": key[0], "kind": key[1], **existing}
        return None
    return Problem("NameConflict", f"{key[1]} {key[2]} exists and is not owned by this graph")


async def _apply(
    api: KubeApi,
    namespace: str,
    action: Create | Patch | Delete,
    live: dict[tuple[str, str, str], dict[str, Any]],
) -> None:
    if isinstance(action, Create):
        key = object_key(action.obj)
        log.info("creating %s %s/%s", key[1], namespace, key[2])
        created = await api.create(action.obj)
        live[key] = {"apiVersion": key[0], "kind": key[1], **created}
    elif isinstance(action, Patch):
        api_version, kind, name = action.key
        log.info("patching %s %s/%s: %s", kind, namespace, name, sorted(action.patch))
        patched = await api.patch(api_version, kind, namespace, name, action.patch)
        live[action.key] = {"apiVersion": api_version, "kind": kind, **patched}
    else:
        api_version, kind, name = action.key
        log.info("deleting %s %s/%s", kind, namespace, name)
        await api.delete(api_version, kind, namespace, name)
        live.pop(action.key, None)


async def _observe_endpoint(
    api: KubeApi, graph: DynamoGraph | None, owner: Owner
) -> EndpointObservation | None:
    """What the graph's client URL is made of (`status.endpoint_verdict`): the Gateway it
    attaches to, as read now, or its frontend Service. None for an invalid spec."""
    if graph is None:
        return None
    frontend = frontend_endpoint(owner)
    routes = bool(graph.spec.services_of(ComponentType.FRONTEND))
    parent = graph.spec.gateway.parent_ref
    if parent is None:
        return EndpointObservation(owner.namespace, frontend, routes)
    gateway, error = None, None
    if (parent.group, parent.kind) == (GATEWAY_GROUP, "Gateway"):
        try:
            gateway = await api.get(
                GATEWAY_API_VERSION, "Gateway", parent.namespace or owner.namespace, parent.name
            )
        except ApiError as exc:  # e.g. RBAC: said in the condition, the pass goes on
            error = str(exc)
    return EndpointObservation(
        owner.namespace,
        frontend,
        routes,
        parent=parent.model_dump(by_alias=True, exclude_none=True),
        hostnames=tuple(graph.spec.gateway.hostnames),
        gateway=gateway,
        error=error,
    )


def _observe_gateway(
    graph: DynamoGraph | None, wants_route: bool, owner: Owner, live: dict
) -> GatewayObservation | None:
    """The graph's HTTPRoute and InferencePool as read, when the spec attaches it to a Gateway."""
    if graph is None or not wants_route or graph.spec.gateway.parent_ref is None:
        return None
    named = {(k[1], k[2]): o for k, o in live.items()}
    return GatewayObservation(
        parent=graph.spec.gateway.parent_ref.model_dump(by_alias=True, exclude_none=True),
        namespace=owner.namespace,
        route=named.get(("HTTPRoute", owner.name)),
        pool=named.get(("InferencePool", owner.name)),
    )


def scale_status(graph: DynamoGraph | None, graph_name: str, live: dict) -> ScaleStatus | None:
    """What /scale reads (operator/crds.py): the scale target's pods, as its Deployment counts
    them, and the label selector of its pods. None without a (valid) target."""
    service = graph.spec.scale_target_service if graph is not None else None
    if service is None:
        return None
    deployment = live.get(("apps/v1", "Deployment", deployment_name(graph_name, service))) or {}
    return ScaleStatus(
        service=service,
        replicas=(deployment.get("status") or {}).get("replicas", 0),
        selector=f"{LABEL_GRAPH}={graph_name},{LABEL_SERVICE}={service}",
    )


def _observe(
    graph: DynamoGraph | None, graph_name: str, live: dict
) -> dict[str, ServiceObservation]:
    """Per service: wanted replicas and its Deployment. With an invalid spec, the services are
    those the existing Deployments belong to, wanting what they already have."""
    deployments = {k[2]: o for k, o in live.items() if k[1] == "Deployment"}
    if graph is not None:
        return {
            name: ServiceObservation(
                desired=spec.replicas, deployment=deployments.get(deployment_name(graph_name, name))
            )
            for name, spec in graph.spec.services.items()
        }
    out = {}
    for dep in deployments.values():
        service = dep.get("metadata", {}).get("labels", {}).get(LABEL_SERVICE)
        if service:
            out[service] = ServiceObservation(
                desired=dep.get("spec", {}).get("replicas", 1), deployment=dep
            )
    return out


async def sync_graph(
    operator: Operator, namespace: str, name: str, announce: Announce, *, coalesce: bool = False
) -> Outcome | None:
    """Reconcile one graph, patch its status if it changed, announce a new degradation.

    The graph is read afresh under the lock: a handler's body may be older than the status the
    previous pass wrote, and comparing with a stale status would rewrite it forever. With
    `coalesce`, a trigger is dropped when a pass is already queued for the graph (a rollout
    sends a burst of Deployment events; one pass after them sees them all).
    """
    key = (namespace, name)
    if coalesce and key in operator.queued:
        return None
    operator.queued.add(key)
    async with operator.lock(namespace, name):
        operator.queued.discard(key)
        body = await operator.api.get(API_VERSION, KIND, namespace, name)
        if body is None or being_deleted(body, await operator.api.namespace(namespace)):
            return None  # gone or going: garbage collection or the namespace's deletion takes all
        try:
            outcome = await reconcile(operator.api, body, operator.config)
        except ApiError as exc:
            if not exc.namespace_terminating:
                raise
            # the namespace was deleted during this pass: nothing to write, nothing to retry
            log.info("graph %s/%s: its namespace is being deleted", namespace, name)
            return None
        previous = body.get("status") or {}
        patch = merge_patch(previous, outcome.status, previous)
        if patch:
            await operator.api.patch(
                API_VERSION, KIND, namespace, name, {"status": patch}, "status"
            )
        message = degraded_message(outcome.status)
        if message and message != degraded_message(previous):
            announce(body, outcome.problems[0].reason if outcome.problems else "Degraded", message)
        rejection = gateway_rejection(outcome.status)
        if rejection and rejection != gateway_rejection(previous):
            announce(body, "GatewayRejected", rejection)
        return outcome


async def sync_owner_of(
    operator: Operator, owned: dict[str, Any], announce: Announce
) -> Outcome | None:
    """Something a graph owns changed (or vanished): reconcile that graph, if it owns it."""
    meta = owned.get("metadata", {})
    graph_name = (meta.get("labels") or {}).get(LABEL_GRAPH)
    if not graph_name:
        return None
    graph = await operator.api.get(API_VERSION, KIND, meta["namespace"], graph_name)
    if graph is None or not owned_by(owned, graph["metadata"]["uid"]):
        return None  # no graph, or a leftover from an earlier graph of the same name
    return await sync_graph(operator, meta["namespace"], graph_name, announce, coalesce=True)
