"""`bench route --sweep` pieces that need no fleet: rates, saturation, splits, chat bodies."""

import argparse

import orjson
import pytest

from dynamograph.bench import route
from dynamograph.bench.route_client import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    _read_event,
    body_path,
    chat_body,
    completion_body,
)
from dynamograph.bench.route_metrics import ERROR, OK, SHED, RequestResult, split_metrics, summarize
from dynamograph.bench.route_plots import write_sweep_plot
from dynamograph.bench.route_sweep import (
    AUTO,
    Load,
    TraceSource,
    make_point,
    next_rates,
    parse_sweep,
    saturation,
)
from dynamograph.bench.trace import inherent_reuse, load_trace

pytestmark = pytest.mark.unit


def parse(*argv):
    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_parse_sweep():
    assert parse_sweep(None) is None
    assert parse_sweep("auto") == AUTO == parse_sweep(" AUTO ")
    assert parse_sweep("2,4,8.5") == [2.0, 4.0, 8.5]
    for bad in ("", "2,x", "0,2", "-1"):
        with pytest.raises(ValueError):
            parse_sweep(bad)


def test_listed_rates_in_turn_and_auto_doubles_up_to_the_cap():
    args = parse("--rate", "3", "--max-rate", "20")
    assert next_rates([4.0, 2.0], [], args) == 4.0
    assert next_rates([4.0, 2.0], [4.0], args) == 2.0
    assert next_rates([4.0, 2.0], [4.0, 2.0], args) is None
    assert next_rates(AUTO, [], args) == 3.0
    assert next_rates(AUTO, [3.0, 6.0], args) == 12.0
    assert next_rates(AUTO, [3.0, 6.0, 12.0], args) is None  # 24 > --max-rate
    assert next_rates(AUTO, [], parse()) == 2.0  # the default start


def test_multiturn_defaults_and_flags():
    setup = route.resolve(parse("--workload", "multiturn", "--quick"))
    assert (setup.workers, setup.duration, setup.compression) == (4, 60.0, 3.0)
    setup = route.resolve(parse("--workload", "multiturn", "--workers", "8", "--duration", "30"))
    assert (setup.workers, setup.duration, setup.compression) == (8, 30.0, 2.0)
    assert route.resolve(parse("--quick")).compression == 50.0  # the trace's settings stay
    assert route.run(parse("--workload", "multiturn", "--sweep", "1,nope")) == 2
    assert route.run(parse("--workload", "multiturn", "--duration", "-1")) == 2


def served(i, ttft, prompt=1000, cached=0, e2e=1.0, engine_e2e=0.5):
    r = RequestResult(i, OK, None, e2e, prompt, cached, 10)
    r.engine_ttft_s, r.engine_e2e_s = ttft, engine_e2e
    return r


def test_saturation_is_shedding_or_a_slow_median():
    def m(results):
        return summarize("p", results, inherent_reuse=0.5, time_scale=1.0, wall_s=1.0)

    fast = [served(i, 0.1) for i in range(10)]
    assert saturation(m(fast), ttft_bound_s=1.0) is None
    assert saturation(m([*fast, RequestResult(10, SHED)]), 1.0) == "shed 1"
    assert saturation(m([served(i, 1.0) for i in range(10)]), 1.0) is None  # at the bound
    slow = [served(i, 3.25) for i in range(10)]
    assert saturation(m(slow), 1.0) == "TTFT p50 3.250 s > 1 s"
    assert saturation(m([RequestResult(0, ERROR)]), 1.0) == "nothing served"


def test_split_metrics_by_group():
    results = [
        served(0, 0.5, prompt=1000, cached=0),
        served(1, 0.1, prompt=2000, cached=1500),
        served(2, 0.3, prompt=2000, cached=1000),
        RequestResult(3, SHED),
    ]
    groups = ["first turn", "follow-up", "follow-up", "document"]
    split = split_metrics(results, groups)
    assert split["first turn"] == {
        "requests": 1, "ok": 1, "ttft_p50_s": 0.5, "ttft_p99_s": 0.5, "hit_rate": 0.0
    }  # fmt: skip
    assert split["follow-up"]["ttft_p50_s"] == pytest.approx(0.2)
    assert split["follow-up"]["hit_rate"] == pytest.approx(2500 / 4000)
    assert split["document"] == {
        "requests": 1, "ok": 0, "ttft_p50_s": None, "ttft_p99_s": None, "hit_rate": None
    }  # fmt: skip
    # with each request's inherent reuse: where it was lost (request 2 missed 500 of its 1,500;
    # request 1's cache hits beyond what was reusable do not make up for it)
    split = split_metrics(results, groups, reusable=[0, 1200, 1500, 800])
    assert split["first turn"]["reuse_captured"] is None  # nothing was reusable
    follow = split["follow-up"]
    assert (follow["reusable_tokens"], follow["reuse_lost_tokens"]) == (2700, 500)
    assert follow["reuse_captured"] == pytest.approx(2200 / 2700)
    assert split["document"]["reusable_tokens"] == 0  # shed: not counted


def test_a_point_reports_outside_time_in_wall_ms(tmp_path):
    # client e2e 1.0 wall s at compression 4 = 4 trace s; the engine took 3.5 simulated s
    results = [served(i, 0.1, e2e=1.0, engine_e2e=3.5) for i in range(5)]
    load = Load(2.0, [0.0] * 5, [b""] * 5, ["first turn"] * 5, [{}] * 5, inherent_reuse=0.5)
    point = make_point(2.0, "kv", results, load, 4.0, 1.0, wall_s=1.0)
    assert point.outside_p50_ms == pytest.approx(125.0) == point.outside_p99_ms
    assert not point.saturated and point.groups["first turn"]["ok"] == 5
    rows = [point.as_dict(), {**point.as_dict(), "rate": 4.0}]
    rows.append({**point.as_dict(), "policy": "round-robin"})
    path = write_sweep_plot(tmp_path, rows, title="test")
    assert path.name == "route_sweep.png" and path.stat().st_size > 5000


def test_chat_bodies_go_to_the_chat_endpoint():
    messages = [{"role": "user", "content": 'text with "messages": inside'}]
    chat = chat_body("m", messages, 7, stream=True)
    body = orjson.loads(chat)
    assert body["messages"] == messages and "prompt" not in body
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (7, 7, True)
    assert body["stream_options"] == {"include_usage": True}
    assert body["nvext"] == {"extra_fields": ["worker_id", "timing"]}
    assert body_path(chat) == CHAT_COMPLETIONS
    # a prompt may say "messages": too; JSON escapes its quotes, so it stays a completion
    assert body_path(completion_body("m", '{"messages": []}', 7)) == COMPLETIONS


def test_streamed_chat_chunks_give_a_client_ttft():
    result = RequestResult(0)
    _read_event({"choices": [{"delta": {"role": "assistant"}}]}, result, 0.0, True)
    assert result.ttft_s is None  # the role chunk carries no token
    _read_event({"choices": [{"delta": {"content": "Hi"}}]}, result, 0.0, True)
    assert result.ttft_s is not None and result.ttft_s > 0


def test_the_trace_at_a_set_rate(tmp_path):
    # 11 requests 1 s apart: 10 s at its natural 1.1 requests/s; at rate 4.4 and compression 2
    # the same requests arrive 8x sooner on the wall clock
    lines = [
        orjson.dumps(
            {
                "timestamp": 1000 * i,
                "input_length": 600,
                "output_length": 4,
                "hash_ids": [i % 3, 100 + i],
            }
        ).decode()
        for i in range(11)
    ]
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    args = parse("--sweep", "4.4", "--trace", str(trace), "--families", "1", "--compression", "2")
    source = TraceSource(args, route.resolve(args))
    assert source.natural_rate == pytest.approx(1.1)
    load = source.load(4.4)
    assert load.offsets[-1] == pytest.approx(10.0 / 8)
    assert load.offsets == sorted(load.offsets) and load.offsets[0] == 0.0
    assert len(load.bodies) == 11 and load.groups == ["trace"] * 11
    assert source.load(1.1).bodies is load.bodies  # the same bytes at every rate
    assert load.inherent_reuse == pytest.approx(inherent_reuse(load_trace(trace)))
