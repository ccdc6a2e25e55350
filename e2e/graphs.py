"""DynamoGraph manifests for the e2e suites: load an example, patch it, read what it implies.

Pure functions over plain dicts (what `kubectl apply` and the emulator take). Every patch returns
a new manifest and leaves its input alone, so one example can feed several scenarios.
"""

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

ENGINE_TYPES = ("worker", "prefill", "decode")

Manifest = dict[str, Any]


def load_example(name: str) -> Manifest:
    """`examples/<name>.yaml` as a dict (one YAML document)."""
    path = EXAMPLES / f"{name}.yaml"
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    if len(docs) != 1:
        raise ValueError(f"{path}: expected one DynamoGraph document, found {len(docs)}")
    return docs[0]


def _service(graph: Manifest, service: str) -> dict[str, Any]:
    services = graph["spec"]["services"]
    if service not in services:
        raise KeyError(f"graph {graph['metadata']['name']!r} has no service {service!r}")
    return services[service]


def renamed(graph: Manifest, name: str, namespace: str | None = None) -> Manifest:
    out = copy.deepcopy(graph)
    out["metadata"]["name"] = name
    if namespace is not None:
        out["metadata"]["namespace"] = namespace
    return out


def with_replicas(graph: Manifest, service: str, replicas: int) -> Manifest:
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    out = copy.deepcopy(graph)
    _service(out, service)["replicas"] = replicas
    return out


def with_engine(graph: Manifest, **fields: Any) -> Manifest:
    """Set engine arguments (camelCase keys, e.g. speedup=50) on every engine service."""
    out = copy.deepcopy(graph)
    for spec in out["spec"]["services"].values():
        if spec["componentType"] in ENGINE_TYPES:
            spec.setdefault("engine", {}).update(fields)
    return out


def without_gpus(graph: Manifest) -> Manifest:
    """Request no GPUs: mock engines run on any node (a kind node has no nvidia.com/gpu)."""
    out = copy.deepcopy(graph)
    for spec in out["spec"]["services"].values():
        if "gpu" in (spec.get("resources") or {}):
            spec["resources"]["gpu"] = 0
    return out


def with_image(graph: Manifest, image: str) -> Manifest:
    """Run every service from `image` (the kind suite loads the image it just built)."""
    out = copy.deepcopy(graph)
    for spec in out["spec"]["services"].values():
        spec["image"] = image
    return out


def with_gateway(graph: Manifest, gateway: str, namespace: str | None = None) -> Manifest:
    """Attach the graph's HTTPRoute to a Gateway (the operator writes the route)."""
    out = copy.deepcopy(graph)
    ref: dict[str, Any] = {"name": gateway}
    if namespace:
        ref["namespace"] = namespace
    out["spec"].setdefault("gateway", {})["parentRef"] = ref
    return out


def services_of(graph: Manifest, *component_types: str) -> list[str]:
    return [
        name
        for name, spec in graph["spec"]["services"].items()
        if spec["componentType"] in component_types
    ]
