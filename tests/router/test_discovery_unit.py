"""Pure parts of worker discovery: flags, workers files, pods → targets, label selectors."""

import pytest

from dynamograph.router.discovery import (
    WorkerTarget,
    load_workers_file,
    parse_worker_flag,
    pod_target,
    selector_matches,
)

pytestmark = pytest.mark.unit


def test_worker_flag_with_and_without_endpoint():
    assert parse_worker_flag("http://127.0.0.1:8001=127.0.0.1:9001") == WorkerTarget(
        "http://127.0.0.1:8001", "http://127.0.0.1:8001", "127.0.0.1:9001"
    )
    prefill = parse_worker_flag("127.0.0.1:8002/")
    assert prefill.engine_url == "http://127.0.0.1:8002"
    assert prefill.serving_endpoint is None
    for bad in ("", "=1.2.3.4:5", "http://h:1=nohostport"):
        with pytest.raises(ValueError):
            parse_worker_flag(bad)


def test_workers_file_yaml_and_json(tmp_path):
    yml = tmp_path / "w.yaml"
    yml.write_text("- {engine: 'http://a:1', endpoint: 'a:2'}\n- engine: http://b:1\n")
    assert [t.serving_endpoint for t in load_workers_file(yml)] == ["a:2", None]
    js = tmp_path / "w.json"
    js.write_text('{"workers": [{"engine": "http://c:1", "endpoint": "c:2"}]}')
    assert load_workers_file(js)[0].engine_url == "http://c:1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("- {endpoint: x:1}\n")
    with pytest.raises(ValueError, match="engine"):
        load_workers_file(bad)


def _pod(ready=True, deleting=False, ports=(("engine", 8000), ("http", 8080)), ip="10.0.0.5"):
    meta = {"name": "w-0", "namespace": "ns", "labels": {"dynamograph.io/graph": "g"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": {"containers": [{"ports": [{"name": n, "containerPort": p} for n, p in ports]}]},
        "status": {
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_pod_target_ready_not_terminating_named_ports():
    assert pod_target(_pod()) == WorkerTarget("ns/w-0", "http://10.0.0.5:8000", "10.0.0.5:8080")
    assert pod_target(_pod(ready=False)) is None
    assert pod_target(_pod(deleting=True)) is None
    assert pod_target(_pod(ports=(("metrics", 9090),))) is None
    assert pod_target(_pod(ip=None)) is None
    prefill = pod_target(_pod(ports=(("engine", 8000),)))
    assert prefill is not None and prefill.serving_endpoint is None
    assert pod_target(_pod(ip="fd00::1")).engine_url == "http://[fd00::1]:8000"


def test_selector_matches_equality_and_existence():
    labels = {"a": "1", "b": "2"}
    assert selector_matches("a=1,b==2", labels)
    assert not selector_matches("a=2", labels)
    assert selector_matches("a!=2", labels)
    assert not selector_matches("a!=1", labels)
    assert selector_matches("a", labels) and not selector_matches("c", labels)
    assert selector_matches("!c", labels) and not selector_matches("!a", labels)
    assert selector_matches("", labels)
