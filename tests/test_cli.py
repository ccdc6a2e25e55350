"""The `dynamograph` command: help, version, and honest answers for unbuilt components."""

import subprocess
import sys

import pytest

from dynamograph.cli.main import COMMANDS

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
