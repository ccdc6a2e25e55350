"""`bench route --workload multiturn --sweep` end to end, tiny: two real mock workers, two rates,
two of our policies (no foreign binary) through the EPP and real Envoy, over the chat API
(the default, the same conversations as text completions, shares the Mooncake smoke test's
path; that the chat template's text tokenizes to the same ids is a unit test).

Small on purpose: a few seconds of arrivals per rate and contexts capped at 8k tokens. It
proves the harness (the generator's chat requests reach the engines with the token counts it
computed, every policy runs at every rate on one fleet with caches reset, the split by turn,
table, JSON and plot), not routing quality or speed.
"""

import argparse
import json

import pytest

from dynamograph.bench import route

pytestmark = pytest.mark.integration

POLICIES = ["round-robin", "kv"]
RATES = [1.0, 2.0]


def test_multiturn_sweep_end_to_end(tmp_path):
    out = tmp_path / "out"
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    args = parser.parse_args(
        ["--workload", "multiturn", "--sweep", "1,2", "--workers", "2", "--duration", "8",
         "--compression", "2", "--max-context", "8000", "--num-gpu-blocks", "4096", "--api", "chat",
         "--policies", *POLICIES, "--out", str(out)]
    )  # fmt: skip
    assert route.run(args) == 0
    data = json.loads((out / "route_sweep.json").read_text())
    points = {(p["rate"], p["policy"]): p for p in data["points"]}
    assert set(points) == {(r, p) for r in RATES for p in POLICIES}
    for rate in RATES:
        stats = data["rates"][str(rate)]
        n = stats["requests"]
        for policy in POLICIES:
            point = points[rate, policy]
            m = point["metrics"]
            assert (m["ok"], m["shed"], m["errors"]) == (n, 0, 0), m["first_error"]
            assert sum(m["per_worker_requests"].values()) == n  # the warm-up is not counted
            assert not point["saturated"]
            assert 0 < point["outside_p50_ms"] <= point["outside_p99_ms"]
            assert 0 < m["ttft_p50_s"] <= m["ttft_p99_s"]
            # caches reset before every run: no policy beats the workload's own reuse
            assert 0 <= m["hit_rate"] <= stats["inherent_reuse"] + 1e-9
            groups = point["groups"]
            assert sum(g["requests"] for g in groups.values()) == n
            assert groups["first turn"]["requests"] == stats["first_turns"] > 0
            if stats["follow_ups"]:
                assert groups["follow-up"]["requests"] == stats["follow_ups"]
            # every turn served and its worker named: each follow-up is counted, moved or not
            assert point["follow_up_moves"]["follow_ups"] == stats["follow_ups"]
            rows = [
                json.loads(line)
                for line in (out / "route-logs" / f"rate-{rate:g}" / policy / "requests.jsonl")
                .read_text()
                .splitlines()
            ]
            assert len(rows) == n
            for row in rows:
                # the engine counted exactly the tokens the generator measured with Qwen's
                assert row["prompt_tokens"] == row["prompt_tokens_expected"] > 0
                assert row["kind"] in ("turn", "document") and row["turn"] >= 1
    assert data["rates"]["2.0"]["requests"] > data["rates"]["1.0"]["requests"]
    assert data["saturated_at"] == dict.fromkeys(POLICIES)
    rr = points[2.0, "round-robin"]["metrics"]["per_worker_requests"]
    assert max(rr.values()) - min(rr.values()) <= 1  # round-robin over two workers
    # kv keeps conversations with their history at least as well as round-robin does
    moved = {p: points[2.0, p]["follow_up_moves"]["moved"] for p in POLICIES}
    assert moved["kv"] <= moved["round-robin"]
    assert (out / "route_sweep.png").stat().st_size > 5000
