"""`dynamograph bench schedule` runs end to end on a tiny workload, A/B against a git revision."""

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from dynamograph.bench import schedule as bench

pytestmark = pytest.mark.unit

REPO = Path(bench.__file__).resolve().parent.parent


def run(tmp_path, *extra: str) -> dict:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(
        [
            "--workers", "6", "--families", "4", "--prefix-blocks", "24", "--prompt-blocks", "32",
            "--requests", "60", "--live", "3", "--out", str(tmp_path), *extra,
        ]
    )  # fmt: skip
    assert bench.run(args) == 0
    return json.loads((tmp_path / "schedule.json").read_text())


def test_tiny_run_times_the_current_core(tmp_path, capsys):
    data = run(tmp_path)
    assert set(data["cpu_us"]) == {"current"}
    assert data["cpu_us"]["current"]["p50"] > 0
    assert data["decision_mismatches"] is None
    assert "schedule + free" in capsys.readouterr().out


@pytest.mark.skipif(
    shutil.which("git") is None
    or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode,
    reason="needs git and the project's repository (the baseline comes from `git show`)",
)
def test_ab_against_a_revision_compares_every_decision(tmp_path, capsys):
    data = run(tmp_path, "--baseline", "HEAD", "--empty-index")
    assert set(data["cpu_us"]) == {"baseline HEAD", "current"}
    assert data["decision_mismatches"] == 0
    assert "decisions differing between the two: 0" in capsys.readouterr().out
