"""The garbage collector of the cluster-in-a-box: deletes objects whose owners are gone.

kmock has no garbage collector, and the operator (like any Kubernetes operator) relies on
ownerReferences for cleanup: deleting a DynamoGraph must take its Deployments, Services,
ConfigMap, RBAC, InferencePool and HTTPRoute with it (and the kubelet then stops the pods of
the vanished Deployments). Background propagation, as `kubectl delete` does by default.
"""

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from .kubeapi import (
    CONFIGMAPS,
    DEPLOYMENTS,
    DYNAMOGRAPHS,
    HTTPROUTES,
    INFERENCEPOOLS,
    PODS,
    ROLEBINDINGS,
    ROLES,
    SERVICEACCOUNTS,
    SERVICES,
    KubeApi,
    Resource,
)

log = logging.getLogger(__name__)

OWNERS = (DYNAMOGRAPHS, DEPLOYMENTS)
DEPENDENTS = (
    DEPLOYMENTS,
    SERVICES,
    CONFIGMAPS,
    SERVICEACCOUNTS,
    ROLES,
    ROLEBINDINGS,
    INFERENCEPOOLS,
    HTTPROUTES,
    PODS,
)


def orphans(objects: Iterable[dict[str, Any]], live_uids: set[str]) -> list[dict[str, Any]]:
    """Objects with ownerReferences none of whose owners is alive (pure)."""
    out = []
    for obj in objects:
        refs = (obj.get("metadata") or {}).get("ownerReferences") or []
        if refs and not any(ref.get("uid") in live_uids for ref in refs):
            out.append(obj)
    return out


class GarbageCollector:
    def __init__(self, api: KubeApi, interval: float = 0.3):
        self.api = api
        self.interval = interval
        self.deleted: list[str] = []
        self._task: asyncio.Task | None = None

    async def collect(self) -> int:
        live: set[str] = set()
        for resource in OWNERS:
            for obj in await self.api.list(resource):
                meta = obj.get("metadata") or {}
                if meta.get("uid"):
                    live.add(meta["uid"])
        count = 0
        for resource in DEPENDENTS:
            for obj in orphans(await self.api.list(resource), live):
                count += await self._delete(resource, obj)
        return count

    async def _delete(self, resource: Resource, obj: dict[str, Any]) -> int:
        meta = obj["metadata"]
        if await self.api.delete(resource, meta.get("namespace"), meta["name"]):
            self.deleted.append(f"{resource.plural}/{meta.get('namespace')}/{meta['name']}")
            return 1
        return 0

    async def _loop(self) -> None:
        while True:
            try:
                await self.collect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("garbage collector: %r", exc)
            await asyncio.sleep(self.interval)

    async def __aenter__(self) -> "GarbageCollector":
        self._task = asyncio.create_task(self._loop(), name="garbage-collector")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
