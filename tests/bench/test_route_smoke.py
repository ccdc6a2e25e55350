"""`bench route` end to end on a tiny trace: two real mock workers, a real router in front.

Small on purpose (< 30 s each): it proves the harness — fleet start, router start, open-loop
streaming replay, usage and /metrics collection, table, JSON and plots — not routing quality.
"""

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from dynamograph.bench import route
from dynamograph.bench.route_fleet import LaunchError, stop_all, worker_procs, worker_spec
from dynamograph.bench.route_routers import foreign_binary
from dynamograph.bench.trace import inherent_reuse, load_trace
from dynamograph.local.procs import PortPool

pytestmark = pytest.mark.integration

FAMILIES = 4
PER_FAMILY = 4


@pytest.fixture
def tiny_trace(tmp_path):
    """16 requests: 4 families sharing a 2-id (1,024-token) prefix, each with its own tail."""
    lines = []
    for i in range(FAMILIES * PER_FAMILY):
        family = i % FAMILIES
        ids = [family * 2, family * 2 + 1, 1000 + i]
        lines.append(
            {"timestamp": 100 * i, "input_length": 1024 + 64, "output_length": 4, "hash_ids": ids}
        )
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def bench_args(trace, out, policies, *extra):
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    return parser.parse_args(
        ["--trace", str(trace), "--out", str(out), "--workers", "2", "--compression", "1", "--families", "1",
         "--num-gpu-blocks", "2048", "--policies", *policies, *extra]
    )  # fmt: skip


def check_results(out, trace, policy):
    data = json.loads((out / "route.json").read_text())
    m = data["policies"][policy]
    n = FAMILIES * PER_FAMILY
    assert data["inherent_reuse"] == pytest.approx(inherent_reuse(load_trace(trace)))
    assert (m["ok"], m["shed"], m["errors"]) == (n, 0, 0), m["first_error"]
    assert sum(m["per_worker_requests"].values()) == n
    assert len(m["per_worker_requests"]) == 2
    assert m["prompt_tokens"] == n * (1024 + 64)
    assert 0 < m["hit_rate"] <= data["inherent_reuse"] + 1e-9
    assert 0 < m["ttft_p50_s"] <= m["engine_e2e_p50_s"] and m["e2e_p99_s"] > 0
    assert m["worker_hit_rate"] == pytest.approx(m["hit_rate"], abs=0.05)
    # the router's CPU per request and what the host's CPUs did, in the summary too
    assert m["router_cpu_ms_per_request"] > 0 and m["router_cpu_wait_ms_per_request"] >= 0
    assert 0 < m["host_busy"] <= 1
    for png in ("route_ttft_cdf", "route_latency", "route_reuse", "route_load"):
        assert (out / f"{png}.png").stat().st_size > 1000
    return m


def test_route_through_epp_and_envoy(tmp_path, tiny_trace):
    # Two policies on one fleet: the second starts from reset caches, so its hit rate stays
    # within the trace's inherent reuse (check_results) instead of reusing the first's blocks.
    args = bench_args(tiny_trace, tmp_path / "out", ["round-robin", "kv"])
    assert route.run(args) == 0
    check_results(tmp_path / "out", tiny_trace, "kv")
    m = check_results(tmp_path / "out", tiny_trace, "round-robin")
    assert m["client_ttft_p50_s"] is None  # not streamed: TTFT only from the engine
    assert sorted(m["per_worker_requests"].values()) == [8, 8]  # round-robin: exactly even
    # the gateway's access log, from the replay on (the warm-up's requests left out)
    for policy in ("round-robin", "kv"):
        (found,) = (tmp_path / "out").rglob(f"{policy}/gateway_phases.json")
        phases = json.loads(found.read_text())
        assert phases["requests"] == FAMILIES * PER_FAMILY
        request, worker, total = (phases[k]["p50"] for k in ("request_ms", "worker_ms", "total_ms"))
        assert 0 <= request <= total and 0 <= worker <= total
        # each request is named in the access log by the x-request-id the client sent
        log = found.parent / f"{policy}-envoy" / "access.log"
        named = {json.loads(line)["request_id"] for line in log.read_text().splitlines()}
        assert {f"bench-{i}" for i in range(FAMILIES * PER_FAMILY)} <= named
        parts = phases["outside_engine_parts"]  # joined with the client's view by that id
        assert parts["joined"] == FAMILIES * PER_FAMILY
        assert parts["request_ms"]["p50"] == request and parts["to_gateway_ms"]["p50"] >= 0
        # what the host's CPUs did over the replay: the EPP, Envoy and the workers all ran
        host = json.loads((found.parent / "router_cpu.json").read_text())
        assert all(host["host"]["cpu_per_s"][g] > 0 for g in ("router", "gateway", "workers"))
        assert 0 < host["host"]["host_busy"] <= 1 and host["cpu_wait_ms_per_request"] >= 0


@pytest.mark.anchor
def test_route_through_sglang_router(tmp_path, tiny_trace):
    try:
        foreign_binary("sglang-router")
    except LaunchError as exc:
        pytest.skip(str(exc))
    args = bench_args(tiny_trace, tmp_path / "out", ["sglang-cache-aware"], "--stream")
    assert route.run(args) == 0
    m = check_results(tmp_path / "out", tiny_trace, "sglang-cache-aware")
    assert m["client_ttft_p50_s"] > 0  # streamed through the foreign router: measured by us


def test_worker_nice_runs_the_fleet_at_that_niceness(tmp_path):
    """`--worker-nice`: each worker process (the mock's Python, once `nice` has exec'd it) that
    much nicer than the bench, whose routers stay at the bench's own niceness."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    args = parser.parse_args(["--worker-nice", "7", "--out", str(tmp_path)])
    spec = worker_spec(args, compression=1.0)
    assert spec.nice == 7
    ports = PortPool()
    (worker,) = worker_procs(1, spec, tmp_path, ports)
    ports.release()
    worker.proc.start()
    try:
        pid = worker.proc.popen.pid
        cmdline, nice = b"", None
        for _ in range(100):  # until `nice` has exec'd the worker (≤ 5 s)
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            nice = os.getpriority(os.PRIO_PROCESS, pid)
            if b"worker" in cmdline and b"nice" not in cmdline.split(b"\0")[0]:
                break
            time.sleep(0.05)
        assert b"--engine=mock" in cmdline
        assert nice == min(own + 7, 19)
        assert os.getpriority(os.PRIO_PROCESS, 0) == own  # the bench (and its routers) unchanged
    finally:
        stop_all([worker.proc])
    with pytest.raises(SystemExit):  # niceness is 0-19: argparse refuses the rest
        parser.parse_args(["--worker-nice", "20"])
