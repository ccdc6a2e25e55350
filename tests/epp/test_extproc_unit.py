"""Pure parts of the ext_proc server and the load scraper: chunking, subset hints, protocol
config checks, immediate responses, vLLM metrics parsing."""

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

from dynamograph.epp.extproc import (
    MAX_CHUNK_BYTES,
    ProtocolViolation,
    _subset_hint,
    body_chunks,
    check_protocol_config,
    immediate_response,
)
from dynamograph.protocol.openai import OpenAIError
from dynamograph.router.load import parse_load

from .conftest import protocol_config

pytestmark = pytest.mark.unit
Mode = processing_mode_pb2.ProcessingMode


@pytest.mark.parametrize("size", [0, 1, MAX_CHUNK_BYTES, MAX_CHUNK_BYTES + 1, 5 * MAX_CHUNK_BYTES])
def test_body_chunks_cover_body_within_limit(size):
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    chunks = [c.request_body.response.body_mutation.streamed_response for c in body_chunks(body)]
    assert b"".join(c.body for c in chunks) == body
    assert all(len(c.body) <= MAX_CHUNK_BYTES for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks) == max(1, -(-size // MAX_CHUNK_BYTES))


def test_protocol_config_check_accepts_what_gateways_send():
    # What the gateways configure (send_body_without_waiting_for_header_response unset), with
    # the flag set, buffered request bodies, and the response side in every mode.
    for response_mode in (Mode.FULL_DUPLEX_STREAMED, Mode.NONE, Mode.STREAMED, Mode.BUFFERED):
        for request_mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED, Mode.BUFFERED_PARTIAL):
            for without_waiting in (False, True):
                check_protocol_config(
                    protocol_config(request_mode, response_mode, without_waiting=without_waiting)
                )
    for bad in (Mode.NONE, Mode.STREAMED):
        with pytest.raises(ProtocolViolation, match=r"processing_mode\.request_body_mode"):
            check_protocol_config(protocol_config(request_mode=bad))


def test_subset_hint_forms():
    metadata = base_pb2.Metadata()
    assert _subset_hint(metadata) is None
    fields = metadata.filter_metadata["envoy.lb.subset_hint"].fields
    assert _subset_hint(metadata) is None  # namespace without the key: no hint
    fields["x-gateway-destination-endpoint-subset"].list_value.values.add().string_value = "a:1"
    assert _subset_hint(metadata) == frozenset({"a:1"})
    fields["x-gateway-destination-endpoint-subset"].string_value = "a:1, b:2"
    assert _subset_hint(metadata) == frozenset({"a:1", "b:2"})
    fields["x-gateway-destination-endpoint-subset"].list_value.Clear()
    assert _subset_hint(metadata) == frozenset()


def test_immediate_response_has_json_body_and_retry_after():
    response = immediate_response(OpenAIError(429, "all workers are busy", retry_after_s=1.4))
    immediate = response.immediate_response
    assert immediate.status.code == 429
    headers = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert headers == {"content-type": b"application/json", "retry-after": b"1"}
    assert orjson.loads(immediate.body)["error"]["message"] == "all workers are busy"


def test_parse_vllm_load():
    text = """# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0"} 9
other_metric 1
"""
    assert parse_load(text) == {
        0: {"waiting": 3.0, "running": 7.0, "kv_usage": 0.25},
        1: {"waiting": 1.0, "kv_usage": 0.5},
    }
    assert parse_load("vllm:num_requests_running 2\n") == {0: {"running": 2.0}}


def test_parse_vllm_load_reads_bytes_and_skips_look_alikes():
    page = b"""# HELP vllm:num_requests_waiting waiting requests
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="kv"} 99
vllm:num_requests_waiting{engine="0"} 4 1700000000000
vllm:num_requests_waiting{engine="2"} 1e1
vllm:num_requests_running{engine="2",model_name="m"} NaN-ish
vllm:kv_cache_usage_perc 0.75"""  # no final newline
    assert parse_load(page) == {0: {"waiting": 4.0, "kv_usage": 0.75}, 2: {"waiting": 10.0}}
    assert parse_load(b"") == {}
    assert parse_load(b"# only comments\nvllm:other 1\n") == {}


def test_response_status_counts_by_class():
    from dynamograph.epp.metrics import EppMetrics

    metrics = EppMetrics()
    for status in (200, 201, 404, 503, 503, 799):
        metrics.response_status(status)
    value = metrics.registry.get_sample_value
    total = "dynamograph_epp_responses_total"
    assert value(total, {"status": "2xx"}) == 2
    assert value(total, {"status": "4xx"}) == 1
    assert value(total, {"status": "5xx"}) == 2
    assert value(total, {"status": "7xx"}) == 1


async def test_a_picker_bug_answers_500_not_a_hang():
    from dynamograph.epp.extproc import Exchange
    from dynamograph.epp.metrics import EppMetrics

    from .conftest import body_messages, request_headers

    class Broken:
        async def pick(self, path, headers, body, subset):
            raise RuntimeError("boom")

        def pick_any(self, subset):
            raise RuntimeError("boom")

    exchange = Exchange(Broken(), EppMetrics(), 1 << 20)
    assert await exchange.on_message(request_headers(content_length=2)) == []
    (start, end) = body_messages(b"{}", trailing_empty=True)
    assert await exchange.on_message(start) == []
    (response,) = await exchange.on_message(end)
    assert response.immediate_response.status.code == 500
    assert b"boom" in response.immediate_response.body
    assert exchange.done
