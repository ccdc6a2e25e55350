"""The Kubernetes API server of the cluster-in-a-box: kmock's emulator, plus what it lacks.

kmock 0.8 stores objects and serves list/watch/get/create/patch/delete, but stamps no `uid`,
`resourceVersion`, `generation` or `creationTimestamp` (kopf then retries its first patch
forever, and nothing can own anything). `StampingEmulator` stamps them on the way in, so that
watchers see stamped objects in their events too. `declare_resources` registers the built-in
kinds the graph uses and the project's CRDs (from `crds/`) for API discovery, which kopf needs.
"""

import datetime
import itertools
import uuid
from pathlib import Path
from typing import Any

import attrs
import kmock
import yaml

REPO = Path(__file__).resolve().parent.parent.parent
CRDS = REPO / "crds"

# (group/version/plural, kind, subresources): the built-in kinds a graph's objects use.
BUILTINS = (
    ("apps/v1/deployments", "Deployment", ("status", "scale")),
    ("v1/pods", "Pod", ("status",)),
    ("v1/services", "Service", ("status",)),
    ("v1/configmaps", "ConfigMap", ()),
    ("v1/serviceaccounts", "ServiceAccount", ()),
    ("v1/events", "Event", ()),
    ("events.k8s.io/v1/events", "Event", ()),
    ("rbac.authorization.k8s.io/v1/roles", "Role", ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", ()),
    ("inference.networking.k8s.io/v1/inferencepools", "InferencePool", ("status",)),
    ("gateway.networking.k8s.io/v1/httproutes", "HTTPRoute", ("status",)),
    ("gateway.networking.k8s.io/v1/gateways", "Gateway", ("status",)),
)
CRD_RESOURCE = "apiextensions.k8s.io/v1/customresourcedefinitions"
VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@attrs.define(kw_only=True)
class StampingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator that stamps object identity and versions like an API server."""

    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    async def _handle(self, request: kmock.Request):  # type: ignore[override]
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                meta = data.setdefault("metadata", {})
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", _now())
                meta["generation"] = 1
                meta["resourceVersion"] = str(next(self._versions))
            elif request.action == kmock.action.UPDATE and request.name is not None:
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = str(next(self._versions))
                if "spec" in data and request.subresource is None:
                    current = self._current(request)
                    generation = (current or {}).get("metadata", {}).get("generation", 1)
                    meta["generation"] = int(generation) + 1
        return await super()._handle(request)

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].raw
        return None


def crd_resources(crd: dict[str, Any]) -> list[tuple[str, kmock.ResourceInfo]]:
    """(group/version/plural, discovery info) for every served version of a CRD."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        subresources = tuple(sorted((version.get("subresources") or {}).keys()))
        info = kmock.ResourceInfo(
            kind=names["kind"],
            singular=names.get("singular"),
            shortnames=set(names.get("shortNames") or ()),
            categories=set(names.get("categories") or ()),
            subresources=set(subresources),
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            verbs=set(VERBS),
        )
        out.append((f"{spec['group']}/{version['name']}/{names['plural']}", info))
    return out


def load_crds(directory: Path = CRDS) -> list[dict[str, Any]]:
    crds = []
    for path in sorted(directory.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                crds.append(doc)
    if not crds:
        raise FileNotFoundError(
            f"no CustomResourceDefinition in {directory} (run `dynamograph crds`)"
        )
    return crds


def declare_resources(emulator: kmock.KubernetesEmulator, crds: list[dict[str, Any]]) -> None:
    for key, kind, subresources in BUILTINS:
        emulator.resources[key] = kmock.ResourceInfo(
            kind=kind, namespaced=True, verbs=set(VERBS), subresources=set(subresources)
        )
    # kopf's resource scanner watches CRDs, so they are served as objects too (as if
    # `kubectl apply -f crds/` had run), not only announced in discovery.
    # kopf waits for `namespaces` to appear in discovery before it watches anything, even
    # cluster-wide (where it never lists them).
    emulator.resources["v1/namespaces"] = kmock.ResourceInfo(
        kind="Namespace", namespaced=False, verbs=set(VERBS), subresources={"status"}
    )
    emulator.resources[CRD_RESOURCE] = kmock.ResourceInfo(
        kind="CustomResourceDefinition", namespaced=False, verbs=set(VERBS), subresources={"status"}
    )
    for crd in crds:
        for key, info in crd_resources(crd):
            emulator.resources[key] = info
        emulator.objects[CRD_RESOURCE, None, crd["metadata"]["name"]] = crd
