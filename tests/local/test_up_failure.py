"""Failure while `dynamograph up` runs in the foreground: a worker is killed, the status view
reports it, routing continues on the rest; Ctrl-C then stops everything."""

import os
import queue
import signal
import subprocess
import threading
import time

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.waiting import wait_for_sync

from .conftest import (
    COMMAND,
    SPEEDUP,
    assert_all_gone,
    dynamograph,
    engine_ids,
    engines,
    get,
    read_state,
    require_envoy,
)

pytestmark = pytest.mark.e2e

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


def test_killed_worker_is_reported_and_routing_continues(tmp_path):
    require_envoy()
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(GRAPH))
    up = Foreground(path, tmp_path)
    state = None
    try:
        line = up.wait_for("OpenAI base URL", timeout=150)
        base_url = line.split()[-1]
        state = read_state(tmp_path, "three")
        assert state["base_url"] == base_url and state["supervisor"]["pid"] == up.proc.pid
        victim = engines(state)[1]
        os.kill(victim["pid"], signal.SIGKILL)
        up.wait_for(f"{victim['spec']['name']} killed by signal 9", timeout=30)

        status = dynamograph("up", str(path), "--status", state_dir=tmp_path)
        row = next(x for x in status.stdout.splitlines() if victim["spec"]["name"] + " " in x)
        assert "killed by signal 9" in row
        sidecar = next(
            x for x in status.stdout.splitlines() if victim["spec"]["name"] + "-frontend" in x
        )
        assert "stopped" in sidecar

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        alive = engine_ids({"processes": [p for p in engines(state) if p != victim]})

        def chat(i: int) -> int:
            # Different prefixes, so KV routing has no reason to stick to one worker.
            reply = client.chat.completions.create(
                model="qwen",
                messages=[{"role": "user", "content": f"request {i} {time.time()} " * 20}],
                max_tokens=4,
                extra_body={"nvext": {"extra_fields": ["worker_id"]}},
            )
            return int(reply.model_extra["nvext"]["worker_id"]["decode_worker_id"])

        # Until the EPP has noticed (it scrapes every worker), a request may still be sent to
        # the dead one; like a Kubernetes endpoint going unready, that takes a moment. Wait for
        # the EPP's own count of workers: a few lucky successes alone do not show it noticed.
        epp = next(p for p in state["processes"] if p["spec"]["kind"] == "epp")
        epp_metrics = f"http://127.0.0.1:{epp['spec']['ports']['metrics']}/metrics"
        wait_for_sync(
            lambda: epp_workers(get(epp_metrics)) == len(alive),
            "the EPP to drop the killed worker",
            interval=0.2,
        )
        streak = 0

        def recovered() -> bool:  # three requests in a row served by live workers
            nonlocal streak
            try:
                streak = streak + 1 if chat(0) in alive else 0
            except openai.APIError:
                streak = 0
            return streak >= 3

        wait_for_sync(recovered, "routing to recover after the worker was killed", interval=0.2)
        served = [chat(i) for i in range(12)]  # from now on: no errors at all
        assert len(served) == 12
        assert set(served) <= set(alive), "a request went to the killed worker"
    finally:
        up.proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            code = up.proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            up.proc.kill()
            raise
    assert code == 0, "\n".join(up.seen)
    assert not (tmp_path / "three" / "state.json").exists()
    assert_all_gone(state)


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
