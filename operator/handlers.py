"""The kopf handlers: thin wrappers that call `controller.sync_graph`.

- create / update (spec) / resume of a DynamoGraph: reconcile now.
- a timer per graph (`resync_seconds`): repair drift and refresh status even if no event came.
- any event of a Deployment the operator manages (including its deletion): reconcile its graph,
  so a deleted Deployment comes back and status follows rollouts as they happen.
- any event of a managed HTTPRoute or InferencePool: the same, so the GatewayAccepted condition
  follows the gateway controller's status writes within seconds (the timer would take up to
  `resync_seconds`). kopf watches these kinds only where their CRDs are installed.
- any event of a Gateway: reconcile every graph whose `gateway.parentRef` names it (an index
  of the graphs by their Gateway), so `status.endpoint` follows the address the gateway
  controller writes into the Gateway's status.

No deletion handler: every object carries an ownerReference, so Kubernetes' garbage collector
deletes them with the graph. (kopf adds its finalizer because timers need one; it removes it
as soon as the graph's timer has stopped. A timer caught in a pass when the graph is deleted
cannot stop at once; kopf then re-checks every `TIMER_STOP_POLL_SECONDS`, not its default 60 s.)

kopf keeps its bookkeeping in annotations, not in status, because the CRD's structural schema
would prune unknown status fields. `build_registry` makes a fresh registry per operator, so the
timer period comes from the configuration and tests can run several operators in one process.
"""

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from dynamograph.protocol.graph import GROUP, PLURAL, VERSION

from .config import OperatorConfig
from .controller import Operator, sync_graph, sync_owner_of
from .crd_upgrade import upgrade_crd, wait_until_served
from .kube import ApiError, KubeApi, login
from .manifests import LABEL_MANAGED_BY, MANAGED_BY, POOL_GROUP
from .status import GATEWAY_GROUP

log = logging.getLogger(__name__)

ANNOTATION_PREFIX = "dynamograph.io"
RETRY_SECONDS = 10
# How soon kopf looks again at a deleted graph whose timer was in the middle of a pass (kopf's
# default, 60 s, held the finalizer, and so the graph and everything it owns, for a minute: the
# pass writes nothing to a deleting graph, so no event wakes kopf earlier).
TIMER_STOP_POLL_SECONDS = 1.0


def plain(value: Any) -> Any:
    """kopf's body views as plain dicts and lists (the pure modules take JSON data)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/operator"
    settings.posting.level = 30  # Events for warnings and errors only, not every log line
    settings.watching.server_timeout = 300
    settings.background.cancellation_polling = TIMER_STOP_POLL_SECONDS


def _announce(body: dict[str, Any], reason: str, message: str) -> None:
    # kopf.warn reads any mapping; its annotation names kopf's own Body class
    kopf.warn(body, reason=reason, message=message)  # type: ignore[arg-type]


def gateway_of(body: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the Gateway a graph's HTTPRoute attaches to, None without one."""
    ref = ((body.get("spec") or {}).get("gateway") or {}).get("parentRef") or {}
    if not ref.get("name") or (ref.get("group") or GATEWAY_GROUP) != GATEWAY_GROUP:
        return None
    if (ref.get("kind") or "Gateway") != "Gateway":
        return None
    return ref.get("namespace") or body["metadata"]["namespace"], ref["name"]


async def _sync(memo: kopf.Memo, body: Mapping[str, Any]) -> None:
    try:
        await sync_graph(
            memo.operator, body["metadata"]["namespace"], body["metadata"]["name"], _announce
        )
    except ApiError as exc:
        raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_SECONDS) from exc


def build_registry(config: OperatorConfig) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        configure(settings)
        memo.operator = Operator(api=KubeApi(lambda: login(settings)), config=config)
        # before any watch starts: graphs are read with the schema this operator was built for
        spec_changed = await upgrade_crd(memo.operator.api)
        await wait_until_served(memo.operator.api, spec_changed=spec_changed)

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "operator", None) is not None:
            await memo.operator.api.close()

    @kopf.on.login(registry=registry)
    def authenticate(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
        return login(settings)  # the same credentials as KubeApi's

    @kopf.on.resume(*resource, id="resume", registry=registry)
    @kopf.on.create(*resource, id="create", registry=registry)
    @kopf.on.update(*resource, field="spec", id="update", registry=registry)
    async def reconcile_graph(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await _sync(memo, body)

    @kopf.timer(
        *resource,
        id="resync",
        interval=config.resync_seconds,
        initial_delay=config.resync_seconds,
        registry=registry,
    )
    async def resync_graph(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        await _sync(memo, body)

    owned = {LABEL_MANAGED_BY: MANAGED_BY}

    @kopf.on.event("apps", "v1", "deployments", labels=owned, registry=registry)
    @kopf.on.event(GATEWAY_GROUP, "v1", "httproutes", labels=owned, registry=registry)
    @kopf.on.event(POOL_GROUP, "v1", "inferencepools", labels=owned, registry=registry)
    async def owned_object(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
        try:
            await sync_owner_of(memo.operator, plain(body), _announce)
        except ApiError as exc:
            # Event handlers are not retried; the graph's timer catches up.
            kopf.warn(body, reason="ReconcileFailed", message=str(exc))

    @kopf.index(*resource, id="graphs_by_gateway", registry=registry)
    def graphs_by_gateway(body: kopf.Body, **_: Any) -> dict[tuple[str, str], tuple[str, str]]:
        gateway = gateway_of(body)
        meta = body["metadata"]
        return {} if gateway is None else {gateway: (meta["namespace"], meta["name"])}

    @kopf.on.event(GATEWAY_GROUP, "v1", "gateways", registry=registry)
    async def gateway_changed(body: kopf.Body, memo: kopf.Memo, **kwargs: Any) -> None:
        index: kopf.Index[tuple[str, str], tuple[str, str]] = kwargs["graphs_by_gateway"]
        key = (body["metadata"]["namespace"], body["metadata"]["name"])
        for namespace, name in list(index.get(key, [])):
            try:
                await sync_graph(memo.operator, namespace, name, _announce, coalesce=True)
            except ApiError as exc:
                # Event handlers are not retried; the graph's timer catches up.
                log.warning(
                    "graph %s/%s, after Gateway %s/%s changed: %s", namespace, name, *key, exc
                )

    return registry
