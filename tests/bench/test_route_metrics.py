"""Routing metrics from replay results, and parsing the engines' /metrics page."""

import pytest

from dynamograph.bench.procstat import GroupUsage, Usage
from dynamograph.bench.route_fleet import parse_worker_metrics
from dynamograph.bench.route_metrics import (
    ERROR,
    OK,
    SHED,
    RequestResult,
    follow_up_moves,
    gateway_phases,
    load_imbalance,
    summarize,
)

pytestmark = pytest.mark.unit


def ok(i, ttft, e2e, prompt, cached, out=10):
    return RequestResult(i, OK, ttft, e2e, prompt, cached, out)


def test_summarize_scales_client_latencies_and_computes_reuse_captured():
    results = [ok(i, ttft=0.01 * (i + 1), e2e=0.1, prompt=1000, cached=500) for i in range(100)]
    for i, r in enumerate(results):
        r.engine_ttft_s, r.engine_e2e_s = 0.02 * (i + 1), 0.5
    results.append(RequestResult(100, SHED, error="HTTP 429"))
    results.append(RequestResult(101, ERROR, error="HTTP 500: boom"))
    m = summarize(
        "kv",
        results,
        inherent_reuse=0.625,
        time_scale=10.0,
        wall_s=2.0,
        per_worker_requests={"a": 60, "b": 40},
    )
    assert (m.requests, m.ok, m.shed, m.errors) == (102, 100, 1, 1)
    assert m.first_error == "HTTP 500: boom"
    assert m.ttft_p50_s == pytest.approx(0.02 * 50.5)  # the engine's clock: not scaled
    assert m.ttft_p99_s == pytest.approx(0.02 * 99.01)
    assert m.client_ttft_p50_s == pytest.approx(10 * 0.505)  # median of 0.01..1.00, scaled
    assert m.e2e_p50_s == pytest.approx(1.0)
    assert m.engine_e2e_p50_s == pytest.approx(0.5)
    assert m.outside_engine_p50_s == pytest.approx(0.5)
    assert m.hit_rate == pytest.approx(0.5)  # shed and failed requests carry no tokens
    assert m.reuse_captured == pytest.approx(0.8)
    assert m.throughput_tok_s == pytest.approx(1000 / 20.0)
    assert m.imbalance == pytest.approx(1.2)


def test_summarize_with_nothing_served():
    m = summarize("rr", [RequestResult(0)], inherent_reuse=0.5, time_scale=1, wall_s=1)
    assert m.ok == 0 and m.ttft_p50_s is None and m.hit_rate == 0.0 and m.imbalance is None


def test_follow_up_moves_count_turns_served_elsewhere_than_their_previous_turn():
    def turn(session, number):
        return {"kind": "turn", "session": session, "turn": number}

    labels = [
        turn(0, 1),  # 0: w1
        turn(1, 1),  # 1: w2
        {"kind": "document", "session": 7, "turn": 1},  # 2: not a conversation
        turn(0, 2),  # 3: w1, stayed
        turn(1, 2),  # 4: w3, moved
        turn(0, 3),  # 5: w2, moved
        turn(1, 3),  # 6: its previous turn moved, this one stays with it (w3)
        turn(2, 1),  # 7: shed
        turn(2, 2),  # 8: no previous turn served: not counted
        turn(0, 4),  # 9: no worker said: not counted, nor is a turn after it
        turn(0, 5),  # 10
    ]
    workers = ["w1", "w2", "w9", "w1", "w3", "w2", "w3", None, "w1", None, "w2"]
    results = [RequestResult(i, SHED if i == 7 else OK, worker=w) for i, w in enumerate(workers)]
    moves = follow_up_moves(results, labels)
    assert moves == {"follow_ups": 4, "moved": 2, "share": 0.5}
    # the Mooncake trace has no sessions
    assert follow_up_moves(results, [{"kind": "trace"}] * len(results)) is None


def test_load_imbalance():
    assert load_imbalance({"a": 5, "b": 5}) == 1.0
    assert load_imbalance({"a": 8, "b": 0, "c": 0, "d": 0}) == 4.0
    assert load_imbalance({}) is None


def test_parse_worker_metrics_sums_labels():
    text = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{finished_reason="length",model_name="m"} 4.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 250.0
"""
    stats = parse_worker_metrics(text)
    assert (stats.requests, stats.prefix_queries, stats.prefix_hits) == (7, 1000, 250)


def test_gateway_phases_count_answered_requests_and_skip_untimed_phases():
    lines = [
        # early
        b'{"start":"99.5","code":"200","request_us":"1000","worker_us":"1000","total_us":"2000"}\n',
        b'{"code":"200","request_us":"10000","worker_us":"100000","response_hold_us":"1000",'
        b'"total_us":"111000"}\n',
        b'{"code":200,"request_us":30000,"worker_us":300000,"response_hold_us":3000,'
        b'"total_us":333000}\n',
        b"\n",
        # refused by the EPP: never reached a worker, so Envoy could not time those phases
        b'{"code":"429","request_us":"-","worker_us":"-","response_hold_us":"-",'
        b'"total_us":"2000"}\n',
        b'{"code":"200","request_us":"20000","worker_us":"-","response_hold_us":"-",'
        b'"total_us":"5000"}\n',
    ]
    phases = gateway_phases(
        [line.replace(b'{"code', b'{"start":"100.0","code') for line in lines], 100
    )
    assert phases["requests"] == 3
    assert phases["request_ms"]["p50"] == 20.0
    assert phases["worker_ms"]["p50"] == 200.0  # of the two that reached a worker
    assert phases["total_ms"]["p99"] == pytest.approx(333 - 0.02 * (333 - 111))
    assert gateway_phases(lines[:1], 100)["requests"] == 0
    assert gateway_phases([])["request_ms"] == {"p50": None, "p90": None, "p99": None}


def test_gateway_phases_split_each_request_outside_the_engine_by_request_id():
    # request 0: sent at 100.000, reached Envoy 5 ms later; Envoy: 20 ms request path, 300 ms
    # worker of which the engine (3x faster clock) reported 0.84 s = 280 ms wall, 4 ms held;
    # Envoy's total 330 ms; the client saw 0.345 s end to end, so 10 ms after the gateway
    a = ok(0, None, 0.345, 100, 0)
    a.sent_at, a.engine_e2e_s = 100.0, 0.84
    b = ok(1, None, 1.0, 100, 0)  # no line of its own in the log: not joined
    b.sent_at, b.engine_e2e_s = 100.0, 0.9
    shed = RequestResult(2, SHED, sent_at=100.0)
    lines = [
        b'{"start":"100.005","request_id":"bench-0","code":200,"request_us":20000,'
        b'"worker_us":300000,"response_hold_us":4000,"total_us":330000}\n',
        b'{"start":"100.005","request_id":"bench-2","code":429,"request_us":"-","worker_us":"-",'
        b'"response_hold_us":"-","total_us":1000}\n',
        b'{"start":"100.005","request_id":"other","code":200,"request_us":9000,"worker_us":9000,'
        b'"response_hold_us":9000,"total_us":30000}\n',
    ]
    parts = gateway_phases(lines, 100, [a, b, shed], time_scale=3.0)["outside_engine_parts"]
    assert parts["joined"] == 1
    got = {k: v["p50"] for k, v in parts.items() if k != "joined"}
    assert got == pytest.approx(
        {"to_gateway_ms": 5, "request_ms": 20, "worker_beyond_engine_ms": 20,
         "response_hold_ms": 4, "after_gateway_ms": 10}, abs=1e-6
    )  # fmt: skip
    assert "outside_engine_parts" not in gateway_phases(lines, 100)  # no client results


def test_summarize_gives_the_routers_cpu_and_wait_per_served_request():
    results = [ok(i, None, 0.1, 100, 0) for i in range(4)]
    results.append(RequestResult(4, SHED))
    host = GroupUsage(
        seconds=2.0,
        host_busy=0.75,
        groups={"router": Usage(cpu_s=0.02, wait_s=0.04), "workers": Usage(1.0, 0.5)},
        threads={},
    )
    m = summarize("kv", results, inherent_reuse=0.5, time_scale=1.0, wall_s=2.0, host=host)
    assert m.router_cpu_ms_per_request == pytest.approx(5.0)  # 20 ms over the 4 served
    assert m.router_cpu_wait_ms_per_request == pytest.approx(10.0)
    assert m.host_busy == 0.75
    bare = summarize("kv", results, inherent_reuse=0.5, time_scale=1.0, wall_s=2.0)
    assert (bare.router_cpu_ms_per_request, bare.host_busy) == (None, None)


def test_dynamo_results_take_their_engines_figures_by_answer_id(tmp_path):
    """Dynamo's frontend answers `nvext.timing` from its own clock; bench route replaces it with
    what the mock reported to the Dynamo worker, found by the answer's id (`cmpl-<request id>`,
    the id the worker's context carried). A result without a record keeps no engine figure."""
    import json

    from dynamograph.bench.route_dynamo import join_engine_view

    rows = [
        {"request_id": "a1b2-c3", "ttft_ms": 120.0, "total_time_ms": 900.0},
        {"request_id": "d4", "ttft_ms": 40.0, "total_time_ms": None},
    ]
    records = [tmp_path / "dynamo-worker-0.jsonl", tmp_path / "dynamo-worker-1.jsonl"]
    records[0].write_text(json.dumps(rows[0]) + "\n")
    records[1].write_text(json.dumps(rows[1]) + "\n")
    results = [
        RequestResult(0, OK, engine_ttft_s=5.0, engine_e2e_s=6.0, response_id="cmpl-a1b2-c3"),
        RequestResult(1, OK, engine_ttft_s=5.0, engine_e2e_s=6.0, response_id="chatcmpl-d4"),
        RequestResult(2, OK, engine_ttft_s=5.0, engine_e2e_s=6.0, response_id="cmpl-unknown"),
        RequestResult(3, SHED),
    ]
    join_engine_view(results, [*records, tmp_path / "missing.jsonl"])
    assert [(r.engine_ttft_s, r.engine_e2e_s) for r in results] == [
        (0.12, 0.9),
        (0.04, None),
        (None, None),
        (None, None),
    ]
