"""`spec.kvEvents.curve` in the operator, without a cluster: which containers get the graph's
KV-event CURVE keys (every engine, the EPP, kv-mode standalone frontends; nothing when off), the
created-once Secret holding them, and the vllm refusal by model and CEL rule alike
(tests/cluster/test_kv_curve.py has a real apiserver take them)."""

import asyncio
import copy
import json

import kubernetes_validate
import pytest
import yaml
import zmq
import zmq.auth

from dynamograph.operator import controller, crds
from dynamograph.operator.manifests import kv_curve_secret_object
from dynamograph.protocol.graph import GraphError, load_graph
from dynamograph.protocol.kv_curve import KV_CURVE_ENV, CurveKeys, key_files
from dynamograph.protocol.launch import KV_CURVE_DIR

from .emulator import EXAMPLES
from .test_production_manifests import OWNER, Api, containers, graph_body, render

pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

cel = pytest.importorskip("tests.operator.cel", reason="cel-python is not installed")

VOLUME = {"name": "kv-curve", "secret": {"secretName": "g-kv-curve"}}
MOUNT = {"name": "kv-curve", "mountPath": KV_CURVE_DIR, "readOnly": True}
ENV = {"name": KV_CURVE_ENV, "value": KV_CURVE_DIR}


def curve_body(curve: bool | None, **services) -> dict:
    """Every kind of service: aggregated, prefill/decode, the EPP, a kv and a round-robin
    standalone frontend."""
    body = graph_body(
        **(
            services
            or {
                "worker": {"componentType": "worker"},
                "decode": {"componentType": "decode", "dataParallelSize": 2},
                "prefill": {"componentType": "prefill"},
                "epp": {"componentType": "epp", "tls": {"mode": "Secret", "secretName": "c"}},
                "kvfront": {"componentType": "frontend"},
                "rrfront": {"componentType": "frontend", "router": {"mode": "round-robin"}},
            }
        )
    )
    if curve is not None:
        body["spec"]["kvEvents"] = {"curve": curve}
    return body


def keyed(deployment: dict) -> tuple[list[dict], dict[str, tuple[list[dict], list[dict]]]]:
    """A Deployment's kv-curve volumes, and per container its kv-curve mounts and env."""
    pod = deployment["spec"]["template"]["spec"]
    volumes = [v for v in pod.get("volumes", []) if v["name"] == "kv-curve"]
    per_container = {
        name: (
            [m for m in c.get("volumeMounts", []) if m["name"] == "kv-curve"],
            [e for e in c["env"] if e["name"] == KV_CURVE_ENV],
        )
        for name, c in containers(deployment).items()
    }
    return volumes, per_container


# The main container of each service that opens KV-event sockets: engines publish, the EPP and a
# kv-mode frontend subscribe. A frontend sidecar (direct mode) and a round-robin frontend do not.
OPENS_SOCKETS = {
    "g-worker": {"engine"},
    "g-decode": {"engine"},
    "g-prefill": {"engine"},
    "g-epp": {"epp"},
    "g-kvfront": {"frontend"},
    "g-rrfront": set(),
}


def test_with_curve_every_engine_the_epp_and_kv_frontends_mount_the_graphs_keys():
    objs = render(curve_body(True))
    deployments = {name: o for (kind, name), o in objs.items() if kind == "Deployment"}
    assert set(deployments) == set(OPENS_SOCKETS)
    for name, deployment in deployments.items():
        volumes, per_container = keyed(deployment)
        assert volumes == ([VOLUME] if OPENS_SOCKETS[name] else []), name
        for container, (mounts, env) in per_container.items():
            want = container in OPENS_SOCKETS[name]
            assert mounts == ([MOUNT] if want else []), (name, container)
            assert env == ([ENV] if want else []), (name, container)
    # mounted beside what the containers had: the EPP's TLS Secret, the decode engine's ports
    epp = containers(deployments["g-epp"])["epp"]
    assert {m["name"] for m in epp["volumeMounts"]} == {"router-config", "epp-tls", "kv-curve"}
    # the graph's pods pass strict PodSpec validation with the new volume and mounts
    for deployment in deployments.values():
        kubernetes_validate.validate(deployment, "1.33", strict=True)


@pytest.mark.parametrize("curve", [None, False])
def test_without_curve_nothing_mounts_keys_and_no_secret_is_wanted(curve):
    text = json.dumps(list(render(curve_body(curve)).values()))
    assert "kv-curve" not in text and KV_CURVE_ENV not in text
    assert not load_graph(curve_body(curve)).spec.kv_events.curve


def test_the_curve_secret_is_the_key_folder_the_components_load(tmp_path):
    graph = load_graph(curve_body(True))
    files = key_files()
    secret = kv_curve_secret_object(graph, OWNER, files)
    assert secret["metadata"]["name"] == "g-kv-curve"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert secret["type"] == "Opaque" and secret["stringData"] == files
    kubernetes_validate.validate(secret, "1.33", strict=True)
    # The Secret volume is a folder with a file per key: what a worker and a subscriber load.
    for name, content in secret["stringData"].items():
        (tmp_path / name).write_text(content)
    keys = CurveKeys.load(tmp_path)
    context = zmq.Context()
    try:  # both sides' files load onto sockets (a worker's PUB, a subscriber's SUB)
        keys.serve(context.socket(zmq.PUB))
        keys.subscribe(context.socket(zmq.SUB))
    finally:
        context.destroy(linger=0)
    # the public files are the halves of the secret ones; server and client differ
    pairs = {
        side: (
            zmq.auth.load_certificate(tmp_path / f"{side}.key")[0],
            zmq.auth.load_certificate(tmp_path / f"{side}.key_secret"),
        )
        for side in ("server", "client")
    }
    for public, (paired, secret) in pairs.values():
        assert public == paired and secret is not None
    assert pairs["server"][0] != pairs["client"][0]
    # the desired objects (so the plan and the last-applied annotations) never hold the keys
    secret_key = next(v for k, v in files.items() if k.endswith("_secret"))
    assert secret_key not in json.dumps(list(render(curve_body(True)).values()))


def test_the_operator_creates_new_keys_once_and_lets_existing_ones_be(caplog):
    graph = load_graph(curve_body(True))
    controller._kv_curve_keys_ensured.clear()
    api = Api(201, 409)
    with caplog.at_level("DEBUG"):
        assert asyncio.run(controller._ensure_kv_curve_keys(api, graph, OWNER)) == []
        # the next passes write nothing
        assert asyncio.run(controller._ensure_kv_curve_keys(api, graph, OWNER)) == []
        assert len(api.created) == 1
        # a restarted operator tries once; the Secret exists (409): kept as it is
        controller._kv_curve_keys_ensured.clear()
        assert asyncio.run(controller._ensure_kv_curve_keys(api, graph, OWNER)) == []
    first, second = (c["stringData"] for c in api.created)
    assert set(first) == {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    assert first["server.key_secret"] != second["server.key_secret"]  # new keys per attempt
    logged = caplog.text
    assert "g-kv-curve" in logged
    assert not any(value in logged for created in (first, second) for value in created.values())
    # a refused create is a problem naming the Secret, and is tried again on the next pass
    controller._kv_curve_keys_ensured.clear()
    problems = asyncio.run(controller._ensure_kv_curve_keys(Api(403), graph, OWNER))
    assert [p.reason for p in problems] == ["ApplyFailed"]
    assert "Secret g-kv-curve" in problems[0].message
    assert asyncio.run(controller._ensure_kv_curve_keys(Api(201), graph, OWNER)) == []
    # the admin token is ensured on its own account: both Secrets of one graph get created
    controller._admin_tokens_ensured.clear()
    both = Api(201)
    assert asyncio.run(controller._ensure_admin_token(both, graph, OWNER)) == []
    assert [c["metadata"]["name"] for c in both.created] == ["g-admin-token"]


def vllm_example() -> dict:
    return yaml.safe_load((EXAMPLES / "vllm-tp.yaml").read_text())


def spec_schema() -> dict:
    (version,) = crds.build_crd()["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_vllm_graphs_are_refused_curve_by_the_model_and_the_crd_alike():
    body = vllm_example()
    body["spec"]["kvEvents"] = {"curve": True}
    outcome = cel.evaluate(spec_schema(), body)
    refusals = [m for _, m in outcome.failures if m.startswith("kvEvents.curve:")]
    assert len(refusals) == 1 and "vLLM's KV-event publisher has no CURVE" in refusals[0]
    with pytest.raises(GraphError) as info:
        load_graph(copy.deepcopy(body))
    ((path, message),) = info.value.errors
    assert path == "spec.kvEvents.curve"
    assert "NetworkPolicy" in message and message in refusals[0]
    # off (or absent) is fine with vllm; on is fine with the mock
    for vllm_body, curve in ((vllm_example(), False), (vllm_example(), None)):
        if curve is not None:
            vllm_body["spec"]["kvEvents"] = {"curve": curve}
        assert cel.evaluate(spec_schema(), vllm_body).failures == []
        assert load_graph(vllm_body).spec.backend == "vllm"
    mock = curve_body(True)
    mock["spec"]["backend"] = "mock"  # the apiserver defaults it before CEL runs; cel-python not
    assert cel.evaluate(spec_schema(), mock).failures == []
    assert load_graph(mock).spec.kv_events.curve
