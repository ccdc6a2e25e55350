"""Fixtures for the local-stack tests: the `dynamograph` CLI as a subprocess, detached graphs."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from dynamograph.local import procs
from dynamograph.local.envoy import EnvoyNotFound, find_envoy
from dynamograph.local.status import sample_from_metrics
from dynamograph.local.up import EXAMPLES

# Mock engines simulate GPU time this many times faster: the tests check routing, not speed.
SPEEDUP = "20"


# The console script next to this interpreter (`.venv/bin/dynamograph`, as the README runs it),
# or the module when the interpreter has no scripts folder.
SCRIPT = Path(sys.executable).parent / "dynamograph"
COMMAND = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-m", "dynamograph.cli"]


def dynamograph(*args, state_dir: Path, timeout: float = 150, check=True):
    """Run `dynamograph ARGS` like a user would, from the state folder (not the repository);
    returns the CompletedProcess."""
    result = subprocess.run(
        [*COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=state_dir,
        env={**os.environ, "DYNAMOGRAPH_STATE_DIR": str(state_dir)},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"dynamograph {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def require_envoy():
    try:
        return find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(f"needs a real Envoy: {exc}")


def read_state(state_dir: Path, graph: str) -> dict:
    return json.loads((state_dir / graph / "state.json").read_text())


def engines(state: dict) -> list[dict]:
    return [p for p in state["processes"] if p["spec"]["kind"] == "engine"]


def all_ports(state: dict) -> list[int]:
    return [port for p in state["processes"] for port in p["spec"]["ports"].values()]


def assert_all_gone(state: dict) -> None:
    """No process of the graph is left (in any recorded process group) and its ports are free."""
    for p in state["processes"]:
        assert procs.group_members(p["pid"]) == [], f"{p['spec']['name']} still running"
    busy = [port for port in all_ports(state) if not procs.port_is_free(port)]
    assert busy == [], f"ports still in use: {busy}"


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def engine_ids(state: dict) -> dict[int, str]:
    """instance id -> process name, as each engine itself reports it at /v1/engine."""
    out = {}
    for p in engines(state):
        config = json.loads(get(p["spec"]["engine_url"] + "/v1/engine"))
        assert config["name"] == p["spec"]["name"]
        out[int(config["instance_id"])] = p["spec"]["name"]
    return out


def served_counts(state: dict) -> dict[str, float]:
    """Finished requests per engine, from the engines' own /metrics."""
    return {
        p["spec"]["name"]: sample_from_metrics(get(p["spec"]["engine_url"] + "/metrics")).requests
        for p in engines(state)
    }


class Detached:
    """`dynamograph up --detach GRAPH`, and `down` at the end whatever happened."""

    def __init__(
        self, graph: str, state_dir: Path, *, default: bool = False, path: Path | None = None
    ):
        self.graph = graph
        self.state_dir = state_dir
        self.path = path or EXAMPLES / f"{graph}.yaml"
        # default: `dynamograph up` with no graph argument, as the README's first command.
        self.args = [] if default else [str(self.path)]

    def __enter__(self):
        result = dynamograph(
            "up", *self.args, "--detach", "--speedup", SPEEDUP, state_dir=self.state_dir
        )
        self.stdout = result.stdout
        self.state = read_state(self.state_dir, self.graph)
        self.base_url = self.state["base_url"]
        return self

    def down(self):
        return dynamograph("down", self.graph, state_dir=self.state_dir, check=False)

    def __exit__(self, *exc):
        if (self.state_dir / self.graph / "state.json").exists():
            self.down()


@pytest.fixture(scope="module")
def agg_stack(tmp_path_factory):
    require_envoy()
    with Detached("agg", tmp_path_factory.mktemp("state"), default=True) as stack:
        yield stack
