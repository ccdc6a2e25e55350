"""`dynamograph epp` flags: the router config file, flag overrides, discovery sources."""

import argparse

import pytest

from dynamograph.epp.cli import add_arguments, settings_from_args
from dynamograph.router.discovery import KubernetesSource, StaticSource, source_from_args
from e2e.waiting import wait_for

pytestmark = pytest.mark.unit


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text("temperature: 0.3\nbusy_threshold: 0.9\n")
    args = _parse(
        "--config",
        str(config),
        "--temperature",
        "0",
        "--kv-events",
        "off",
        "--overlap-weight",
        "2.5",
    )
    settings = settings_from_args(args)
    assert [(s.type, s.weight) for s in settings.router.scorers] == [
        ("kv-overlap", 2.5),
        ("load", 0.0025),
        ("kv-overflow", 1.0),
        ("queue-delay", 1.0),
        ("prefill-work", 20.0),  # the fleet's prefill weighs with the rest of prefill
    ]
    assert settings.router.temperature == 0
    assert settings.router.busy_threshold == 0.9
    assert settings.router.use_kv_events is False and settings.kv_events is False
    assert (settings.grpc_port, settings.health_port, settings.metrics_port) == (9002, 9003, 9090)
    assert settings.freeze_heap  # the CLI's process is the EPP's own


def test_config_file_holds_where_no_flag_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("DYNAMOGRAPH_EPP_KV_EVENTS", raising=False)
    config = tmp_path / "router.yaml"
    config.write_text("use_kv_events: false\ntemperature: 0.3\n")
    settings = settings_from_args(_parse("--config", str(config)))
    assert settings.router.use_kv_events is False and settings.kv_events is False
    assert settings.router.temperature == 0.3
    settings = settings_from_args(_parse("--config", str(config), "--kv-events", "on"))
    assert settings.router.use_kv_events is True and settings.kv_events is True
    monkeypatch.setenv("DYNAMOGRAPH_EPP_KV_EVENTS", "on")  # the environment counts as a flag
    settings = settings_from_args(_parse("--config", str(config)))
    assert settings.router.use_kv_events is True and settings.kv_events is True


def test_kv_events_on_by_default(monkeypatch):
    monkeypatch.delenv("DYNAMOGRAPH_EPP_KV_EVENTS", raising=False)
    settings = settings_from_args(_parse())
    assert settings.router.use_kv_events is True and settings.kv_events is True


async def test_heap_frozen_once_started_only_when_asked():
    import gc

    from dynamograph.epp.server import Epp, EppSettings

    async def freeze_count(freeze_heap: bool) -> int:
        epp = Epp(
            EppSettings(
                host="127.0.0.1",
                grpc_port=0,
                health_port=0,
                metrics_port=0,
                freeze_heap=freeze_heap,
            ),
            StaticSource([]),
        )
        await epp.start()
        try:
            if freeze_heap:  # the freeze runs on the loop right after start
                await wait_for(gc.get_freeze_count, "the heap to be frozen", within=10)
            else:
                assert epp._freeze is None  # none scheduled
            return gc.get_freeze_count()
        finally:
            await epp.stop()

    assert gc.get_freeze_count() == 0
    try:
        assert await freeze_count(False) == 0
        assert await freeze_count(True) > 0
    finally:
        gc.unfreeze()  # this test process is shared with the other tests


def test_bad_config_is_a_clear_error(tmp_path):
    config = tmp_path / "router.yaml"
    config.write_text("scorers: [{type: kv-overlap, weight: -1}]\n")
    with pytest.raises(ValueError, match=r"scorers\.0\.weight"):
        settings_from_args(_parse("--config", str(config)))


def test_discovery_sources_from_flags(tmp_path):
    static = source_from_args(_parse("--worker", "http://127.0.0.1:8001=127.0.0.1:9001"))
    assert isinstance(static, StaticSource)
    assert static.targets[0].serving_endpoint == "127.0.0.1:9001"
    k8s = source_from_args(
        _parse("--discovery", "kubernetes", "--namespace", "ns", "--selector", "a=b")
    )
    assert isinstance(k8s, KubernetesSource)
    assert (k8s.namespace, k8s.selector) == ("ns", "a=b")
    with pytest.raises(ValueError, match="--worker"):
        source_from_args(_parse())


def test_objective_flags_give_static_priorities_and_the_pool_to_watch():
    settings = settings_from_args(
        _parse("--objective", "chat=10", "--objective", "batch=-1", "--namespace", "ns1")
    )
    assert settings.objectives == {"chat": 10, "batch": -1}
    assert settings.pool_name is None  # no pool: nothing is watched
    settings = settings_from_args(_parse("--pool-name", "g1", "--namespace", "ns1"))
    assert (settings.pool_name, settings.pool_namespace) == ("g1", "ns1")
    with pytest.raises(ValueError, match="NAME=PRIORITY"):
        settings_from_args(_parse("--objective", "chat=high"))


async def test_kv_ingest_interval_and_loop_lag_reach_the_epp(monkeypatch):
    from dynamograph.epp.server import Epp

    monkeypatch.delenv("DYNAMOGRAPH_EPP_KV_INGEST_INTERVAL", raising=False)
    settings = settings_from_args(_parse("--kv-ingest-interval", "0.03", "--max-loop-lag", "0.2"))
    assert (settings.kv_ingest_interval, settings.admission.max_loop_lag_s) == (0.03, 0.2)
    epp = Epp(settings, StaticSource([]))
    try:
        assert epp.kv is not None and epp.kv.interval_s == 0.03
        assert epp.pipeline.read_events == epp.kv.read_queued  # read before each decision
        assert epp.service.admission.max_lag_s == 0.2
    finally:
        await epp.stop()
    monkeypatch.setenv("DYNAMOGRAPH_EPP_KV_INGEST_INTERVAL", "0.1")
    assert settings_from_args(_parse()).kv_ingest_interval == 0.1
    for flag in ("--kv-ingest-interval", "--max-loop-lag"):
        with pytest.raises(ValueError, match=f"{flag} must be a number of seconds"):
            settings_from_args(_parse(flag, "-1"))
