"""Frontend pure logic: pins from headers/nvext, mode rules, hand-off bodies, response nvext."""

import orjson
import pytest
from multidict import CIMultiDict

from dynamograph.frontend.handoff import (
    KV_TRANSFER_PARAMS,
    HandoffError,
    decode_request,
    prefill_request,
    reject_client_transfer_params,
    transfer_params,
)
from dynamograph.frontend.nvext_out import (
    FinalChunkInjector,
    Trace,
    add_to_body,
    response_nvext,
    wanted,
)
from dynamograph.frontend.routing import (
    NO_PINS,
    Mode,
    Pins,
    Target,
    check_pins,
    merge,
    pins_from_headers,
    read_pins,
    routing_headers,
)
from dynamograph.protocol.headers import apply_header_routing_overrides, parse_routing_headers
from dynamograph.protocol.nvext import NvExt
from dynamograph.protocol.openai import OpenAIError

pytestmark = pytest.mark.unit


# ---- pins -----------------------------------------------------------------------------------


def test_headers_become_pins():
    nvext = apply_header_routing_overrides(
        None,
        {
            "x-worker-instance-id": "11",
            "x-dp-rank": "1",
            "x-prefill-instance-id": "22",
            "x-prefill-dp-rank": "3",
        },
    )
    assert read_pins(nvext) == Pins(Target(11, 1), Target(22, 3))


def test_dynamo_aliases_and_headers_win_over_body():
    body_nvext = NvExt(backend_instance_id=5, dp_rank=0)
    nvext = apply_header_routing_overrides(
        body_nvext, {"X-Dynamo-Worker-Instance-Id": "7", "x-dynamo-dp-rank": "2"}
    )
    assert read_pins(nvext).decode == Target(7, 2)


def test_decode_worker_id_preferred_over_backend_instance_id():
    assert read_pins(NvExt(backend_instance_id=1, decode_worker_id=2)).decode == Target(2)
    assert read_pins(NvExt(backend_instance_id=1)).decode == Target(1)


def test_unparsable_header_is_ignored_and_unset_prefill_rank_means_none():
    nvext = apply_header_routing_overrides(
        None,
        {
            "x-worker-instance-id": "abc",
            "x-prefill-instance-id": "9",
            "x-prefill-dp-rank": "4294967295",
        },
    )
    pins = read_pins(nvext)
    assert pins.decode is None
    assert pins.prefill == Target(9, None)


def test_no_routing_at_all():
    assert read_pins(None) is NO_PINS
    assert read_pins(NvExt(dp_rank=3)) == Pins(None, None)  # a rank alone names nothing


def test_direct_mode_requires_worker_id_with_the_seed_message():
    with pytest.raises(OpenAIError) as err:
        check_pins(NO_PINS, Mode.DIRECT, enforce_disagg=False)
    assert err.value.status == 400
    assert err.value.message.startswith("Worker ID required")
    assert "expected x-worker-instance-id set by the endpoint picker" in err.value.message


def test_enforce_disagg_names_the_missing_prefill_header():
    with pytest.raises(OpenAIError) as err:
        check_pins(Pins(Target(1)), Mode.DIRECT, enforce_disagg=True)
    assert err.value.status == 400 and "x-prefill-instance-id" in err.value.message
    check_pins(Pins(Target(1), Target(2)), Mode.DIRECT, enforce_disagg=True)


HEADER_CASES = [
    {},
    {"x-worker-instance-id": "11"},
    {"x-worker-instance-id": "11", "x-dp-rank": "2"},
    {"x-dp-rank": "2"},
    {"x-prefill-instance-id": "9", "x-prefill-dp-rank": "4294967295"},
    {"x-worker-instance-id": "x", "x-prefill-instance-id": "9", "x-prefill-dp-rank": "1"},
    {
        "X-Dynamo-Worker-Instance-Id": "5",
        "x-dynamo-dp-rank": "1",
        "x-dynamo-prefill-instance-id": "6",
    },
]


@pytest.mark.parametrize("headers", HEADER_CASES)
def test_fast_path_pins_equal_the_protocol_merge(headers):
    routing = parse_routing_headers(headers)
    assert pins_from_headers(routing) == read_pins(apply_header_routing_overrides(None, headers))
    merged_nvext, merged_pins = merge(None, routing)
    assert merged_pins == pins_from_headers(routing)
    # a DP rank without its worker keeps travelling (in the nvext) for the kv mode's router
    rank_only = routing.dp_rank is not None and routing.worker_id is None
    assert merged_nvext == (apply_header_routing_overrides(None, headers) if rank_only else None)
    body = NvExt(backend_instance_id=3, prefill_worker_id=4, extra_fields=["timing"])
    nvext, pins = merge(body, routing)
    assert nvext == apply_header_routing_overrides(body, headers)
    assert pins == read_pins(nvext) and nvext.wants("timing")


@pytest.mark.parametrize("headers", HEADER_CASES)
def test_memoised_header_parse_equals_the_protocol_parse(headers):
    request_headers = CIMultiDict({"Content-Type": "application/json", **headers})
    for _ in range(2):  # computed, then from the memo
        assert routing_headers(request_headers) == parse_routing_headers(headers)


@pytest.mark.parametrize("mode", [Mode.KV, Mode.ROUND_ROBIN])
def test_picking_modes_accept_unpinned_requests(mode):
    check_pins(NO_PINS, mode, enforce_disagg=True)


# ---- hand-off -------------------------------------------------------------------------------

CLIENT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 64,
    "max_completion_tokens": 64,
    "temperature": 0.5,
}


def test_prefill_leg_is_one_token_not_streamed_with_remote_decode():
    leg = prefill_request(CLIENT)
    assert leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert leg["stream"] is False and "stream_options" not in leg
    assert leg[KV_TRANSFER_PARAMS]["do_remote_decode"] is True
    assert leg["temperature"] == 0.5 and leg["messages"] == CLIENT["messages"]
    assert CLIENT["max_tokens"] == 64 and CLIENT["stream"] is True  # the client's body untouched


def test_prefill_leg_without_max_completion_tokens_does_not_invent_it():
    leg = prefill_request({"model": "m", "prompt": "x"})
    assert leg["max_tokens"] == 1 and "max_completion_tokens" not in leg


def test_decode_leg_restores_the_client_request_and_carries_the_params():
    params = transfer_params({"id": "x", KV_TRANSFER_PARAMS: {"remote_block_ids": [1, 2]}})
    leg = decode_request(CLIENT, params)
    assert leg[KV_TRANSFER_PARAMS] == {"remote_block_ids": [1, 2]}
    assert {k: v for k, v in leg.items() if k != KV_TRANSFER_PARAMS} == CLIENT


@pytest.mark.parametrize("response", [{"id": "x"}, {KV_TRANSFER_PARAMS: None}, [], "x"])
def test_prefill_response_without_params_is_a_handoff_error(response):
    with pytest.raises(HandoffError):
        transfer_params(response)


def test_client_supplied_transfer_params_are_refused():
    with pytest.raises(OpenAIError) as err:
        reject_client_transfer_params({"model": "m", KV_TRANSFER_PARAMS: {"remote_host": "evil"}})
    assert err.value.status == 400 and KV_TRANSFER_PARAMS in err.value.message


# ---- response nvext -------------------------------------------------------------------------


def _trace():
    trace = Trace.begin()
    trace.decode = Target(11, 1)
    trace.prefill = Target(22)
    trace.prefill_s = 0.0123
    trace.first_token_s = 0.02
    return trace


USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 3,
    "prompt_tokens_details": {"cached_tokens": 32},
}


def test_response_nvext_holds_only_what_was_asked():
    assert not wanted(None) and not wanted(NvExt(extra_fields=["other"]))
    only_ids = response_nvext(NvExt(extra_fields=["worker_id"]), _trace(), USAGE)
    assert only_ids == {
        "worker_id": {
            "prefill_worker_id": 22,
            "decode_worker_id": 11,
            "decode_dp_rank": 1,
        }
    }
    both = response_nvext(NvExt(extra_fields=["worker_id", "timing"]), _trace(), USAGE)
    timing = both["timing"]
    assert timing["prefill_time_ms"] == 12.3 and timing["ttft_ms"] == 20.0
    assert timing["cached_tokens"] == 32 and timing["prompt_tokens"] == 40
    assert timing["total_time_ms"] >= 0 and timing["request_received_ms"] > 1.7e12


def _ext(usage):
    return {"worker_id": {"decode_worker_id": 11}, "seen_usage": usage}


def test_non_streaming_body_gains_nvext_and_keeps_the_engines():
    raw = orjson.dumps({"id": "c", "usage": USAGE, "nvext": {"token_ids": [1]}})
    out = orjson.loads(add_to_body(raw, _ext))
    assert out["nvext"]["token_ids"] == [1] and out["nvext"]["worker_id"]["decode_worker_id"] == 11
    assert out["nvext"]["seen_usage"] == USAGE
    assert add_to_body(b"not json", _ext) == b"not json"


def _sse(*objs, done=True):
    events = [b"data: " + orjson.dumps(o) + b"\n\n" for o in objs]
    return b"".join(events) + (b"data: [DONE]\n\n" if done else b"")


def _events(stream: bytes):
    return [e for e in stream.split(b"\n\n") if e]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 10_000])
def test_final_sse_chunk_gains_nvext_whatever_the_chunking(chunk_size):
    chunks = [{"id": "c", "choices": [{"delta": {"content": f"t{i}"}}]} for i in range(5)]
    final = {"id": "c", "choices": [], "usage": USAGE}
    stream = _sse(*chunks, final)
    injector = FinalChunkInjector(_ext)
    out = b"".join(
        injector.feed(stream[i : i + chunk_size]) for i in range(0, len(stream), chunk_size)
    )
    out += injector.close()
    events = _events(out)
    assert events[-1] == b"data: [DONE]"
    assert events[:5] == _events(_sse(*chunks, done=False))  # untouched, in order
    last = orjson.loads(events[5][len(b"data: ") :])
    assert last["usage"] == USAGE and last["nvext"]["seen_usage"] == USAGE


def test_stream_without_done_still_gets_nvext_at_close_and_comments_pass():
    injector = FinalChunkInjector(_ext)
    out = injector.feed(b": keep-alive\n\n" + _sse({"a": 1}, {"b": 2}, done=False))
    assert b'"b"' not in out and b"keep-alive" in out  # the last JSON event is held back
    out += injector.close()
    last = orjson.loads(_events(out)[-1][len(b"data: ") :])
    assert last["b"] == 2 and "nvext" in last


def test_crlf_event_framing():
    injector = FinalChunkInjector(_ext)
    out = injector.feed(b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n') + injector.close()
    assert b'"nvext"' in out and out.endswith(b"data: [DONE]\r\n\r\n")


# ---- metrics --------------------------------------------------------------------------------


def test_per_request_metrics_expose_counts_buckets_and_inflight():
    from prometheus_client.parser import text_string_to_metric_families

    from dynamograph.frontend.metrics import FrontendMetrics

    metrics = FrontendMetrics()
    for _ in range(3):
        metrics.started()
    metrics.finished("direct", "ok", "false", False, 0.001)  # on a bucket bound: counted in it
    metrics.finished("direct", "ok", "false", False, 0.3)
    metrics.first_byte("direct", True, 0.0002)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }
    ok = (("disagg", "false"), ("mode", "direct"), ("outcome", "ok"))
    assert samples[("dynamograph_frontend_requests_total", ok)] == 2
    assert samples[("dynamograph_frontend_inflight_requests", ())] == 1

    def bucket(name, le, stream):
        return samples[(name, (("le", le), ("mode", "direct"), ("stream", stream)))]

    latency = "dynamograph_frontend_request_duration_seconds_bucket"
    assert [bucket(latency, le, "false") for le in ("0.0005", "0.001", "0.25", "0.5", "+Inf")] == [
        0,
        1,
        1,
        2,
        2,
    ]
    labels = (("mode", "direct"), ("stream", "false"))
    assert samples[("dynamograph_frontend_request_duration_seconds_sum", labels)] == 0.301
    assert bucket("dynamograph_frontend_time_to_first_byte_seconds_bucket", "0.0005", "true") == 1
