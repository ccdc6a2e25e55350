"""The pure reconcile plan: create missing, patch drifted (minimally), delete unwanted."""

import copy

import pytest
import yaml
from kmock._internal.dicts import merge_patch_dict

from dynamograph.operator.config import OperatorConfig
from dynamograph.operator.manifests import Owner, desired_objects, object_key
from dynamograph.operator.reconcile import (
    LAST_APPLIED,
    Conflict,
    Create,
    Delete,
    Patch,
    being_deleted,
    contains,
    merge_patch,
    object_patch,
    plan,
)
from dynamograph.protocol.graph import load_graph

from .emulator import EXAMPLES

pytestmark = pytest.mark.unit

UID = "graph-uid"
CONFIG = OperatorConfig(image="registry.example/dynamograph:1")


def desired(mutate=None) -> list[dict]:
    body = yaml.safe_load((EXAMPLES / "disagg.yaml").read_text())
    if mutate:
        mutate(body)
    return desired_objects(load_graph(body), Owner("disagg", "ns", UID), CONFIG)


def applied(objects: list[dict]) -> list[dict]:
    """What the apiserver stores after the plan's creates, plus fields it adds itself."""
    out = []
    for action in plan(objects, [], UID):
        assert isinstance(action, Create)
        obj = copy.deepcopy(action.obj)
        obj["metadata"].update(uid=f"uid-{obj['metadata']['name']}", resourceVersion="7")
        if obj["kind"] == "Deployment":
            obj["spec"]["revisionHistoryLimit"] = 10
            obj["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"
            obj["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/x"
            obj["status"] = {"replicas": 2}
        out.append(obj)
    return out


def apply_plan(live: list[dict], actions) -> list[dict]:
    by_key = {object_key(o): o for o in live}
    for action in actions:
        if isinstance(action, Create):
            by_key[object_key(action.obj)] = action.obj
        elif isinstance(action, Patch):
            by_key[action.key] = merge_patch_dict(by_key[action.key], action.patch)
        elif isinstance(action, Delete):
            del by_key[action.key]
    return list(by_key.values())


def deployment_patches(actions) -> dict[str, dict]:
    return {a.key[2]: a.patch for a in actions if isinstance(a, Patch) and a.key[1] == "Deployment"}


def test_everything_is_created_in_order_with_last_applied():
    objects = desired()
    actions = plan(objects, [], UID)
    assert [object_key(a.obj) for a in actions] == [object_key(o) for o in objects]
    for action in actions:
        assert LAST_APPLIED in action.obj["metadata"]["annotations"]


def test_in_sync_despite_server_defaults():
    live = applied(desired())
    assert plan(desired(), live, UID) == []


def test_replica_change_patches_replicas_only():
    live = applied(desired())

    def scale(body):
        body["spec"]["services"]["decode"]["replicas"] = 5

    actions = plan(desired(scale), live, UID)
    patches = deployment_patches(actions)
    assert set(patches) == {"disagg-decode"}
    patch = patches["disagg-decode"]
    assert patch["spec"] == {"replicas": 5}
    assert set(patch["metadata"]) == {"annotations"}
    assert plan(desired(scale), apply_plan(live, actions), UID) == []


def test_image_change_replaces_one_template_only():
    live = applied(desired())

    def new_image(body):
        body["spec"]["services"]["prefill"]["image"] = "registry.example/other:2"

    actions = plan(desired(new_image), live, UID)
    patches = deployment_patches(actions)
    assert set(patches) == {"disagg-prefill"}
    containers = patches["disagg-prefill"]["spec"]["template"]["spec"]["containers"]
    assert containers[0]["image"] == "registry.example/other:2"
    assert "replicas" not in patches["disagg-prefill"]["spec"]
    assert plan(desired(new_image), apply_plan(live, actions), UID) == []


def test_removed_fields_are_nulled_thanks_to_last_applied():
    def with_selector(body):
        body["spec"]["services"]["decode"]["extraPodSpec"] = {"nodeSelector": {"gpu": "h100"}}

    live = applied(desired(with_selector))
    actions = plan(desired(), live, UID)
    patch = deployment_patches(actions)["disagg-decode"]
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None
    after = apply_plan(live, actions)
    decode = next(o for o in after if o["metadata"]["name"] == "disagg-decode")
    assert "nodeSelector" not in decode["spec"]["template"]["spec"]
    # Server-set fields we never applied are left alone.
    assert decode["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirst"
    assert plan(desired(), after, UID) == []


def test_manual_drift_is_reverted():
    live = applied(desired())
    decode = next(o for o in live if o["metadata"]["name"] == "disagg-decode")
    decode["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    decode["metadata"]["labels"]["dynamograph.io/graph"] = "other"
    actions = plan(desired(), live, UID)
    patch = deployment_patches(actions)["disagg-decode"]
    assert patch["metadata"]["labels"] == {"dynamograph.io/graph": "disagg"}
    assert patch["spec"]["template"]["spec"]["containers"][0]["image"] == CONFIG.image
    assert plan(desired(), apply_plan(live, actions), UID) == []


def test_removed_service_is_deleted_and_missing_object_recreated():
    live = applied(desired())
    live = [o for o in live if o["metadata"]["name"] != "disagg-epp" or o["kind"] != "Service"]

    def no_prefill(body):
        del body["spec"]["services"]["prefill"]

    actions = plan(desired(no_prefill), live, UID)
    assert Delete(("apps/v1", "Deployment", "disagg-prefill")) in actions
    creates = [object_key(a.obj) for a in actions if isinstance(a, Create)]
    assert creates == [("v1", "Service", "disagg-epp")]
    assert isinstance(actions[-1], Delete)  # deletes come last


def test_objects_of_others_are_never_touched():
    live = applied(desired())
    stranger = copy.deepcopy(next(o for o in live if o["metadata"]["name"] == "disagg-frontend"))
    stranger["metadata"]["ownerReferences"] = [{"uid": "someone-else", "controller": True}]
    live = [o for o in live if o["metadata"]["name"] != "disagg-frontend"] + [stranger]
    orphan = copy.deepcopy(stranger)
    orphan["metadata"]["name"] = "not-ours"
    actions = plan(desired(), [*live, orphan], UID)
    assert actions == [
        Conflict(
            ("v1", "Service", "disagg-frontend"),
            "Service disagg-frontend exists and is not owned by this graph",
        )
    ]


def test_merge_patch_and_contains():
    assert contains({"a": 1, "b": [{"x": 1, "y": 2}]}, {"b": [{"x": 1}]})
    assert not contains({"b": [{"x": 1}, {"x": 2}]}, {"b": [{"x": 1}]})
    assert merge_patch({"a": 1, "b": 2}, {"a": 1}, {"a": 1, "b": 2}) == {"b": None}
    assert merge_patch({"a": 1, "b": 2}, {"a": 1}, {}) == {}
    assert merge_patch({"m": {"k": 1}}, {"m": {"k": 2}}, {}) == {"m": {"k": 2}}
    assert merge_patch({"l": [1, 2]}, {"l": [1, 2]}, {"l": [1]}) == {}
    assert merge_patch({"l": [1, 2]}, {"l": [1, 3]}, {}) == {"l": [1, 3]}


def test_corrupt_last_applied_falls_back_to_two_way():
    live = applied(desired())
    obj = live[0]
    obj["metadata"]["annotations"][LAST_APPLIED] = "{not json"
    patch = object_patch(obj, desired()[0])
    assert set(patch) == {"metadata"}  # only the annotation is rewritten


def test_a_graph_or_its_namespace_being_deleted_is_left_alone():
    graph = {"metadata": {"name": "g", "namespace": "ns", "uid": UID}}
    namespace = {"metadata": {"name": "ns"}, "status": {"phase": "Active"}}
    # as the apiserver stores a deleted namespace until its content is gone
    terminating = {
        "metadata": {"name": "ns", "deletionTimestamp": "2026-11-27T08:42:32Z"},
        "status": {"phase": "Terminating"},
    }
    deleted_graph = {"metadata": {**graph["metadata"], "deletionTimestamp": "2026-11-27T08:42:32Z"}}
    assert not being_deleted(graph, namespace)
    assert not being_deleted(graph, None)  # no Namespace found says nothing
    assert being_deleted(graph, terminating)
    assert being_deleted(deleted_graph, namespace)
    assert being_deleted(deleted_graph, None)
