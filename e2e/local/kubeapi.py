"""A small async Kubernetes REST client for the e2e test infrastructure (kubelet, GC, gateway).

Plain JSON over aiohttp against any API server (here the kmock emulator): list, get, create,
merge-patch, delete. The components under test use their real clients (kopf,
kubernetes_asyncio); this one belongs to the test's stand-ins for kubelet and controllers,
which only need the REST basics.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml


@dataclass(frozen=True)
class Resource:
    """An API resource: group ('' for core), version, plural."""

    group: str
    version: str
    plural: str


DEPLOYMENTS = Resource("apps", "v1", "deployments")
PODS = Resource("", "v1", "pods")
SERVICES = Resource("", "v1", "services")
CONFIGMAPS = Resource("", "v1", "configmaps")
SECRETS = Resource("", "v1", "secrets")
INFERENCEPOOLS = Resource("inference.networking.k8s.io", "v1", "inferencepools")
DYNAMOGRAPHS = Resource("dynamograph.io", "v1alpha1", "dynamographs")


def resource_path(
    resource: Resource,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The REST path: /api/v1/namespaces/ns/pods/name/status, /apis/apps/v1/deployments, ..."""
    base = (
        f"/apis/{resource.group}/{resource.version}"
        if resource.group
        else f"/api/{resource.version}"
    )
    if namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{resource.plural}"
    if name:
        base += f"/{name}"
        if subresource:
            base += f"/{subresource}"
    elif subresource:
        raise ValueError("a subresource needs an object name")
    return base


def kubeconfig(server: str, namespace: str = "default") -> dict[str, Any]:
    """A kubeconfig for an unauthenticated API server at `server` (the emulator)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server}}],
        "users": [{"name": "e2e", "user": {"token": "e2e"}}],
        "contexts": [
            {"name": "e2e", "context": {"cluster": "e2e", "user": "e2e", "namespace": namespace}}
        ],
        "current-context": "e2e",
    }


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump(kubeconfig(server)))
    return path


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str):
        self.status = status
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")


class KubeApi:
    """JSON REST calls against one API server. Use as an async context manager."""

    def __init__(self, server: str):
        self.server = server.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "KubeApi":
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        assert self._session is not None, "KubeApi used outside `async with`"
        data = None if body is None else orjson.dumps(body)
        headers = {"content-type": content_type} if data is not None else {}
        async with self._session.request(
            method, self.server + path, data=data, headers=headers
        ) as response:
            raw = await response.read()
            if response.status >= 400:
                raise ApiError(response.status, method, path, raw.decode(errors="replace"))
            return orjson.loads(raw) if raw else None

    async def list(self, resource: Resource, namespace: str | None = None) -> list[dict]:
        """Items of a resource (all namespaces when `namespace` is None); [] when the server
        does not serve the resource at all (no such CRD, or nothing stored yet)."""
        try:
            body = await self._call("GET", resource_path(resource, namespace))
        except ApiError as exc:
            if exc.status == 404:
                return []
            raise
        return list((body or {}).get("items") or [])

    async def get(self, resource: Resource, namespace: str | None, name: str) -> dict | None:
        try:
            return await self._call("GET", resource_path(resource, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, resource: Resource, namespace: str | None, obj: dict) -> dict:
        return await self._call("POST", resource_path(resource, namespace), obj)

    async def patch(
        self,
        resource: Resource,
        namespace: str | None,
        name: str,
        patch: dict,
        subresource: str | None = None,
    ) -> dict:
        return await self._call(
            "PATCH",
            resource_path(resource, namespace, name, subresource),
            patch,
            content_type="application/merge-patch+json",
        )

    async def delete(self, resource: Resource, namespace: str | None, name: str) -> bool:
        """Delete; False when the object was already gone."""
        try:
            await self._call("DELETE", resource_path(resource, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True
