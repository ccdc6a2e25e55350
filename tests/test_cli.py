"""The `dynamograph` command: help, version, and honest answers for unbuilt components."""

import argparse
import subprocess
import sys

import pytest

from dynamograph.bench.cli import BENCHMARKS
from dynamograph.cli.main import COMMANDS, build_parser, main

pytestmark = pytest.mark.unit


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dynamograph.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("operator", "epp", "frontend", "worker", "up", "crds", "bench"):
        assert name in result.stdout


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == "0.1.0"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name):
    result = run_cli(name, "--help")
    assert result.returncode == 0, result.stderr
    assert COMMANDS[name].help in result.stdout


def test_unknown_subcommand_is_a_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def every_parser(parser, path=()):
    """(command path, parser) for the parser and every subcommand below it, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from every_parser(child, (*path, name))


def test_help_of_every_command_and_subcommand_formats():
    parser, _ = build_parser(None)
    paths = []
    for path, sub in every_parser(parser):
        text = sub.format_help()  # expands each argument's help with `%`, as `--help` does
        assert text.startswith("usage: " + " ".join(("dynamograph", *path))), path
        paths.append(path)
    assert {(name,) for name in COMMANDS} <= set(paths)
    assert {("bench", name) for name in BENCHMARKS} <= set(paths)


def test_bench_subcommand_help_in_process(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "route", "--help"])
    assert exit_.value.code == 0
    assert "--policies" in capsys.readouterr().out


def test_bench_runs_the_benchmark_named(tmp_path):
    others = [name for name in BENCHMARKS if name != "all"]
    result = run_cli("bench", "all", "--skip", *others, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "all.json").exists()
