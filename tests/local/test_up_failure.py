"""Failure while `dynamograph up` runs in the foreground: a killed worker is restarted and serves
again; one whose every restart fails is given up after a bounded number of tries, reported, and
routing continues on the rest; Ctrl-C then stops everything."""

import collections
import json
import os
import queue
import signal
import socket
import subprocess
import threading
import time
import uuid

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.local import procs
from e2e.waiting import wait_for_sync

from .conftest import (
    COMMAND,
    SPEEDUP,
    Detached,
    assert_all_gone,
    dynamograph,
    engine_ids,
    engines,
    get,
    read_state,
    require_envoy,
)

# A graph started, processes killed and restarted: minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GRAPH = {
    "apiVersion": "dynamograph.io/v1alpha1",
    "kind": "DynamoGraph",
    "metadata": {"name": "three"},
    "spec": {
        "model": {"name": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"},
        "services": {
            "worker": {"componentType": "worker", "replicas": 3},
            "epp": {"componentType": "epp", "router": {"mode": "kv"}},
        },
    },
}


class Foreground:
    """`dynamograph up GRAPH` as a child process whose output lines are read as they come."""

    def __init__(self, graph_path, state_dir):
        self.proc = subprocess.Popen(
            [*COMMAND, "up", str(graph_path), "--speedup", SPEEDUP],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "DYNAMOGRAPH_STATE_DIR": str(state_dir)},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no {text!r} in the output of up:\n" + "\n".join(self.seen))


def chat_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def served_by(client: openai.OpenAI, i: int) -> int:
    """One chat through Envoy; the instance id of the engine that served it. The prompt differs
    from its first KV block on (a random id first: a timestamp first would share that block
    for seconds), so no worker holds any of it and KV routing spreads the requests."""
    reply = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "user", "content": f"{uuid.uuid4().hex} request {i} " * 20}],
        max_tokens=4,
        extra_body={"nvext": {"extra_fields": ["worker_id"]}},
    )
    return int(reply.model_extra["nvext"]["worker_id"]["decode_worker_id"])


def status_row(path, state_dir, name: str) -> str:
    status = dynamograph("up", str(path), "--status", state_dir=state_dir)
    return next(x for x in status.stdout.splitlines() if f" {name} " in x)


def test_killed_worker_comes_back_and_one_that_keeps_failing_is_given_up(tmp_path):
    require_envoy()
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(GRAPH))
    up = Foreground(path, tmp_path)
    state = None
    squatter = socket.socket()
    try:
        line = up.wait_for("OpenAI base URL", timeout=150)
        base_url = line.split()[-1]
        state = read_state(tmp_path, "three")
        assert state["base_url"] == base_url and state["supervisor"]["pid"] == up.proc.pid
        ids = {v: k for k, v in engine_ids(state).items()}
        victim, doomed = engines(state)[1], engines(state)[2]
        name = victim["spec"]["name"]

        # Killed: reported, restarted after its back-off, serving again.
        os.kill(victim["pid"], signal.SIGKILL)
        up.wait_for(f"{name} killed by signal 9; restarting in", timeout=30)
        up.wait_for(f"{name} is back (restart 1)", timeout=60)
        row = status_row(path, tmp_path, name)
        assert "running" in row and "killed by signal 9" in row and " 1 " in row, row
        client = chat_client(base_url)
        epp = next(p for p in state["processes"] if p["spec"]["kind"] == "epp")
        epp_metrics = f"http://127.0.0.1:{epp['spec']['ports']['metrics']}/metrics"
        seen: list[int] = []

        def served_by_restarted() -> bool:
            seen.append(served_by(client, 0))
            return seen[-1] == ids[name]

        wait_for_sync(
            served_by_restarted,
            f"a request served by the restarted {name}",
            interval=0.2,
            detail=lambda: (
                f"served by {collections.Counter(seen)} (ids {ids}); the EPP routes among "
                f"{epp_workers(get(epp_metrics))} workers; supervisor said: {up.seen[-8:]}; "
                f"Envoy's outlier stats: {outlier_stats(state)}"
            ),
        )
        restarted = read_state(tmp_path, "three")
        entry = next(p for p in restarted["processes"] if p["spec"]["name"] == name)
        assert entry["restarts"] == 1 and entry["pid"] != victim["pid"]

        # Killed, and its port taken: every restart fails at once, so it is given up after a
        # bounded number of tries (no restart storm); its sidecar goes with it; the rest serve.
        doomed_name = doomed["spec"]["name"]
        os.kill(doomed["pid"], signal.SIGKILL)
        up.wait_for(f"{doomed_name} killed by signal 9; restarting in", timeout=30)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", doomed["spec"]["ports"]["engine"]))
        squatter.listen()
        given_up = up.wait_for(f"{doomed_name} exited with code 1; gave up after", timeout=90)
        assert "fix the cause" in given_up
        row = status_row(path, tmp_path, doomed_name)
        assert "given-up" in row and "exited with code 1" in row and " 4 " in row, row
        sidecar = status_row(path, tmp_path, doomed_name + "-frontend")
        assert "stopped with its engine" in sidecar, sidecar
        log = [json.loads(x) for x in (tmp_path / "three" / "logs" / "supervisor.log").open()]
        mine = [x for x in log if x["process"] == doomed_name]
        assert [x["level"] for x in mine] == ["warning"] * 4 + ["error"], mine
        assert [x["delay_s"] for x in mine[:4]] == [0.5, 1, 2, 4]

        wait_for_sync(
            lambda: epp_workers(get(epp_metrics)) == 2,
            "the EPP to drop the given-up worker",
            interval=0.2,
        )
        served = [served_by(client, i) for i in range(8)]  # no errors from now on
        assert set(served) <= {ids[name], ids[engines(state)[0]["spec"]["name"]]}
    finally:
        squatter.close()
        up.proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            code = up.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            raise
    assert code == 1, "\n".join(up.seen)  # a process was given up
    assert not (tmp_path / "three" / "state.json").exists()
    assert_all_gone(state)


def test_detached_graph_restarts_a_killed_epp_and_envoy(tmp_path):
    """`up --detach` runs the same supervisor in the background: the gateway's own processes
    come back on their ports and serve again; `--status` shows each restart."""
    require_envoy()
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(GRAPH))
    with Detached("three", tmp_path, path=path) as stack:
        supervisor = stack.state["supervisor"]
        assert supervisor and procs.same_process(supervisor["pid"], supervisor["started"])
        assert "up.log" in stack.stdout
        client = chat_client(stack.base_url)
        for kind in ("epp", "envoy"):
            entry = next(
                p for p in read_state(tmp_path, "three")["processes"] if p["spec"]["kind"] == kind
            )
            name = entry["spec"]["name"]
            os.kill(entry["pid"], signal.SIGKILL)

            def back(name=name, pid=entry["pid"]) -> bool:
                now = next(
                    p
                    for p in read_state(tmp_path, "three")["processes"]
                    if p["spec"]["name"] == name
                )
                return now["pid"] != pid and now["state"] == "running"

            wait_for_sync(back, f"{name} to be restarted and ready", interval=0.2)
            wait_for_sync(
                lambda: served_by(client, 0), f"serving again after {name} restarted", interval=0.2
            )
            row = status_row(path, tmp_path, name)
            assert "running" in row and "killed by signal 9" in row and " 1 " in row, row
        log = (tmp_path / "three" / "logs" / "up.log").read_text()
        assert "three-epp killed by signal 9; restarting in" in log
        assert "three-envoy is back (restart 1)" in log
        state = read_state(tmp_path, "three")
        result = stack.down()
        assert result.returncode == 0, result.stderr
    # Gone (a zombie at most: its parent, the `up --detach` command, exited long ago).
    assert not procs.is_live(supervisor["pid"])
    assert_all_gone(state)


def outlier_stats(state: dict) -> list[str]:
    """Envoy's outlier-detection counters and ejected hosts (why a worker gets no traffic)."""
    envoy = next(p for p in state["processes"] if p["spec"]["kind"] == "envoy")
    admin = f"http://127.0.0.1:{envoy['spec']['ports']['admin']}"
    stats = [x for x in get(admin + "/stats").splitlines() if "outlier_detection.ejections" in x]
    ejected = [x for x in get(admin + "/clusters").splitlines() if "failed_outlier_check" in x]
    return [x for x in stats if not x.endswith(": 0")] + ejected


def epp_workers(metrics_text: str) -> int:
    """Workers the EPP routes among, from its `dynamograph_epp_workers` gauge."""
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples
            if sample.name == "dynamograph_epp_workers"
        )
    )
