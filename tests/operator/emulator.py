"""The Kubernetes API emulator for operator and e2e tests: kmock 0.8 plus a small layer.

kmock serves the Kubernetes REST API from memory on 127.0.0.1, but it is not an apiserver. The
layer below (`ClusterEmulator`) adds only what the operator's behaviour depends on:

- object identity: uid, resourceVersion, creationTimestamp on create; resourceVersion on every
  write; `metadata.generation` bumped when `spec` changes (kopf and status rely on these);
- status isolation for kinds with a status subresource: a PATCH to `/status` changes only
  status, a PATCH to the object never does (kopf's peering objects keep status in the object);
- label selectors on list requests (`?labelSelector=a=b,c=d`, equality only);
- a Deployment "controller": after a Deployment's spec changes, its status says the rollout
  finished (all replicas updated, ready, available) — unless `rollouts_complete` is off;
- garbage collection: deleting an object deletes the objects whose ownerReferences name it;
- authentication, when a test sets `required_token`: any other bearer token gets a 401;
- the Namespace collection (`GET /api/v1/namespaces`, which kmock cannot route): an empty list.
  No Namespace objects are kept; the operator, reading a graph's namespace to know whether it
  is being deleted, finds none and goes on.

Still missing, and not needed here: PUT, field selectors, Namespace objects, admission/validation,
server-side apply. Merge patches follow RFC 7386 in kmock.
"""

import datetime
import functools
import itertools
import json
import uuid
from pathlib import Path

import aiohttp.web
import kmock as kmock_lib
import yaml
from kmock._internal import dicts as kmock_dicts
from kmock._internal import enums as kmock_enums

from dynamograph.operator import crds

NAMESPACE = "ns1"
REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DATA = Path(__file__).resolve().parent / "data"


def authorization(request) -> str | None:
    """A recorded request's Authorization header (header names are case-insensitive)."""
    return {k.lower(): v for k, v in request.headers.items()}.get("authorization")


UNAUTHORIZED = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "reason": "Unauthorized",
    "message": "Unauthorized",
    "code": 401,
}
_WRITES = (kmock_enums.action.CREATE, kmock_enums.action.UPDATE, kmock_enums.action.DELETE)


class ClusterEmulator(kmock_lib.KubernetesEmulator):
    rollouts_complete: bool = True
    required_token: str | None = None
    _versions = itertools.count(1000)

    async def __call__(self, raw_request):
        if raw_request.method == "GET" and raw_request.path == "/api/v1/namespaces":
            if self.required_token is not None and not self._authenticated(raw_request):
                return aiohttp.web.json_response(UNAUTHORIZED, status=401)
            return aiohttp.web.json_response(
                {"kind": "NamespaceList", "apiVersion": "v1", "items": []}
            )
        return await super().__call__(raw_request)

    async def _handle(self, request):
        if self.required_token is not None and not self._authenticated(request):
            return aiohttp.web.json_response(UNAUTHORIZED, status=401)
        if request.resource is not None and isinstance(request.data, dict):
            if request.action == kmock_enums.action.CREATE:
                self._stamp_create(request)
            elif request.action == kmock_enums.action.UPDATE and request.name:
                self._stamp_update(request)
        if request.resource is not None and request.action == kmock_enums.action.LIST:
            return await self._list_selected(request)
        response = await super()._handle(request)
        if (
            request.resource is not None
            and request.resource.plural == "deployments"
            and request.action in (kmock_enums.action.CREATE, kmock_enums.action.UPDATE)
        ):
            await self._finish_rollout(request)
        if request.resource is not None and request.action in _WRITES:
            await self._collect_garbage()
        return response

    def _authenticated(self, request) -> bool:
        return authorization(request) == f"Bearer {self.required_token}"

    # -- identity and status isolation ------------------------------------------------------

    def _stamp_create(self, request) -> None:
        meta = request.data.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("namespace", request.namespace)
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta.setdefault(
            "creationTimestamp",
            datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )

    def _stamp_update(self, request) -> None:
        data = request.data
        key = (request.resource, request.namespace, request.name)
        current = (
            self.objects[key].raw if key in self.objects and not self.objects[key].deleted else {}
        )
        if request.subresource == "status":
            for field in [k for k in data if k != "status"]:
                del data[field]
        elif self._has_status_subresource(request.resource):
            data.pop("status", None)
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = str(next(self._versions))
        if "spec" in data and current:
            new = kmock_dicts.patch_dict(dict(current), {"spec": data["spec"]})
            if new.get("spec") != current.get("spec"):
                meta["generation"] = current.get("metadata", {}).get("generation", 1) + 1

    def _has_status_subresource(self, resource) -> bool:
        try:
            return "status" in self.resources[resource].subresources
        except KeyError:
            return False

    # -- label selectors --------------------------------------------------------------------

    async def _list_selected(self, request):
        selector = {}
        for term in filter(None, request.params.get("labelSelector", "").split(",")):
            name, _, value = term.partition("=")
            selector[name] = value
        response = await super()._handle(request)
        if not selector or response.status != 200:
            return response
        body = json.loads(response.body)
        body["items"] = [
            item
            for item in body.get("items", [])
            if all(
                (item.get("metadata", {}).get("labels") or {}).get(k) == v
                for k, v in selector.items()
            )
        ]
        return aiohttp.web.json_response(body)

    # -- controllers ------------------------------------------------------------------------

    async def _finish_rollout(self, request) -> None:
        if not self.rollouts_complete or request.subresource == "status":
            return
        name = request.name or request.data.get("metadata", {}).get("name")
        key = (request.resource, request.namespace, name)
        obj = self.objects[key]
        if obj.deleted:
            return
        raw = obj.raw
        replicas = raw.get("spec", {}).get("replicas", 1)
        status = {
            "observedGeneration": raw["metadata"].get("generation", 1),
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        if raw.get("status") == status:
            return
        async with self._lock:
            obj.patch(
                {"status": status, "metadata": {"resourceVersion": str(next(self._versions))}}
            )
            await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})

    async def _collect_garbage(self) -> None:
        """Delete objects whose owners are all gone, as Kubernetes' garbage collector does."""
        live = {
            o.raw.get("metadata", {}).get("uid") for o in self.objects.values() if not o.deleted
        }
        for (resource, _, _), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            owners = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if owners and not any(ref.get("uid") in live for ref in owners):
                async with self._lock:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[resource].put({"type": "DELETED", "object": raw})


UPSTREAM_CRDS = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
    "Gateway": "gateway.networking.k8s.io_gateways.yaml",
}


KOPF_PEERING_CRDS = REPO / "crds" / "kopfpeerings.kopf.dev.yaml"


@functools.cache
def upstream_crd(kind: str) -> dict:
    """An upstream CRD from the test data (parsed once: the HTTPRoute CRD is 400 kB of YAML)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((DATA / "upstream-crds" / UPSTREAM_CRDS[kind]).read_text(), Loader=loader)


def declare_resources(emulator, without: tuple[str, ...] = ()) -> None:
    """Builtin kinds plus the CRDs the operator uses (but the kinds `without`) and kopf's
    peering CRDs, as the real cluster's discovery shows them."""
    emulator.resources.load_bundled()
    all_verbs = {"get", "list", "watch", "create", "patch", "update", "delete"}
    upstream = [upstream_crd(kind) for kind in UPSTREAM_CRDS if kind not in without]
    peering = list(yaml.safe_load_all(KOPF_PEERING_CRDS.read_text()))
    for crd in [crds.build_crd(), *upstream, *peering]:
        spec = crd["spec"]
        for version in spec["versions"]:
            if not version.get("served"):
                continue
            key = f"{spec['group']}/{version['name']}/{spec['names']['plural']}"
            emulator.resources[key] = kmock_lib.ResourceInfo(
                kind=spec["names"]["kind"],
                singular=spec["names"]["singular"],
                namespaced=spec["scope"] == "Namespaced",
                verbs=all_verbs,
                shortnames=set(spec["names"].get("shortNames", [])),
                subresources=set(version.get("subresources", {})),
            )


def write_kubeconfig(path: Path, server: str, user: dict | None = None) -> Path:
    """A kubeconfig with one context: the emulator at `server`, as `user` (e.g. {"token": …})."""
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": server}}],
                "users": [{"name": "emulator", "user": user or {}}],
                "contexts": [
                    {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}
                ],
            }
        )
    )
    return path
