"""Unit tests of the cluster-in-a-box's pure parts: pod specs -> argv/env/files, gateway."""

import base64
import os
import random
import re

import pytest

from ..graphs import load_example, renamed
from . import pods as podlib
from .gateway import epp_endpoint, fail_open
from .kubelet import AddressPool

pytestmark = pytest.mark.unit

IP = "127.9.8.7"


def test_template_hash_is_stable_and_changes_with_the_template():
    a = {"metadata": {"labels": {"x": "1"}}, "spec": {"containers": [{"name": "c"}]}}
    b = {"spec": {"containers": [{"name": "c"}]}, "metadata": {"labels": {"x": "1"}}}
    assert podlib.template_hash(a) == podlib.template_hash(b)
    c = {"metadata": {"labels": {"x": "2"}}, "spec": {"containers": [{"name": "c"}]}}
    assert podlib.template_hash(a) != podlib.template_hash(c)
    assert len(podlib.template_hash(a)) == 10


def test_service_selectors():
    labels = {"app": "a", "tier": "web"}
    assert podlib.service_selects({"app": "a"}, labels)
    assert not podlib.service_selects({"app": "b"}, labels)
    assert not podlib.service_selects({}, labels)  # an empty selector selects nothing


def test_argv_puts_loopback_and_wildcard_hosts_on_the_pod_address():
    container = {
        "name": "frontend",
        "command": ["dynamograph"],
        "args": ["frontend", "--host", "0.0.0.0", "--engine-url", "http://127.0.0.1:8000",
                 "--worker=localhost:9000"],
    }  # fmt: skip
    argv = podlib.container_argv(container, IP, python="/py")
    assert argv[:3] == ["/py", "-m", "dynamograph.cli"]
    assert argv[3:] == [
        "frontend", "--host", IP, "--engine-url", f"http://{IP}:8000", f"--worker={IP}:9000",
    ]  # fmt: skip


def test_argv_binds_the_pod_address_when_no_host_is_given():
    container = {"name": "engine", "args": ["--log-level", "info", "worker", "--port", "8000"]}
    argv = podlib.container_argv(container, IP, python="/py")
    # No `command`: the image's entrypoint (dynamograph) runs the args.
    assert argv[3:] == ["--log-level", "info", "worker", "--host", IP, "--port", "8000"]


def test_argv_rewrites_paths_under_mount_points():
    container = {
        "name": "epp",
        "command": ["dynamograph"],
        "args": ["epp", "--host", "0.0.0.0", "--config", "/etc/dg/router/router.yaml",
                 "--other=/etc/dg/router", "/etc/dg/routerx"],
    }  # fmt: skip
    argv = podlib.container_argv(container, IP, {"/etc/dg/router": "/tmp/v"}, python="/py")
    assert argv[-4:] == ["--config", "/tmp/v/router.yaml", "--other=/tmp/v", "/etc/dg/routerx"]


def test_argv_refuses_foreign_commands():
    with pytest.raises(podlib.PodSpecError, match="only the project's `dynamograph`"):
        podlib.container_argv({"name": "x", "command": ["nginx"]}, IP)


def test_env_resolves_the_downward_api():
    container = {
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "N", "value": 3},
        ]
    }
    refs = podlib.PodRefs("p-1", "ns", IP, "uid")
    env = podlib.container_env(container, refs, {"BASE": "1"})
    assert env == {"BASE": "1", "POD_NAME": "p-1", "POD_IP": IP, "N": "3"}
    secret = {"env": [{"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}
    assert podlib.secret_names({"containers": [secret]}) == {"s"}
    stored = podlib.object_data("secret", {"data": {"k": base64.b64encode(b"tok").decode()}})
    assert podlib.container_env(secret, refs, {}, {"s": stored}) == {"S": "tok"}
    # Bytes that are not UTF-8 reach the process as they are (os.environ's encoding).
    env = podlib.container_env(secret, refs, {}, {"s": {"k": b"\xfftok"}})
    assert os.fsencode(env["S"]) == b"\xfftok"
    with pytest.raises(podlib.PodSpecError, match="key 'k' of Secret 's' not found"):
        podlib.container_env(secret, refs, {})
    secret["env"][0]["valueFrom"]["secretKeyRef"]["optional"] = True
    assert podlib.container_env(secret, refs, {}) == {}
    config_map = {"env": [{"name": "C", "valueFrom": {"configMapKeyRef": {"name": "c"}}}]}
    with pytest.raises(podlib.PodSpecError, match="C: only literal values, fieldRef and secret"):
        podlib.container_env(config_map, refs, {})


def test_pod_manifest_and_status():
    deployment = {
        "metadata": {"name": "g-decode", "namespace": "ns", "uid": "d-uid"},
        "spec": {
            "replicas": 1,
            "template": {
                "metadata": {"labels": {"dynamograph.io/service": "decode"}},
                "spec": {
                    "containers": [
                        {"name": "engine", "ports": [{"name": "engine", "containerPort": 8000}]}
                    ]
                },
            },
        },
    }
    pod = podlib.pod_manifest(deployment, "g-decode-h-abcde", IP, "p-uid", "h")
    assert pod["metadata"]["labels"] == {
        "dynamograph.io/service": "decode",
        "pod-template-hash": "h",
    }
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "d-uid"
    assert pod["status"]["podIP"] == IP and pod["status"]["phase"] == "Pending"
    status = podlib.pod_status(pod["spec"], IP, {"engine": True}, {"engine": 2})
    ready = {c["type"]: c["status"] for c in status["conditions"]}
    assert ready["Ready"] == "True" and status["containerStatuses"][0]["restartCount"] == 2
    status = podlib.pod_status(pod["spec"], IP, {"engine": False}, {})
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "False"
    assert podlib.resolve_port("engine", pod["spec"]) == 8000
    assert podlib.resolve_port(9003, pod["spec"]) == 9003
    with pytest.raises(podlib.PodSpecError, match="not a named container port"):
        podlib.resolve_port("http", pod["spec"])


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_volume_kinds():
    spec = {
        "volumes": [
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "tls", "secret": {"secretName": "s"}},
            {"name": "tmp", "emptyDir": {}},
        ]
    }
    volumes = podlib.volume_dirs(spec)
    assert set(volumes) == {"cfg", "tls", "tmp"}
    assert podlib.volume_source(volumes["cfg"]) == ("configMap", "c")
    assert podlib.volume_source(volumes["tls"]) == ("secret", "s")
    assert podlib.volume_source(volumes["tmp"]) is None
    claim = {"name": "m", "persistentVolumeClaim": {"claimName": "x"}}
    with pytest.raises(podlib.PodSpecError, match="only configMap, secret and emptyDir"):
        podlib.volume_dirs({"volumes": [claim]})


def test_object_data_decodes_each_kind_as_the_api_server_stores_it():
    binary = bytes(range(256))
    secret = {"data": {"bin": _b64(binary), "k": _b64(b"old")}, "stringData": {"k": "new"}}
    # stringData wins over data, as the API server merges it.
    assert podlib.object_data("secret", secret) == {"bin": binary, "k": b"new"}
    cm = {"data": {"a": "caf\u00e9"}, "binaryData": {"b": _b64(binary)}}
    assert podlib.object_data("configMap", cm) == {"a": "caf\u00e9".encode(), "b": binary}


def test_configmap_and_secret_volume_files():
    cm = {"metadata": {"name": "c"}, "data": {"a.yaml": "a: 1", "b": "2"}}
    whole = {"name": "cfg", "configMap": {"name": "c"}}
    assert podlib.volume_files(whole, cm) == {"a.yaml": (b"a: 1", 0o644), "b": (b"2", 0o644)}
    items = {"name": "cfg", "configMap": {"name": "c", "items": [{"key": "b", "path": "sub/b"}]}}
    assert podlib.volume_files(items, cm) == {"sub/b": (b"2", 0o644)}

    binary = b"\x00\xff\x80key"
    secret = {
        "metadata": {"name": "s"},
        "type": "kubernetes.io/tls",
        "data": {"tls.crt": _b64(b"CERT"), "tls.key": _b64(binary)},
    }
    volume = {"name": "tls", "secret": {"secretName": "s", "defaultMode": 0o440}}
    assert podlib.volume_files(volume, secret) == {
        "tls.crt": (b"CERT", 0o440),
        "tls.key": (binary, 0o440),
    }
    volume["secret"]["items"] = [
        {"key": "tls.key", "path": "private/key.pem", "mode": 0o400},
        {"key": "tls.crt", "path": "cert.pem"},
    ]
    assert podlib.volume_files(volume, secret) == {
        "private/key.pem": (binary, 0o400),
        "cert.pem": (b"CERT", 0o440),
    }


def test_missing_objects_and_keys_stop_the_pod_unless_optional():
    volume = {"name": "keys", "secret": {"secretName": "s"}}
    with pytest.raises(podlib.PodSpecError, match="volume 'keys': secret 's' not found"):
        podlib.volume_files(volume, None)
    cm_volume = {"name": "cfg", "configMap": {"name": "c"}}
    with pytest.raises(podlib.PodSpecError, match="volume 'cfg': configMap 'c' not found"):
        podlib.volume_files(cm_volume, None)
    secret = {"metadata": {"name": "s"}, "stringData": {"a": "1"}}
    volume["secret"]["items"] = [{"key": "a", "path": "a"}, {"key": "b", "path": "b"}]
    with pytest.raises(podlib.PodSpecError, match="secret 's' has no key 'b'"):
        podlib.volume_files(volume, secret)
    volume["secret"]["optional"] = True
    assert podlib.volume_files(volume, None) == {}  # an empty directory
    assert podlib.volume_files(volume, secret) == {"a": (b"1", 0o644)}


def test_volume_paths_stay_inside_the_volume():
    secret = {"metadata": {"name": "s"}, "stringData": {"a": "1"}}
    for path in ("/etc/passwd", "../a", "x/../../a", ""):
        volume = {"name": "v", "secret": {"secretName": "s", "items": [{"key": "a", "path": path}]}}
        with pytest.raises(podlib.PodSpecError, match="must be a relative path"):
            podlib.volume_files(volume, secret)
    container = {"volumeMounts": [{"name": "v", "mountPath": "/m", "subPath": "../x"}]}
    with pytest.raises(podlib.PodSpecError, match=re.escape("subPath '../x'")):
        podlib.container_mounts(container, {"v": "/tmp/v"})


def test_mounts_with_subpath_rewrite_argv_and_env():
    container = {
        "name": "epp",
        "command": ["dynamograph"],
        "args": ["epp", "--cert-path", "/etc/tls", "--key=/etc/key.pem"],
        "env": [
            {"name": "KEYS", "value": "/etc/keys"},
            {"name": "CERT", "value": "/etc/tls/tls.crt"},
            {"name": "OTHER", "value": "/etc/keysmith"},
        ],
        "volumeMounts": [
            {"name": "tls", "mountPath": "/etc/tls", "readOnly": True},
            {"name": "tls", "mountPath": "/etc/key.pem", "subPath": "tls.key"},
            {"name": "keys", "mountPath": "/etc/keys"},
        ],
    }
    mounts = podlib.container_mounts(container, {"tls": "/v/tls", "keys": "/v/keys"})
    assert mounts == {
        "/etc/tls": "/v/tls",
        "/etc/key.pem": "/v/tls/tls.key",
        "/etc/keys": "/v/keys",
    }
    argv = podlib.container_argv(container, IP, mounts, python="/py")
    assert argv[3:] == ["epp", "--host", IP, "--cert-path", "/v/tls", "--key=/v/tls/tls.key"]
    env = podlib.container_env(container, podlib.PodRefs("p", "ns", IP, "u"), {}, {}, mounts)
    assert env == {"KEYS": "/v/keys", "CERT": "/v/tls/tls.crt", "OTHER": "/etc/keysmith"}
    with pytest.raises(podlib.PodSpecError, match="no volume 'gone'"):
        podlib.container_mounts({"volumeMounts": [{"name": "gone", "mountPath": "/g"}]}, {})


def test_address_pool_never_repeats_and_stays_in_loopback():
    pool = AddressPool(random.Random(3))
    seen = [pool.next() for _ in range(600)]
    assert len(set(seen)) == 600
    assert all(a.startswith("127.") and not a.endswith(".0") and not a.endswith(".1") for a in seen)


def _epp_pod(name: str, ip: str, ready: bool) -> dict:
    return {
        "metadata": {"name": name, "labels": {"dynamograph.io/service": "epp"}},
        "spec": {
            "containers": [{"name": "epp", "ports": [{"name": "grpc", "containerPort": 9002}]}]
        },
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def test_epp_endpoint_follows_pool_service_and_ready_pod():
    pool = {
        "spec": {
            "endpointPickerRef": {
                "name": "g-epp",
                "port": {"number": 9002},
                "failureMode": "FailOpen",
            }
        }
    }
    service = {
        "metadata": {"name": "g-epp"},
        "spec": {
            "selector": {"dynamograph.io/service": "epp"},
            "ports": [{"port": 9002, "targetPort": "grpc"}],
        },
    }
    assert epp_endpoint(pool, [service], [_epp_pod("a", "127.1.1.2", False)]) is None
    assert epp_endpoint(pool, [], [_epp_pod("a", "127.1.1.2", True)]) is None
    pods = [_epp_pod("b", "127.1.1.3", True), _epp_pod("a", "127.1.1.2", False)]
    assert epp_endpoint(pool, [service], pods) == "127.1.1.3:9002"
    assert fail_open(pool)
    bad = {"spec": {"endpointPickerRef": {"name": "g-epp", "port": {"number": 1}}}}
    with pytest.raises(ValueError, match="has no port 1"):
        epp_endpoint(bad, [service], pods)


def test_examples_parse_as_graphs():
    for name in ("agg", "disagg"):
        graph = renamed(load_example(name), name, "ns")
        assert graph["kind"] == "DynamoGraph" and graph["metadata"]["namespace"] == "ns"
