"""`dynamograph bench all`: every benchmark in turn, with its defaults, then one summary table.

Each benchmark runs through its own `add_arguments` / `run(args)` (so `bench all` measures
exactly what `bench NAME` measures) and writes its JSON into the same results folder; the
summary reads those files back. A benchmark that is not built, fails or raises is reported as
such and the others still run. `--quick` passes `--quick` to the benchmarks that have it.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path
from typing import Any

from dynamograph.cli.main import NotBuilt, load

from .cli import BENCHMARKS
from .report import add_output_argument, print_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="pass --quick to benchmarks that offer it"
    )
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=[n for n in BENCHMARKS if n != "all"],
        metavar="NAME",
        help="benchmarks to leave out",
    )
    add_output_argument(parser)


def benchmark_args(module, out: Path, quick: bool) -> argparse.Namespace:
    """The Namespace `dynamograph bench NAME [--quick] --out OUT` would give the module."""
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    argv = ["--out", str(out)]
    if quick and any("--quick" in a.option_strings for a in parser._actions):
        argv.append("--quick")
    return parser.parse_args(argv)


def headline(name: str, data: dict[str, Any]) -> str:
    """The few numbers that say how a benchmark went, from its JSON."""
    if isinstance(data.get("summary"), dict):
        return _pairs(data["summary"])
    if name == "route":
        policies = data.get("policies", {})
        parts = [f"inherent reuse {data.get('inherent_reuse', 0):.0%}"]
        for policy in ("round-robin", "kv", "sglang-cache-aware"):
            m = policies.get(policy)
            if m and m.get("ttft_p50_s") is not None:
                parts.append(
                    f"{policy}: TTFT p50 {m['ttft_p50_s']:.3f} s, "
                    f"reuse captured {m['reuse_captured']:.0%}"
                )
        return "; ".join(parts)
    if name == "hashing" and "ratio_p50" in data:
        return _pairs({f"{k} / dynamo": v for k, v in data["ratio_p50"].items()})
    return _pairs(_numbers(data))


_SKIP = {"time", "machine", "config", "benchmark"}
_FIRST = ("ratio", "target_met", "speedup", "error")  # what a headline should say first


def _numbers(data: Any, limit: int = 4) -> dict[str, float]:
    """Up to `limit` numeric leaves, ratios and target verdicts first, then in file order."""
    leaves: list[tuple[str, Any]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, child in value.items():
                if key not in _SKIP:
                    walk(child, f"{path}{key}.")
        elif isinstance(value, list):
            for i, child in enumerate(value):
                walk(child, f"{path[:-1]}[{i}].")
        elif isinstance(value, int | float):
            leaves.append((path[:-1], value))

    walk(data, "")
    rank = {
        path: next((i for i, word in enumerate(_FIRST) if word in path), len(_FIRST))
        for path, _ in leaves
    }
    leaves.sort(key=lambda leaf: rank[leaf[0]])  # stable: file order within a rank
    return dict(leaves[:limit])


def _pairs(values: dict[str, Any]) -> str:
    return ", ".join(
        f"{k} {v:,.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items()
    )


def run(args: argparse.Namespace) -> int:
    rows, summary = [], {}
    failed = 0
    for name, command in BENCHMARKS.items():
        if name == "all" or name in args.skip:
            continue
        print(f"\n=== bench {name} ===", flush=True)
        started = time.monotonic()
        try:
            module = load(command)
            code = module.run(benchmark_args(module, args.out, args.quick)) or 0
            status = "ok" if code == 0 else f"exit {code}"
        except NotBuilt:
            status = "not built"
        except Exception as exc:  # one broken benchmark must not hide the others' numbers
            traceback.print_exc()
            status = f"error: {type(exc).__name__}: {exc}"[:120]
        seconds = time.monotonic() - started
        if status not in ("ok", "not built"):
            failed += 1
        data = _read(args.out / f"{name}.json") if status == "ok" else {}
        line = headline(name, data) if data else ""
        rows.append([name, status, f"{seconds:.0f}", line])
        summary[name] = {"status": status, "seconds": seconds, "headline": line}
    print()
    print_table("dynamograph benchmarks", ["benchmark", "status", "seconds", "headline"], rows)
    write_json(args.out, "all", {"benchmarks": summary})
    return 1 if failed else 0


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
