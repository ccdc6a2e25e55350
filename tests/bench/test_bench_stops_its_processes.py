"""A benchmark killed mid-run (SIGTERM: a CI timeout, `kill`) stops every process it started:
the mock workers, the EPP and the Envoy in front of it do not outlive it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dynamograph.local.envoy import EnvoyNotFound, find_envoy

pytestmark = pytest.mark.integration


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int) -> set[int]:
    tree, found, todo = _children(), set(), [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (gone) parent's reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_fleet_router_and_gateway(tmp_path):
    try:
        find_envoy()
    except EnvoyNotFound as exc:
        pytest.skip(str(exc))
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 512, "output_length": 4, "hash_ids": [i]}
        for i in range(40)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "dynamograph.cli", "bench", "route", "--trace", str(trace),
            "--out", str(tmp_path / "out"), "--workers", "2", "--compression", "0.1",
            "--num-gpu-blocks", "1024", "--policies", "kv"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bench = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    started: set[int] = set()
    try:
        assert bench.stdout is not None
        for line in bench.stdout:  # until the replay runs: workers, EPP and Envoy are up
            if "replaying" in line:
                break
        else:
            pytest.fail(f"bench route ended before its replay (exit {bench.wait()})")
        started = _descendants(bench.pid)
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in started if _running(p)}
        assert "envoy" in names and len(started) >= 4, names  # 2 workers, the EPP, Envoy
        bench.send_signal(signal.SIGTERM)
        bench.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while (left := {p for p in started if _running(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after the benchmark was killed: {sorted(left)}"
    finally:
        bench.kill()
        bench.communicate()
        for pid in started:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
