"""A small async Kubernetes REST client for the objects a graph owns (aiohttp, JSON merge patch).

kopf watches and patches the DynamoGraph itself; this client does the rest: list, create, patch
and delete the owned objects, and patch the graph's status. It knows only the kinds it is given
in RESOURCES. Credentials come from `login`, the same function kopf's login handler calls, so
kopf and this client act as one identity; they are re-read once on a 401 (rotated service
account tokens, expired exec-plugin tokens).

One Kubernetes client stack for the operator process: kopf's. kopf talks to the API with
aiohttp and a `kopf.ConnectionInfo`; this client is the same transport with the same
ConnectionInfo, so there is one HTTP stack and one identity, and owned objects stay plain JSON
dicts (what the pure modules build and compare). The official `kubernetes` package is a library
here, never an API client: kopf's `login_via_client` uses its kubeconfig loader (exec plugins,
auth providers) and `manifests` reads PodSpec's field names from its model. `kubernetes_asyncio`
is not used by the operator (it is the EPP's and frontend's pod discovery client).
"""

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

import aiohttp
import kopf
import orjson

from dynamograph.protocol.graph import API_VERSION, KIND, PLURAL

log = logging.getLogger(__name__)

# (apiVersion, kind) -> plural resource name.
RESOURCES: dict[tuple[str, str], str] = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitors",
    ("v1", "Service"): "services",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("apps/v1", "Deployment"): "deployments",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
    # read only: a graph's status.endpoint is its Gateway's address
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateways",
    (API_VERSION, KIND): PLURAL,
    # cluster-scoped: the operator applies its own CRD on start (operator/crd_upgrade.py)
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"): "customresourcedefinitions",
    # cluster-scoped: a pass reads its graph's namespace (is it being deleted?)
    ("v1", "Namespace"): "namespaces",
    # kopf's peering objects, read once at startup to say when one is missing.
    ("kopf.dev/v1", "ClusterKopfPeering"): "clusterkopfpeerings",
    ("kopf.dev/v1", "KopfPeering"): "kopfpeerings",
}


# The cause the apiserver's NamespaceLifecycle admission gives when it refuses a create in a
# namespace being deleted (403 Forbidden, "... because it is being terminated").
NAMESPACE_TERMINATING = "NamespaceTerminating"


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, causes: tuple[str, ...] = ()):
        self.status = status
        self.reason = reason
        self.causes = causes  # the reasons in the Status' details.causes
        super().__init__(f"{status} {reason}: {message}")

    @property
    def namespace_terminating(self) -> bool:
        """A create refused because its namespace is being deleted (not RBAC's 403)."""
        return self.status == 403 and NAMESPACE_TERMINATING in self.causes


def collection_path(api_version: str, kind: str, namespace: str | None) -> str:
    """The collection's URL path; namespace None for a cluster-scoped kind."""
    try:
        plural = RESOURCES[api_version, kind]
    except KeyError:
        raise ValueError(f"unknown resource {api_version} {kind}") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return (
        f"{prefix}/{plural}" if namespace is None else f"{prefix}/namespaces/{namespace}/{plural}"
    )


def matches_selector(obj: dict[str, Any], selector: dict[str, str]) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """The operator's credentials, for kopf and `KubeApi` alike.

    kopf's `login_via_client` lets the official `kubernetes` package's loader read them:
    in-cluster service account, else the kubeconfig, including `exec` credential plugins (EKS,
    GKE, OIDC helpers) and auth providers. Blocking: an exec plugin is a subprocess, so async
    callers run this in a thread.
    """
    info = kopf.login_via_client(settings=settings, logger=log)
    if info is None:  # kopf returns None only when `kubernetes` cannot be imported
        raise kopf.LoginError("the kubernetes package (a dependency of dynamograph) is missing")
    return info


def _ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    if info.insecure:
        return False
    context = ssl.create_default_context()
    if info.ca_path:
        context.load_verify_locations(cafile=info.ca_path)
    elif info.ca_data:
        data = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context.load_verify_locations(cadata=data)
    if info.certificate_path and info.private_key_path:
        context.load_cert_chain(info.certificate_path, info.private_key_path)
    return context


def _api_error(status: int, reason: str, payload: bytes) -> ApiError:
    """The apiserver's Status object (reason, message) when the body is one, else the raw text."""
    try:
        body = orjson.loads(payload)
        causes = tuple(c.get("reason", "") for c in (body.get("details") or {}).get("causes", []))
        return ApiError(status, body.get("reason", reason), body.get("message", ""), causes)
    except (orjson.JSONDecodeError, AttributeError):
        return ApiError(status, reason, payload[:200].decode(errors="replace"))


class KubeApi:
    def __init__(self, login: Callable[[], kopf.ConnectionInfo]):
        self._login = login
        self._session: aiohttp.ClientSession | None = None
        self._connecting = asyncio.Lock()  # one login at a time, not one per waiting request

    async def _connect(self) -> aiohttp.ClientSession:
        async with self._connecting:
            if self._session is None:
                # A thread: the login may run an exec credential plugin (a subprocess).
                info = await asyncio.to_thread(self._login)
                self._session = aiohttp.ClientSession(
                    base_url=info.server.rstrip("/") + "/",
                    headers={"Accept": "application/json", **info.as_http_headers()},
                    connector=aiohttp.TCPConnector(ssl=_ssl_context(info)),
                    timeout=aiohttp.ClientTimeout(total=30),
                )
            return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> Any:
        data = None if body is None else orjson.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        for attempt in (1, 2):
            session = await self._connect()
            try:
                async with session.request(
                    method, path.lstrip("/"), data=data, headers=headers, params=params
                ) as response:
                    status, reason, payload = (
                        response.status,
                        response.reason,
                        await response.read(),
                    )
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ApiError(0, "Unreachable", f"{method} {path}: {exc!r}") from exc
            if status == 401 and attempt == 1:
                await self.close()  # credentials rotated: log in again, once
                continue
            if status >= 400:
                raise _api_error(status, reason or "", payload)
            return orjson.loads(payload) if payload else None
        raise ApiError(401, "Unauthorized", f"{method} {path}: refused after logging in again")

    async def list(
        self, api_version: str, kind: str, namespace: str | None, selector: dict[str, str]
    ) -> list[dict[str, Any]]:
        """Objects matching the label selector (checked here too: not every server filters);
        namespace None: in every namespace, or a cluster-scoped kind's."""
        path = collection_path(api_version, kind, namespace)
        query = ",".join(f"{k}={v}" for k, v in selector.items())
        result = await self._request("GET", path, params={"labelSelector": query})
        items = (result or {}).get("items") or []
        out = []
        for item in items:
            if matches_selector(item, selector):
                # List items carry no apiVersion/kind; the caller keys objects by them.
                out.append({"apiVersion": api_version, "kind": kind, **item})
        return out

    async def namespace(self, name: str) -> dict[str, Any] | None:
        """The Namespace `name`, None if there is none. Listed by name, not read: the operator's
        grant on namespaces is the list and watch kopf needs (charts/dynamograph rbac.yaml)."""
        path = collection_path("v1", "Namespace", None)
        result = await self._request("GET", path, params={"fieldSelector": f"metadata.name={name}"})
        items = (result or {}).get("items") or []
        # checked here too: not every server filters
        return next((i for i in items if i.get("metadata", {}).get("name") == name), None)

    async def get(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        try:
            return await self._request(
                "GET", f"{collection_path(api_version, kind, namespace)}/{name}"
            )
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        path = collection_path(obj["apiVersion"], obj["kind"], meta["namespace"])
        return await self._request("POST", path, obj) or obj

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: dict[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        if subresource:
            path += f"/{subresource}"
        return await self._request("PATCH", path, patch, "application/merge-patch+json")

    async def apply(self, obj: dict[str, Any], field_manager: str) -> dict[str, Any]:
        """Server-side apply of `obj` as `field_manager`, taking over fields others manage."""
        meta = obj["metadata"]
        path = f"{collection_path(obj['apiVersion'], obj['kind'], meta.get('namespace'))}/"
        params = {"fieldManager": field_manager, "force": "true"}
        return await self._request(
            "PATCH", path + meta["name"], obj, "application/apply-patch+yaml", params
        )

    async def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        path = f"{collection_path(api_version, kind, namespace)}/{name}"
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        try:
            await self._request("DELETE", path, body)
        except ApiError as exc:
            if exc.status != 404:
                raise
