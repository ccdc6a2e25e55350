"""The ext_proc configurations the gateways generate, driven with Envoy's message sequences for
each (xds-protos client, real EPP, real mock workers): no protocol_config, no
send_body_without_waiting_for_header_response, a BUFFERED request body, and the response side
in every mode including not sent at all. Each routes, and each frees its booking however the
response ends."""

import asyncio

import grpc
import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from dynamograph.protocol.headers import DESTINATION_ENDPOINT, WORKER_INSTANCE_ID
from e2e.waiting import wait_for

from .conftest import (
    MODEL,
    NO_PROTOCOL_CONFIG,
    body_messages,
    chat_body,
    endpoint_of,
    lb_metadata,
    protocol_config,
    request_headers,
    response_body,
    response_headers,
)

pytestmark = pytest.mark.integration
Mode = processing_mode_pb2.ProcessingMode


def booked(epp) -> int:
    return epp.router.active.total_requests()


def _mutation_headers(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def _route_full_duplex(stream, config, body: bytes) -> pb.ProcessingResponse:
    """Headers (with `config`) and body chunks without waiting, as Envoy streams them in
    FULL_DUPLEX_STREAMED; returns the headers response after checking the re-streamed body."""
    await stream.send(
        request_headers(content_length=len(body), config=config),
        *body_messages(body, chunk=len(body) // 2 + 1),
    )
    first = await stream.recv()
    assert first.HasField("request_headers"), first
    echoed = b""
    while True:
        streamed = (await stream.recv()).request_body.response.body_mutation.streamed_response
        echoed += streamed.body
        if streamed.end_of_stream:
            break
    assert echoed == body
    return first


GATEWAY_LIKE = {
    # What the gateways send: FULL_DUPLEX both ways, the flag unset.
    "full_duplex": protocol_config(),
    # Envoys before 1.33 send no protocol_config at all.
    "no_protocol_config": NO_PROTOCOL_CONFIG,
    # The flag set (our own older config) still works.
    "without_waiting": protocol_config(without_waiting=True),
}


@pytest.mark.parametrize("name", sorted(GATEWAY_LIKE))
async def test_full_duplex_routes_with_any_protocol_config(epp, workers, client, name):
    endpoints = {endpoint_of(w): w.config.instance_id for w in workers}
    stream = client.stream()
    first = await _route_full_duplex(stream, GATEWAY_LIKE[name], chat_body(f"{name} " * 40))
    common = first.request_headers.response
    assert common.clear_route_cache
    destination = _mutation_headers(common)[DESTINATION_ENDPOINT]
    assert destination in endpoints
    assert _mutation_headers(common)[WORKER_INSTANCE_ID] == str(endpoints[destination])
    assert lb_metadata(first) == {"envoy.lb": {DESTINATION_ENDPOINT: destination}}
    assert booked(epp) == 1
    await stream.finish_response()
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


@pytest.mark.parametrize("response_mode", ["STREAMED", "BUFFERED", "BUFFERED_PARTIAL"])
async def test_response_body_in_other_modes_is_continued_unchanged(epp, client, response_mode):
    mode = Mode.BodySendMode.Value(response_mode)
    stream = client.stream()
    await _route_full_duplex(stream, protocol_config(response_mode=mode), chat_body("r " * 50))
    await stream.send(response_headers())
    assert (await stream.recv()).HasField("response_headers")
    chunks = [b'data: {"x": 1}\n\n', b"data: [DONE]\n\n"]
    for i, data in enumerate(chunks):
        await stream.send(response_body(data, end_of_stream=i == len(chunks) - 1))
        answer = await stream.recv()
        # A plain CONTINUE: a streamed_response mutation is only valid in FULL_DUPLEX_STREAMED.
        assert answer.HasField("response_body")
        assert not answer.response_body.response.HasField("body_mutation")
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
    async with asyncio.timeout(10):
        assert await stream.call.read() is grpc.aio.EOF


@pytest.mark.parametrize("headers", ["sent", "skipped"])
async def test_response_body_not_sent_frees_at_stream_close(epp, client, headers):
    """Response body NONE (GAIE's reference Envoy Gateway config), or nothing of the response
    sent at all (kgateway v2.0): Envoy closing the stream at the end of the request frees it."""
    stream = client.stream()
    config = protocol_config(response_mode=Mode.NONE)
    await _route_full_duplex(stream, config, chat_body("no response body " * 30))
    if headers == "sent":
        await stream.send(response_headers())
        assert (await stream.recv()).HasField("response_headers")
    assert booked(epp) == 1  # the response is still under way
    await stream.call.done_writing()  # Envoy's half-close when the HTTP stream ends
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
    assert epp.metrics.responses.labels("cancelled")._value.get() == (0 if headers == "sent" else 1)


async def test_response_body_not_sent_client_gone_frees(epp, client):
    stream = client.stream()
    await _route_full_duplex(
        stream, protocol_config(response_mode=Mode.NONE), chat_body("gone " * 30)
    )
    await stream.send(response_headers())
    await stream.recv()
    assert booked(epp) == 1
    stream.call.cancel()  # Envoy resets the stream: the client went away
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


@pytest.mark.parametrize("mode", ["BUFFERED", "BUFFERED_PARTIAL"])
async def test_buffered_request_body_routes_on_the_body_response(epp, workers, client, mode):
    endpoints = {endpoint_of(w) for w in workers}
    config = protocol_config(request_mode=Mode.BodySendMode.Value(mode))
    body = chat_body("buffered " * 60)
    spoofed = [("x-gateway-destination-endpoint", "127.0.0.1:9901"), ("x-worker-instance-id", "7")]
    stream = client.stream()
    # Envoy waits for the headers answer before it sends the buffered body.
    await stream.send(request_headers(extra=spoofed, content_length=len(body), config=config))
    first = await stream.recv()
    assert first.HasField("request_headers")
    removed = set(first.request_headers.response.header_mutation.remove_headers)
    assert removed == {"x-gateway-destination-endpoint", "x-worker-instance-id"}
    assert not first.request_headers.response.header_mutation.set_headers
    assert booked(epp) == 0
    await stream.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    second = await stream.recv()
    assert second.HasField("request_body")
    common = second.request_body.response
    assert common.clear_route_cache
    assert not common.HasField("body_mutation")  # the body goes on unchanged
    destination = _mutation_headers(common)[DESTINATION_ENDPOINT]
    assert destination in endpoints
    assert lb_metadata(second) == {"envoy.lb": {DESTINATION_ENDPOINT: destination}}
    assert booked(epp) == 1
    await stream.send(response_headers())
    await stream.recv()
    await stream.send(response_body(b"data: [DONE]\n\n", end_of_stream=True))
    await stream.recv()
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


async def test_buffered_partial_body_past_the_buffer_is_413(epp, client):
    config = protocol_config(request_mode=Mode.BUFFERED_PARTIAL)
    stream = client.stream()
    await stream.send(request_headers(content_length=10_000_000, config=config))
    await stream.recv()
    # BUFFERED_PARTIAL hands over what fits with end_of_stream false: the rest would bypass us.
    await stream.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model": "x", ')))
    answer = await stream.recv()
    assert answer.immediate_response.status.code == 413
    assert b"buffer" in answer.immediate_response.body
    assert booked(epp) == 0


async def test_buffered_header_only_request_routes_on_the_headers(epp, workers, client):
    config = protocol_config(request_mode=Mode.BUFFERED)
    stream = client.stream()
    await stream.send(request_headers("/v1/models", "GET", end_of_stream=True, config=config))
    first = await stream.recv()
    destination = _mutation_headers(first.request_headers.response)[DESTINATION_ENDPOINT]
    assert destination in {endpoint_of(w) for w in workers}


@pytest.mark.parametrize("prompt", ["long", "short"])
async def test_response_headers_leave_a_long_prefill_to_kv_events(epp, client, prompt):
    """Response body NONE: the response headers mark the prefill done only for a prompt no KV
    event will settle; a prompt with uncached full blocks waits for its worker to store them
    (this fake gateway never forwards the request, so no event comes here)."""
    guards = []
    pick = epp.service.picker.pick

    async def recording_pick(path, headers, body, subset):
        route = await pick(path, headers, body, subset)
        guards.append(route.guard)
        return route

    epp.service.picker.pick = recording_pick
    stream = client.stream()
    if prompt == "long":
        body = chat_body("a prompt of many blocks " * 40)
    else:  # two tokens: no full block
        body = b'{"model": "%s", "prompt": "hi"}' % MODEL.encode()
    messages = [
        request_headers(
            "/v1/completions" if prompt == "short" else "/v1/chat/completions",
            content_length=len(body),
            config=protocol_config(response_mode=Mode.NONE),
        ),
        *body_messages(body),
    ]
    await stream.send(*messages)
    assert (await stream.recv()).HasField("request_headers")
    await stream.recv()  # the re-streamed body
    (guard,) = guards
    assert guard.awaits_stored_blocks == (prompt == "long")
    await stream.send(response_headers())
    assert (await stream.recv()).HasField("response_headers")
    assert guard.prefill_done == (prompt == "short")
    assert guard.booked  # the response is under way until Envoy ends the stream
    await stream.call.done_writing()
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


@pytest.mark.parametrize("ending", ["buffered", "trailers"])
async def test_a_query_only_request_is_answered_on_the_body_or_trailers(epp, client, ending):
    """`query_instance_id` with a BUFFERED request body (the answer rides on the body response)
    and with the body ended by trailers (no trailers ack after the answer): an
    ImmediateResponse 200 with the query's answer, nothing booked."""
    body = chat_body("what would you pick", nvext={"annotations": ["query_instance_id:"]})
    stream = client.stream()
    if ending == "buffered":
        config = protocol_config(request_mode=Mode.BUFFERED)
        await stream.send(request_headers(content_length=len(body), config=config))
        assert (await stream.recv()).HasField("request_headers")
        await stream.send(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
        )
    else:
        trailers = pb.ProcessingRequest(request_trailers=pb.HttpTrailers())
        await stream.send(
            request_headers(content_length=len(body)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
            trailers,
        )
    answer = (await stream.recv()).immediate_response
    assert answer.status.code == 200
    out = orjson.loads(answer.body)
    assert out["choices"] == [] and out["nvext"]["token_ids"]
    assert booked(epp) == 0
    assert await stream.call.read() is grpc.aio.EOF  # the EPP ended the stream: nothing else
