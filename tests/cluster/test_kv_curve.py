"""`spec.kvEvents.curve` on a real control plane (chart installed by helm, the operator with the
chart's ServiceAccount token, a namespace enforcing Pod Security "restricted"): turned on, the
operator creates the Secret `<graph>-kv-curve` once, owned by the graph, holding a key folder the
components load, and every engine, the EPP and the kv-mode frontend Deployment mount it; turned
off, the mounts go and the Secret stays; the apiserver refuses the field with backend vllm.
kwok runs no containers: that the mounted keys secure the stream is tests/epp/test_kv_curve.py's
part (real sockets, the same key files)."""

import base64
import json

from dynamograph.protocol.kv_curve import KV_CURVE_ENV, CurveKeys
from dynamograph.protocol.launch import KV_CURVE_DIR

from .conftest import describe, get, wait_for
from .test_operator import OPERATOR_USER, graph_manifest, ready_graph
from .test_production_manifests import owned_by_graph

SERVICES = {
    "decode": {"componentType": "decode"},
    "prefill": {"componentType": "prefill"},
    "epp": {"componentType": "epp"},
    "api": {"componentType": "frontend"},  # standalone, kv mode: subscribes too
}
# Deployment -> the containers that open KV-event sockets (the decode pods' frontend sidecar
# follows the EPP's headers and subscribes to nothing).
KEYED = {
    "kc-decode": {"engine"},
    "kc-prefill": {"engine"},
    "kc-epp": {"epp"},
    "kc-api": {"frontend"},
}


def keyed_containers(cp, namespace: str) -> dict[str, set[str]] | None:
    """Per Deployment of the graph, its containers given the keys (volume from the Secret,
    mount and env) — None while a Deployment mounts them only partly."""
    out = {}
    for name in KEYED:
        deployment = get(cp, "deployment", name, "-n", namespace)
        if deployment is None:
            return None
        pod = deployment["spec"]["template"]["spec"]
        volume = [v for v in pod.get("volumes", []) if v["name"] == "kv-curve"]
        keyed = set()
        for c in pod["containers"]:
            mounts = [m for m in c.get("volumeMounts", []) if m["name"] == "kv-curve"]
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if mounts or KV_CURVE_ENV in env:
                if not (mounts and mounts[0]["mountPath"] == env.get(KV_CURVE_ENV) == KV_CURVE_DIR):
                    return None
                keyed.add(c["name"])
        if bool(keyed) != bool(volume):
            return None
        if volume and volume[0]["secret"]["secretName"] != "kc-kv-curve":
            return None
        out[name] = keyed
    return out


def secret_creates(cp, namespace: str) -> list[tuple[str, int]]:
    """(Secret name, response code) of every create the operator sent into `namespace`."""
    return [
        (ref.get("name", "?"), e.get("responseStatus", {}).get("code", 0))
        for e in cp.audit_events(OPERATOR_USER)
        for ref in [e.get("objectRef") or {}]
        if ref.get("resource") == "secrets"
        and ref.get("namespace") == namespace
        and e["verb"] == "create"
    ]


def patch_spec(cp, namespace: str, patch: dict) -> None:
    cp.kubectl("patch", "dg", "kc", "-n", namespace, "--type=merge", "-p", json.dumps(patch))


def test_curve_keys_are_created_once_and_mounted_where_the_stream_is_opened(
    control_plane, operator, namespace, tmp_path
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    ready = lambda: ready_graph(cp, namespace, "kc")  # noqa: E731

    # Off (the default): no keys anywhere.
    cp.kubectl_apply(graph_manifest("kc", namespace, SERVICES))
    wait_for("graph kc Ready", ready, 120, describe=show)
    assert keyed_containers(cp, namespace) == {name: set() for name in KEYED}, show()
    assert get(cp, "secret", "kc-kv-curve", "-n", namespace) is None

    # On: the Secret appears, and the Deployments mount it where the stream is opened.
    patch_spec(cp, namespace, {"spec": {"kvEvents": {"curve": True}}})
    wait_for(
        "the keys mounted", lambda: keyed_containers(cp, namespace) == KEYED, 60, describe=show
    )
    graph = wait_for("graph kc Ready with curve", ready, 120, describe=show)
    secret = get(cp, "secret", "kc-kv-curve", "-n", namespace)
    assert secret is not None and owned_by_graph(secret, graph), show()
    files = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert set(files) == {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    # the Secret volume is the key folder: what a worker and a subscriber load
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    CurveKeys.load(tmp_path)
    log = operator.log_tail(10**7)
    assert "kc-kv-curve" in log and not any(content in log for content in files.values())

    # Further passes (a spec change is one for sure, the 2 s resync timer more) create nothing.
    patch_spec(cp, namespace, {"spec": {"services": {"decode": {"replicas": 2}}}})
    wait_for(
        "graph kc Ready at 2 decode replicas",
        lambda: (g := ready()) and g["status"]["services"]["decode"]["replicas"] == 2,
        120,
        describe=show,
    )
    again = get(cp, "secret", "kc-kv-curve", "-n", namespace)
    assert again["metadata"]["uid"] == secret["metadata"]["uid"] and again["data"] == secret["data"]
    assert sorted(secret_creates(cp, namespace)) == [("kc-admin-token", 201), ("kc-kv-curve", 201)]

    # Off again: the mounts go; the Secret stays (owned by the graph, it goes with it).
    patch_spec(cp, namespace, {"spec": {"kvEvents": {"curve": False}}})
    wait_for(
        "the keys unmounted",
        lambda: keyed_containers(cp, namespace) == {name: set() for name in KEYED},
        60,
        describe=show,
    )
    assert (
        get(cp, "secret", "kc-kv-curve", "-n", namespace)["metadata"]["uid"]
        == (secret["metadata"]["uid"])
    )


def test_the_apiserver_refuses_curve_with_vllm(control_plane, chart_release, namespace):
    cp = control_plane
    manifest = graph_manifest("bad", namespace, {"worker": {"componentType": "worker"}})
    manifest["spec"].update(backend="vllm", kvEvents={"curve": True})
    res = cp.kubectl("apply", "-f", "-", input=json.dumps(manifest), check=False)
    assert res.returncode != 0, f"accepted\n{res.stdout}"
    assert "kvEvents.curve: vLLM's KV-event publisher has no CURVE option" in res.stderr
    assert get(cp, "dg", "bad", "-n", namespace) is None
    # the same graph with the field off is taken
    manifest["spec"]["kvEvents"] = {"curve": False}
    cp.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
