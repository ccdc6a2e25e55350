"""`bench all`: argument building per benchmark, headlines, and a real run of one benchmark."""

import argparse
import json
from types import SimpleNamespace

import pytest

from dynamograph.bench import all as bench_all
from dynamograph.bench.cli import BENCHMARKS

pytestmark = pytest.mark.unit


def module_with(*flags):
    def add_arguments(parser):
        for flag in flags:
            parser.add_argument(flag, action="store_true")
        parser.add_argument("--out")

    return SimpleNamespace(add_arguments=add_arguments)


def test_quick_is_passed_only_to_benchmarks_that_have_it(tmp_path):
    assert bench_all.benchmark_args(module_with("--quick"), tmp_path, quick=True).quick is True
    args = bench_all.benchmark_args(module_with(), tmp_path, quick=True)
    assert not hasattr(args, "quick") and args.out == str(tmp_path)


def test_headlines():
    route = {
        "inherent_reuse": 0.7,
        "policies": {
            "round-robin": {"ttft_p50_s": 0.5, "reuse_captured": 0.3},
            "kv": {"ttft_p50_s": 0.1, "reuse_captured": 0.9},
        },
    }
    line = bench_all.headline("route", route)
    assert "inherent reuse 70%" in line and "kv: TTFT p50 0.100 s, reuse captured 90%" in line
    assert bench_all.headline("x", {"summary": {"ratio": 0.5}}) == "ratio 0.5"
    generic = bench_all.headline("x", {"time": "t", "a": 1, "b": {"c": 2.5}, "d": "text"})
    assert generic == "a 1, b.c 2.5"
    ranked = {"a": 1, "b": 2, "c": 3, "d": 4, "e": {"ratio_p50": 0.5}, "target_met": True}
    assert bench_all.headline("x", ranked) == "e.ratio_p50 0.5, target_met True, a 1, b 2"


def test_all_runs_a_benchmark_and_summarises(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_all.add_arguments(parser)
    skip = [name for name in BENCHMARKS if name not in ("all", "hashing")]
    args = parser.parse_args(["--out", str(tmp_path), "--skip", *skip])
    assert bench_all.run(args) == 0
    summary = json.loads((tmp_path / "all.json").read_text())["benchmarks"]
    assert list(summary) == ["hashing"]
    assert summary["hashing"]["status"] == "ok"
    assert "ours (u32 array) / dynamo" in summary["hashing"]["headline"]
    assert "dynamograph benchmarks" in capsys.readouterr().out
