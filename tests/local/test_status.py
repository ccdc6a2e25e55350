"""The status view: vLLM metrics parsed into per-worker rows; exits shown."""

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from rich.console import Console

from dynamograph.local.spec import Probe, ProcessSpec
from dynamograph.local.stack import Running
from dynamograph.local.status import EngineSample, render, sample_from_metrics

pytestmark = pytest.mark.unit


def vllm_metrics_text():
    """Exposition as a two-rank vLLM-style engine writes it (labels per DP rank)."""
    r = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "", labels, registry=r)
    waiting = Gauge("vllm:num_requests_waiting", "", labels, registry=r)
    usage = Gauge("vllm:kv_cache_usage_perc", "", labels, registry=r)
    queries = Counter("vllm:prefix_cache_queries", "", labels, registry=r)
    hits = Counter("vllm:prefix_cache_hits", "", labels, registry=r)
    done = Counter("vllm:request_success", "", [*labels, "finished_reason"], registry=r)
    for rank, (run, wait, use, q, h) in enumerate([(2, 1, 0.5, 1000, 750), (1, 0, 0.1, 200, 50)]):
        values = ("qwen", str(rank))
        running.labels(*values).set(run)
        waiting.labels(*values).set(wait)
        usage.labels(*values).set(use)
        queries.labels(*values).inc(q)
        hits.labels(*values).inc(h)
        done.labels(*values, "stop").inc(3)
        done.labels(*values, "length").inc(1)
    return generate_latest(r).decode()


def test_sample_sums_ranks_and_averages_usage():
    sample = sample_from_metrics(vllm_metrics_text())
    assert sample.running == 3 and sample.waiting == 1
    assert sample.kv_usage == pytest.approx(0.3)
    assert sample.prefix_queries == 1200 and sample.prefix_hits == 800
    assert sample.hit_rate == pytest.approx(800 / 1200)
    assert sample.requests == 8


def test_no_queries_means_no_hit_rate():
    assert EngineSample().hit_rate is None
    assert sample_from_metrics("") == EngineSample()


def proc(name, kind="engine", exit_code=None, popen=True):
    spec = ProcessSpec(
        name=name,
        kind=kind,
        argv=(),
        stage=0,
        ready=Probe("http", "http://x"),
        ports={},
        role="aggregated" if kind == "engine" else "",
        engine_url="http://127.0.0.1:1",
    )
    running = Running(spec, pid=1, started=None, log=None, popen=object() if popen else None)
    running.exit_code = exit_code
    return running


def text_of(renderable):
    console = Console(width=160, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_render_shows_url_load_cache_hit_rate_and_deaths():
    running = [proc("g-worker-0"), proc("g-worker-1", exit_code=-9), proc("g-epp", "epp")]
    samples = {"g-worker-0": sample_from_metrics(vllm_metrics_text()), "g-worker-1": None}
    out = text_of(
        render("g", "http://127.0.0.1:1234/v1", "qwen", running, samples, ["w1 died"], "bye")
    )
    assert "http://127.0.0.1:1234/v1" in out and "qwen" in out
    row0 = next(line for line in out.splitlines() if "g-worker-0" in line)
    assert "running" in row0 and "30.0%" in row0 and "66.7%" in row0
    row1 = next(line for line in out.splitlines() if "g-worker-1" in line)
    assert "killed by signal 9" in row1
    assert "w1 died" in out and "bye" in out


def test_an_engine_that_does_not_answer_is_flagged():
    out = text_of(render("g", "u", "m", [proc("g-worker-0")], {"g-worker-0": None}))
    assert "not answering" in out


def test_render_shows_supervision_state_restarts_and_last_exit():
    back = proc("g-worker-0")
    back.restarts, back.last_exit = 2, "killed by signal 9"
    waiting = proc("g-epp", "epp", exit_code=-9)
    waiting.state, waiting.restarts, waiting.last_exit = "backing-off", 1, "exited with code 1"
    dead = proc("g-envoy", "envoy", exit_code=1)
    dead.state, dead.restarts, dead.last_exit = "given-up", 4, "exited with code 1"
    samples = {"g-worker-0": sample_from_metrics(vllm_metrics_text())}
    out = text_of(render("g", "u", "m", [back, waiting, dead], samples))

    def cells(name):  # state, restarts, last exit
        row = next(line for line in out.splitlines() if name in line).split("│")
        return row[4].strip(), row[-3].strip(), row[-2].strip()

    assert cells("g-worker-0") == ("running", "2", "killed by signal 9")
    assert cells("g-epp") == ("backing-off", "1", "exited with code 1")
    assert cells("g-envoy") == ("given-up", "4", "exited with code 1")
