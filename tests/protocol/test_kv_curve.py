"""The KV-event CURVE option's key folder and its launch contract (protocol.kv_curve,
protocol.launch)."""

import pytest
import zmq

from dynamograph.protocol.graph import load_graph
from dynamograph.protocol.kv_curve import KV_CURVE_ENV, CurveKeyError, CurveKeys, create_keys
from dynamograph.protocol.launch import KV_CURVE_DIR, kv_curve_mount, kv_curve_secret

pytestmark = pytest.mark.unit


def test_a_folder_without_the_subscriber_secret_is_refused_naming_the_file(tmp_path):
    folder = create_keys(tmp_path / "keys")
    (folder / "client.key_secret").unlink()
    keys = CurveKeys.load(folder)
    with (
        zmq.Context() as ctx,
        ctx.socket(zmq.SUB) as sub,
        pytest.raises(CurveKeyError, match=r"client\.key_secret"),
    ):
        keys.subscribe(sub)
    with pytest.raises(CurveKeyError, match="does not exist"):
        CurveKeys.load(tmp_path / "missing")


def test_secret_files_are_private(tmp_path):
    folder = create_keys(tmp_path / "keys")
    assert {p.name for p in folder.iterdir()} == {
        "server.key",
        "server.key_secret",
        "client.key",
        "client.key_secret",
    }
    assert all(p.stat().st_mode & 0o077 == 0 for p in folder.glob("*.key_secret"))


def test_the_mount_names_the_folder_it_mounts():
    graph = load_graph(
        {
            "apiVersion": "dynamograph.io/v1alpha1",
            "kind": "DynamoGraph",
            "metadata": {"name": "g"},
            "spec": {"model": {"name": "m"}, "services": {"w": {"componentType": "worker"}}},
        }
    )
    volume, mount, env = kv_curve_mount(graph)
    assert volume["secret"]["secretName"] == kv_curve_secret(graph) == "g-kv-curve"
    assert mount["name"] == volume["name"] and mount["readOnly"]
    assert (
        env == {"name": KV_CURVE_ENV, "value": mount["mountPath"]} and env["value"] == KV_CURVE_DIR
    )
