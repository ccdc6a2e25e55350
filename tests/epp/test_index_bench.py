"""`dynamograph bench index` runs end to end on a tiny workload and writes its JSON."""

import argparse
import json

import pytest

from dynamograph.bench import index as bench

pytest.importorskip("dynamo._core", reason="needs PyPI ai-dynamo-runtime (dev extra)")

pytestmark = [pytest.mark.unit, pytest.mark.anchor]


def test_tiny_run_writes_ratios(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--workers", "3", "--blocks", "300", "--queries", "30", "--query-blocks", "200",
            "--event-sizes", "1", "40", "--memory-workers", "3", "--memory-blocks", "2000",
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert bench.run(args) == 0
    data = json.loads((tmp_path / "index.json").read_text())
    assert [r["event_blocks"] for r in data["ingest"]] == [1, 40]
    assert all(r["blocks"] == 900 for r in data["ingest"])
    assert data["find_matches"]["queries"] == 30 and data["find_matches"]["ratio_p50"] > 0
    assert data["removal"]["blocks"] == 900
    assert data["memory"]["pairs"] == 3 * 2000
    assert data["kernels_warm_up_s"] >= 0
    assert "find_matches" in capsys.readouterr().out
