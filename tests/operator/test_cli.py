"""`dynamograph operator`: flags → kopf's run options. (The command as a process is in
test_login.py and test_peering.py.)"""

import argparse
import random

import pytest

from dynamograph.operator.cli import add_arguments, automatic_priority, run, run_options

pytestmark = pytest.mark.unit


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_standalone_by_default():
    options = run_options(parse(), env={})
    assert options == {
        "clusterwide": True,
        "namespaces": [],
        "standalone": True,
        "peering_name": None,
        "priority": None,
        "liveness_endpoint": "http://0.0.0.0:8080/healthz",
    }
    scoped = run_options(parse("--liveness-port", "0"), env={"WATCH_NAMESPACE": "a, b"})
    assert (scoped["clusterwide"], scoped["namespaces"]) == (False, ["a", "b"])
    assert scoped["liveness_endpoint"] is None
    assert run_options(parse("-A"), env={"WATCH_NAMESPACE": "a"})["clusterwide"] is True


def test_peering_flags_and_environment():
    options = run_options(parse("--peering", "dg", "--priority", "7"), env={})
    assert (options["standalone"], options["peering_name"], options["priority"]) == (
        False,
        "dg",
        7,
    )
    env = {"DYNAMOGRAPH_PEERING": "from-env", "DYNAMOGRAPH_PEERING_PRIORITY": "-3"}
    options = run_options(parse(), env=env)
    assert (options["peering_name"], options["priority"]) == ("from-env", -3)
    with pytest.raises(ValueError, match="needs a peering object"):
        run_options(parse("--priority", "5"), env={})
    with pytest.raises(ValueError, match="must be an integer"):
        run_options(parse("--peering", "dg"), env={"DYNAMOGRAPH_PEERING_PRIORITY": "high"})


def test_automatic_priority_favours_the_older_replica_and_never_ties():
    older = run_options(parse("--peering", "dg"), env={}, clock=lambda: 1_800_000_000.0)
    newer = run_options(parse("--peering", "dg"), env={}, clock=lambda: 1_800_000_000.001)
    assert older["priority"] > newer["priority"]
    assert older["priority"] < 0  # any explicit priority (kopf's default 0) outranks replicas
    same_moment = {automatic_priority(1_800_000_000.0, random.Random(seed)) for seed in range(50)}
    assert len(same_moment) > 40  # random tie-breaker digits below the millisecond
    assert all(
        -(1_800_000_000_000 * 1000 + 999) <= p <= -1_800_000_000_000 * 1000 for p in same_moment
    )


def test_bad_peering_settings_exit_with_a_message(capsys):
    assert run(parse("--priority", "5")) == 2
    assert "needs a peering object (--peering NAME)" in capsys.readouterr().out
