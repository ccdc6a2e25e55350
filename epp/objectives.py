"""GAIE InferenceObjectives: the priority a request gets from the objective it names.

A client names its objective with the `x-gateway-inference-objective` header (GAIE's
convention: the value is the InferenceObjective's `metadata.name`). The EPP keeps the
objectives of its own pool (`spec.poolRef.name` = `--pool-name`, in its namespace) in an
`ObjectiveTable`, fed by a watch of the Kubernetes API (`router.discovery.KubernetesWatch`
with the `kubernetes_asyncio` client, `objective_watch`) and/or a static mapping from the
command line (`--objective NAME=PRIORITY`, for runs without a cluster). `spec.priority` unset,
an objective the EPP does not know, or no header: priority 0, as GAIE treats them. The router
queue serves a higher priority first; a negative one is sheddable (`router.waiting`).
"""

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from dynamograph.router.discovery import KubernetesWatch, pod_key

log = logging.getLogger(__name__)

GROUP = "inference.networking.x-k8s.io"
VERSION = "v1alpha2"
PLURAL = "inferenceobjectives"
POOL_GROUP = "inference.networking.k8s.io"  # poolRef.group's default
POOL_KIND = "InferencePool"  # poolRef.kind's default


@dataclass(frozen=True, slots=True)
class Objective:
    key: str  # namespace/name
    name: str
    priority: int


def objective_of(pool: str) -> Callable[[dict[str, Any]], Objective | None]:
    """What an InferenceObjective (API JSON) stands for: its priority, when it refers to `pool`
    (an InferencePool of GAIE's group: the defaults of `poolRef`); None otherwise."""

    def target(obj: dict[str, Any]) -> Objective | None:
        spec = obj.get("spec") or {}
        ref = spec.get("poolRef") or {}
        if (
            ref.get("name") != pool
            or (ref.get("group") or POOL_GROUP) != POOL_GROUP
            or (ref.get("kind") or POOL_KIND) != POOL_KIND
        ):
            return None
        priority = spec.get("priority")
        name = (obj.get("metadata") or {}).get("name", "")
        return Objective(pod_key(obj), name, priority if isinstance(priority, int) else 0)

    return target


def parse_objective_flag(value: str) -> tuple[str, int]:
    """`NAME=PRIORITY` → (name, priority); ValueError naming the flag otherwise."""
    name, sep, priority = value.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name, int(priority)
    except ValueError:
        raise ValueError(f"--objective takes NAME=PRIORITY (an integer), not {value!r}") from None


class ObjectiveTable:
    """The priorities of the pool's objectives by name: the watch's (a `Sink` of `Objective`)
    over the static mapping's."""

    def __init__(self, static: Mapping[str, int] | None = None) -> None:
        self.static = dict(static or {})
        self._watched: dict[str, Objective] = {}  # by namespace/name
        self._by_name: dict[str, int] = dict(self.static)

    def priority(self, name: str | None) -> int:
        """The priority of the objective `name` (the request's header); 0 when unknown."""
        if not name:
            return 0
        return self._by_name.get(name, 0)

    # -- the watch's Sink --
    def sync(self, targets: Iterable[Objective]) -> None:
        self._watched = {t.key: t for t in targets}
        self._reindex()

    def upsert(self, target: Objective) -> None:
        self._watched[target.key] = target
        self._reindex()

    def remove(self, key: str) -> None:
        if self._watched.pop(key, None) is not None:
            self._reindex()

    def _reindex(self) -> None:
        self._by_name = {**self.static, **{o.name: o.priority for o in self._watched.values()}}
        log.info("inference objectives: %s", self._by_name)


def _list_objectives(api: Any) -> Callable[..., Any]:
    from kubernetes_asyncio import client

    custom = client.CustomObjectsApi(api)

    def list_call(namespace: str, **kwargs: Any) -> Any:
        return custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, **kwargs)

    return list_call


def objective_watch(
    namespace: str, pool: str, configuration: Any = None, **options: Any
) -> KubernetesWatch[Objective]:
    """The watch of the InferenceObjectives of `pool` in `namespace` (run it with a table)."""
    return KubernetesWatch(
        namespace,
        _list_objectives,
        objective_of(pool),
        what="inferenceobjective",
        configuration=configuration,
        **options,
    )
