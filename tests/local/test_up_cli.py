"""`dynamograph up` / `down` answers that need no running graph: clear errors, nothing started."""

import pytest
import yaml

from dynamograph.local.up import EXAMPLES

from .conftest import dynamograph

pytestmark = pytest.mark.integration


def test_invalid_graph_is_refused_with_the_field_path(tmp_path):
    graph = yaml.safe_load((EXAMPLES / "agg.yaml").read_text())
    graph["spec"]["services"]["worker"]["replicas"] = -1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(graph))
    result = dynamograph("up", str(path), state_dir=tmp_path, check=False)
    assert result.returncode == 2
    assert "spec.services.worker.replicas" in result.stderr
    assert not (tmp_path / "agg").exists()  # nothing was started


def test_missing_graph_file(tmp_path):
    result = dynamograph("up", str(tmp_path / "nope.yaml"), state_dir=tmp_path, check=False)
    assert result.returncode == 2 and "no graph file" in result.stderr
    assert str(EXAMPLES) in result.stderr and "disagg.yaml" in result.stderr  # where to look


def test_missing_envoy_names_the_setup_script(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAMOGRAPH_ENVOY", str(tmp_path / "no-envoy"))
    result = dynamograph("up", "--detach", state_dir=tmp_path, check=False)
    assert result.returncode == 2 and "DYNAMOGRAPH_ENVOY" in result.stderr
    assert not (tmp_path / "agg" / "state.json").exists()


def test_status_and_down_when_nothing_runs(tmp_path):
    status = dynamograph("up", "--status", state_dir=tmp_path, check=False)
    assert status.returncode == 1 and "not running" in status.stderr
    down = dynamograph("down", state_dir=tmp_path)
    assert "no running graphs" in down.stdout
    named = dynamograph("down", "agg", state_dir=tmp_path, check=False)
    assert named.returncode == 1 and "not running" in named.stderr
