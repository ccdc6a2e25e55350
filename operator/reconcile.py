"""Desired objects + observed objects -> the actions that make the cluster agree: pure logic.

Create what is missing, patch what drifted, delete what the graph owns but no longer wants.
Patches are minimal JSON merge patches (RFC 7386): only fields whose desired value differs from
the live one are sent, so a replica-only change patches `spec.replicas` and leaves the pod
template untouched (no rollout), and an image change rewrites one Deployment's containers only.

Removing a field needs to know what we set last time (an apiserver default and a field we set
look alike), so every applied object carries its desired form in the `dynamograph.io/last-applied`
annotation, like kubectl's: a key that was applied last time and is no longer desired is set
to null. Lists are compared as wholes: when the desired list changed, or the live list no longer
contains what we want, it is replaced (merge patch semantics).
"""

import json
from dataclasses import dataclass
from typing import Any

from .manifests import object_key

LAST_APPLIED = "dynamograph.io/last-applied"
# Object metadata we manage; the rest (uid, resourceVersion, finalizers, ...) belongs to others.
_MANAGED_METADATA = ("labels", "annotations", "ownerReferences")

Key = tuple[str, str, str]  # (apiVersion, kind, name)


@dataclass(frozen=True)
class Create:
    obj: dict[str, Any]


@dataclass(frozen=True)
class Patch:
    key: Key
    patch: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    key: Key


@dataclass(frozen=True)
class Conflict:
    """An object of ours by name, but not owned by this graph: left alone and reported."""

    key: Key
    message: str


Action = Create | Patch | Delete | Conflict


def contains(actual: Any, desired: Any) -> bool:
    """Does the live value say everything the desired one says? (apiserver defaults may add more)"""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            k in actual and contains(actual[k], v) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired, strict=True))
        )
    return actual == desired


def merge_patch(actual: Any, desired: Any, last: Any) -> dict[str, Any]:
    """The merge patch that turns `actual` into something `contains(.., desired)`, nulling keys
    that `last` (what we applied before) had and `desired` no longer has. Empty: nothing to do."""
    patch: dict[str, Any] = {}
    last = last if isinstance(last, dict) else {}
    for key, want in desired.items():
        have = actual.get(key)
        if key not in actual:
            patch[key] = want
        elif isinstance(want, dict) and isinstance(have, dict):
            sub = merge_patch(have, want, last.get(key))
            if sub:
                patch[key] = sub
        elif isinstance(want, list):
            # Replace when the live list lacks something, or when it may hold what we stopped
            # wanting (the desired list changed since last time and the live one is not it).
            changed = key in last and last[key] != want and have != want
            if changed or not contains(have, want):
                patch[key] = want
        elif have != want:
            patch[key] = want
    for key in last:
        if key not in desired and key in actual:
            patch[key] = None
    return patch


def _applied_form(obj: dict[str, Any]) -> str:
    """What goes into the last-applied annotation: the desired object, canonical JSON."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    meta = desired["metadata"]
    annotations = {**meta.get("annotations", {}), LAST_APPLIED: _applied_form(desired)}
    return {**desired, "metadata": {**meta, "annotations": annotations}}


def _last_applied(actual: dict[str, Any]) -> dict[str, Any]:
    text = actual.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}  # someone edited it; fall back to a two-way patch
    return value if isinstance(value, dict) else {}


def object_patch(actual: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The patch for one object (metadata we manage, and the body), empty if in sync."""
    want = with_last_applied(desired)
    last = _last_applied(actual)
    patch: dict[str, Any] = {}
    meta_want = {k: v for k, v in want["metadata"].items() if k in _MANAGED_METADATA}
    meta_last = {k: v for k, v in last.get("metadata", {}).items() if k in _MANAGED_METADATA}
    meta = merge_patch(actual.get("metadata", {}), meta_want, meta_last)
    if meta:
        patch["metadata"] = meta
    body_want = {k: v for k, v in want.items() if k not in {"apiVersion", "kind", "metadata"}}
    body_last = {k: v for k, v in last.items() if k not in {"apiVersion", "kind", "metadata"}}
    patch.update(merge_patch(actual, body_want, body_last))
    return patch


def being_deleted(graph: dict[str, Any], namespace: dict[str, Any] | None) -> bool:
    """Is the graph, or the namespace it lives in, being deleted? Then a pass leaves the graph's
    objects alone: the garbage collector or the namespace controller is removing them, and in a
    namespace being deleted the apiserver refuses every create. `namespace` None: no Namespace
    was found, which says nothing (the apiserver sets a namespace's deletionTimestamp, with
    phase Terminating, the moment it is deleted)."""
    return bool(
        graph.get("metadata", {}).get("deletionTimestamp")
        or (namespace or {}).get("metadata", {}).get("deletionTimestamp")
    )


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def plan(desired: list[dict[str, Any]], actual: list[dict[str, Any]], uid: str) -> list[Action]:
    """Actions in order: creates and patches in the desired order, then deletes."""
    live = {object_key(o): o for o in actual}
    wanted = {object_key(o) for o in desired}
    actions: list[Action] = []
    for obj in desired:
        key = object_key(obj)
        current = live.get(key)
        if current is None:
            actions.append(Create(with_last_applied(obj)))
        elif not owned_by(current, uid):
            actions.append(
                Conflict(key, f"{key[1]} {key[2]} exists and is not owned by this graph")
            )
        else:
            patch = object_patch(current, obj)
            if patch:
                actions.append(Patch(key, patch))
    for key, obj in live.items():
        if key not in wanted and owned_by(obj, uid):
            actions.append(Delete(key))
    return actions
