"""Unit tests of the helpers both e2e suites share: graph patching, reply parsing, waits."""

import asyncio

import orjson
import pytest

from . import graphs, waiting
from .traffic import (
    Reply,
    affinity_breaks,
    chat_body,
    epp_ready_workers,
    failures,
    metric_sum,
    parse_reply,
    prompt_families,
)
from .waiting import WaitTimeout, wait_for, wait_for_sync

pytestmark = pytest.mark.unit


def test_graph_patches_return_new_manifests():
    base = graphs.load_example("disagg")
    scaled = graphs.with_replicas(base, "decode", 3)
    assert scaled["spec"]["services"]["decode"]["replicas"] == 3
    assert base["spec"]["services"]["decode"]["replicas"] == 2  # input untouched
    fast = graphs.with_engine(base, speedup=100.0)
    engines = graphs.services_of(fast, *graphs.ENGINE_TYPES)
    assert sorted(engines) == ["decode", "prefill"]
    assert all(fast["spec"]["services"][s]["engine"]["speedup"] == 100.0 for s in engines)
    assert "engine" not in fast["spec"]["services"]["epp"]
    cpu = graphs.without_gpus(base)
    assert all(s.get("resources", {}).get("gpu", 0) == 0 for s in cpu["spec"]["services"].values())
    routed = graphs.with_gateway(graphs.with_image(base, "dg:e2e"), "inference-gateway")
    assert routed["spec"]["gateway"]["parentRef"] == {"name": "inference-gateway"}
    assert {s["image"] for s in routed["spec"]["services"].values()} == {"dg:e2e"}
    with pytest.raises(KeyError, match="no service 'nope'"):
        graphs.with_replicas(base, "nope", 1)
    with pytest.raises(ValueError):
        graphs.with_replicas(base, "decode", -1)


def test_parse_reply_reads_worker_ids_and_tolerates_errors():
    body = {"choices": [], "nvext": {"worker_id": {"decode_worker_id": 7, "prefill_worker_id": 9}}}
    reply = parse_reply(200, orjson.dumps(body))
    assert (reply.decode_worker, reply.prefill_worker) == (7, 9)
    assert parse_reply(200, orjson.dumps({"choices": []})).decode_worker is None
    error = parse_reply(503, b"upstream connect error")
    assert error.body is None and error.status == 503
    assert failures([reply, error]) == ["503: upstream connect error"]


def test_affinity_breaks():
    same = [[Reply(200, "", decode_worker=1), Reply(200, "", decode_worker=1)]]
    split = [[Reply(200, "", decode_worker=1), Reply(200, "", decode_worker=2)]]
    missing = [[Reply(200, "", decode_worker=None)]]
    of = lambda r: r.decode_worker  # noqa: E731
    assert affinity_breaks(same, of) == []
    assert affinity_breaks(split, of) == ["family 0: workers [1, 2]"]
    assert affinity_breaks(missing, of) == ["family 0: workers [None]"]


def test_prompt_families_share_prefixes_within_and_differ_across():
    families = prompt_families(3, prefix_words=50, variants=2)
    assert len({f.prefix for f in families}) == 3
    assert all(p.startswith(f.prefix) for f in families for p in f.prompts())
    assert families[0].prefix.split()[0] != families[1].prefix.split()[0]
    assert prompt_families(3, prefix_words=50) == prompt_families(3, prefix_words=50)
    body = chat_body("qwen", "hi")
    assert body["nvext"] == {"extra_fields": ["worker_id"]} and body["stream"] is False


def test_metric_sum_filters_labels():
    text = (
        "# TYPE r counter\n"
        'r_total{mode="direct",outcome="ok"} 3\n'
        'r_total{mode="direct",outcome="timeout"} 1\n'
        'r_total{mode="kv",outcome="ok"} 5\n'
    )
    assert metric_sum(text, "r_total", mode="direct", outcome="ok") == 3
    assert metric_sum(text, "r_total", outcome="ok") == 8
    assert metric_sum(text, "missing_total") == 0


async def test_wait_for_returns_the_first_truthy_value_and_reports_timeouts():
    calls = []

    async def probe():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("not yet")
        return len(calls) >= 3 and "done"

    assert await wait_for(probe, "three calls", within=5, interval=0.01) == "done"
    with pytest.raises(WaitTimeout, match=r"waiting for never; last seen: 0\nstate: x"):
        await wait_for(lambda: 0, "never", within=0.05, interval=0.01, detail=lambda: "state: x")
    await asyncio.sleep(0)


def test_wait_for_sync_uses_its_clock():
    now = [0.0]
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        now[0] += s

    with pytest.raises(
        WaitTimeout, match="timed out after 10s waiting for x; last seen: ValueError"
    ):
        wait_for_sync(
            lambda: int("x"), "x", within=10, interval=2, sleep=sleep, clock=lambda: now[0]
        )
    assert sleeps == [2, 2, 2, 2, 2]
    assert wait_for_sync(lambda: 5, "y", sleep=sleep, clock=lambda: now[0]) == 5


def test_epp_ready_workers_counts_ready_workers_by_role():
    text = (
        "# TYPE dynamograph_epp_workers gauge\n"
        'dynamograph_epp_workers{role="decode",ready="true"} 3\n'
        'dynamograph_epp_workers{role="decode",ready="false"} 1\n'
        'dynamograph_epp_workers{role="prefill",ready="true"} 2\n'
        'dynamograph_epp_workers{role="aggregated",ready="true"} 0\n'
    )
    assert epp_ready_workers(text) == {"decode": 3, "prefill": 2}


async def test_wait_for_probes_early_then_backs_off_to_its_interval(monkeypatch):
    naps = []

    async def nap(seconds):
        naps.append(seconds)

    monkeypatch.setattr(waiting.asyncio, "sleep", nap)
    calls = iter(range(8))
    assert await wait_for(lambda: next(calls) == 7, "the eighth probe", interval=0.05)
    assert naps == [0.01, 0.02, 0.04, 0.05, 0.05, 0.05, 0.05]
