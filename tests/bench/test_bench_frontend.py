"""`dynamograph bench frontend --kv`: the direct-mode hop and the kv-mode frontend (the router in
the hop) in one rotation against one real mock worker. Every request of every path is served
(the bench stops at the first that is not: the kv frontend must route to the worker it
discovered), and the JSON has each path's samples and its process's CPU per request."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.timeout(300)
def test_the_kv_frontend_joins_the_rotation_and_is_measured(tmp_path):
    argv = [sys.executable, "-m", "dynamograph.cli", "bench", "frontend", "--kv"]
    argv += ["--rounds", "3", "--per-round", "2", "--concurrency", "1", "2", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "the kv-mode frontend (routing in the hop)" in done.stdout
    result = json.loads((tmp_path / "frontend.json").read_text())
    rows = result["rows"]
    assert {(r["concurrency"], r["stream"]) for r in rows} == {
        (c, s) for c in (1, 2) for s in (False, True)
    }
    for row in rows:
        for path in ("direct", "frontend", "kv"):
            assert row[path]["requests"] == 3 * 2 * row["concurrency"], (path, row)
        for path in ("frontend", "kv"):  # the two frontends' processes, measured apart
            assert row[path]["cpu_us_per_request"] > 0, (path, row)
            assert "added_paired_ms" in row[path]
    assert result["config"]["kv"] is True
