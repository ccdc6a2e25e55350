"""The EPP driven with Envoy's exact ext_proc message sequences (xds-protos client), in front of
real mock workers: ordering, chunking, header/metadata equality, subset hints, header-only
requests, every refusal, spoofed headers, protocol config, and bookings freed on cancellation."""

import asyncio
import time

import grpc
import orjson
import pytest
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from dynamograph.epp.extproc import MAX_CHUNK_BYTES
from dynamograph.protocol.headers import DESTINATION_ENDPOINT, WORKER_INSTANCE_ID
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.admission import AdmissionLimits
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for
from tests.loop_hog import loop_hogged

from .conftest import (
    MODEL,
    ExtProcClient,
    body_messages,
    chat_body,
    endpoint_of,
    lb_metadata,
    protocol_config,
    removed_headers,
    request_headers,
    response_body,
    response_headers,
    running_epp,
    set_headers,
)

pytestmark = pytest.mark.integration


def booked(epp) -> int:
    return epp.router.active.total_requests()


def _immediate(response: pb.ProcessingResponse) -> tuple[int, dict, dict]:
    immediate = response.immediate_response
    headers = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    return immediate.status.code, headers, orjson.loads(immediate.body)


async def test_routed_request_full_sequence(epp, workers, client):
    endpoints = {endpoint_of(w): w.config.instance_id for w in workers}
    body = chat_body("hello " * 200)
    stream = client.stream()
    # Headers, then the body in three chunks; nothing may come back before the end of the body.
    chunks = body_messages(body, chunk=len(body) // 3 + 1, trailing_empty=False)
    await stream.send(request_headers(content_length=len(body)), *chunks[:-1])
    pending = asyncio.ensure_future(stream.recv())
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done, "the EPP answered before the end of the body"
    await stream.send(chunks[-1])
    first = await pending
    # 1. the headers response: clear_route_cache, destination, routing headers, content-length,
    #    and on the SAME message the envoy.lb dynamic metadata equal to the header.
    assert first.HasField("request_headers")
    assert first.request_headers.response.clear_route_cache
    headers = set_headers(first)
    destination = headers[DESTINATION_ENDPOINT]
    assert destination in endpoints
    assert lb_metadata(first) == {"envoy.lb": {DESTINATION_ENDPOINT: destination}}
    assert headers[WORKER_INSTANCE_ID] == str(endpoints[destination])
    assert headers["content-length"] == str(len(body))
    for option in first.request_headers.response.header_mutation.set_headers:
        assert option.append_action == option.OVERWRITE_IF_EXISTS_OR_ADD
    # 2. then the body, unchanged, ending with end_of_stream.
    second = await stream.recv()
    streamed = second.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    assert booked(epp) == 1
    # 3. the response passes through unchanged; the end of it frees the booking.
    await stream.send(response_headers(served=destination))
    assert (await stream.recv()).HasField("response_headers")
    for data, end in ((b"data: {}\n\n", False), (b"", False), (b"data: [DONE]\n\n", True)):
        await stream.send(response_body(data, end))
        echoed = (await stream.recv()).response_body.response.body_mutation.streamed_response
        assert (echoed.body, echoed.end_of_stream) == (data, end)
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
    await stream.call.done_writing()


async def test_body_rechunked_at_most_62000_bytes(epp, client):
    body = chat_body("lorem ipsum dolor " * 20_000)  # ~360 kB, arriving in 64 KiB chunks
    assert len(body) > 5 * MAX_CHUNK_BYTES
    first, data, chunks = await client.stream().request(body)
    assert set_headers(first)["content-length"] == str(len(body))
    assert data == body
    sizes = [len(c.request_body.response.body_mutation.streamed_response.body) for c in chunks]
    assert max(sizes) <= MAX_CHUNK_BYTES
    assert len(chunks) == -(-len(body) // MAX_CHUNK_BYTES)
    ends = [c.request_body.response.body_mutation.streamed_response.end_of_stream for c in chunks]
    assert ends == [False] * (len(chunks) - 1) + [True]


async def test_body_over_cap_answers_413(workers):
    async with running_epp(workers, max_body_bytes=1024 * 1024) as epp:
        client = ExtProcClient(epp.grpc_port)
        try:
            body = chat_body("x" * (3 * 1024 * 1024 // 2))  # 1.5 MiB > the 1 MiB cap
            first, _, _ = await client.stream().request(body)
            status, headers, error = _immediate(first)
            assert status == 413
            assert headers["content-type"] == "application/json"
            assert "exceeds 1048576 bytes" in error["error"]["message"]
            # Just under the cap still routes.
            ok, data, _ = await client.stream().request(chat_body("y" * 1_000_000))
            assert ok.HasField("request_headers") and len(data) > 1_000_000
            assert booked(epp) == 1
        finally:
            await client.close()


async def test_spoofed_routing_and_gateway_headers_removed(epp, workers, client):
    spoofed = [
        ("x-worker-instance-id", "1"),
        ("x-dynamo-worker-instance-id", "2"),
        ("x-prefill-instance-id", "3"),
        ("x-dp-rank", "7"),
        ("x-gateway-destination-endpoint", "10.9.9.9:80"),
        ("x-gateway-anything", "evil"),
    ]
    first, _, _ = await client.stream().request(chat_body("hi"), extra=spoofed)
    headers = set_headers(first)
    assert headers[DESTINATION_ENDPOINT] in {endpoint_of(w) for w in workers}
    assert headers[WORKER_INSTANCE_ID] in {str(w.config.instance_id) for w in workers}
    removed = set(removed_headers(first))
    # Everything the client sent that the EPP does not overwrite itself is removed.
    assert {"x-dynamo-worker-instance-id", "x-prefill-instance-id", "x-gateway-anything"} <= removed
    assert not removed & set(headers)
    assert "x-dp-rank" in removed or headers.get("x-dp-rank") != "7"


async def test_subset_hint_restricts_and_empty_subset_is_503(epp, workers, client):
    only = endpoint_of(workers[1])
    for _ in range(4):
        first, _, _ = await client.stream().request(chat_body("subset"), subset=[only])
        assert set_headers(first)[DESTINATION_ENDPOINT] == only
        assert lb_metadata(first)["envoy.lb"][DESTINATION_ENDPOINT] == only
    first, _, _ = await client.stream().request(chat_body("subset"), subset=only)  # string form
    assert set_headers(first)[DESTINATION_ENDPOINT] == only
    for subset in ([], ["10.1.1.1:8000"]):
        first, _, _ = await client.stream().request(chat_body("subset"), subset=subset)
        status, _, error = _immediate(first)
        assert status == 503
        assert "subset" in error["error"]["message"]


async def test_header_only_get_goes_to_a_ready_endpoint(epp, workers, client):
    stream = client.stream()
    await stream.send(request_headers("/v1/models", "GET", end_of_stream=True))
    first = await stream.recv()
    headers = set_headers(first)
    assert headers[DESTINATION_ENDPOINT] in {endpoint_of(w) for w in workers}
    assert lb_metadata(first) == {"envoy.lb": {DESTINATION_ENDPOINT: headers[DESTINATION_ENDPOINT]}}
    assert "content-length" not in headers
    await stream.send(response_headers(content_type="application/json"))
    assert (await stream.recv()).HasField("response_headers")
    await stream.send(response_body(b'{"data": []}', end_of_stream=True))
    assert (
        await stream.recv()
    ).response_body.response.body_mutation.streamed_response.end_of_stream


@pytest.mark.parametrize(
    ("body", "path", "status", "needle"),
    [
        (b"{not json", "/v1/chat/completions", 400, "not valid JSON"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "/v1/chat/completions", 400, "model"),
        (chat_body("x", model="no-such-model"), "/v1/chat/completions", 404, "no-such-model"),
        (chat_body("x"), "/v1/embeddings", 404, "/v1/embeddings"),
        (b'{"model": "' + MODEL.encode() + b'"}', "/v1/completions", 400, "prompt"),
    ],
)
async def test_bad_requests_get_openai_errors(epp, client, body, path, status, needle):
    first, _, _ = await client.stream().request(body, path=path)
    code, headers, error = _immediate(first)
    assert code == status
    assert headers["content-type"] == "application/json"
    assert needle in error["error"]["message"]
    assert error["error"]["code"] == status
    assert booked(epp) == 0


async def test_no_eligible_worker_is_503():
    # A worker that never answers /v1/engine: the EPP knows no endpoint.
    async with running_epp([]) as epp:
        client = ExtProcClient(epp.grpc_port)
        try:
            first, _, _ = await client.stream().request(chat_body("x"))
            code, _, error = _immediate(first)
            assert code in (404, 503)  # no worker serves the model yet
            stream = client.stream()
            await stream.send(request_headers("/v1/models", "GET", end_of_stream=True))
            code, _, error = _immediate(await stream.recv())
            assert code == 503 and "no ready worker" in error["error"]["message"]
        finally:
            await client.close()


async def test_prompts_go_to_workers_whose_context_holds_them_else_400():
    """Engines say their max model length (/v1/engine `context_length`): a prompt goes only to
    those it fits with its max_tokens; one that fits none is answered 400 by the EPP itself,
    booking nothing, instead of by the engine it would have been sent to."""
    async with (
        mock_worker(model=MODEL, name="epp-ctx-short", context_length=512) as short,
        mock_worker(model=MODEL, name="epp-ctx-long", context_length=4096) as long,
        running_epp([short, long]) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        held = []
        try:
            for i in range(6):  # ~1,000 tokens: the long-context worker only
                held.append(stream := client.stream())
                first, _, _ = await stream.request(chat_body(f"{i} " + "word " * 1000))
                assert set_headers(first)[DESTINATION_ENDPOINT] == endpoint_of(long)
            too_long = chat_body("word " * 1000, max_tokens=3500)
            first, _, _ = await client.stream().request(too_long)
            code, _, error = _immediate(first)
            assert code == 400
            message = error["error"]["message"]
            assert message.startswith("This model's maximum context length is 4096 tokens.")
            assert "in the messages, 3500 in the completion" in message
            assert booked(epp) == 6  # the routed ones, still under way; nothing for the 400
        finally:
            for stream in held:
                stream.call.cancel()
            await client.close()
        await wait_for(lambda: booked(epp) == 0, "the cancelled streams' bookings to be freed")


async def test_busy_fleet_refuses_503_with_retry_after():
    """Every worker busy: 503 with Retry-After, as Dynamo answers (docs/router.md, busy)."""
    router = RouterConfig(busy_threshold=0.5, retry_after_s=2.0)
    async with (
        mock_worker(model=MODEL, name="epp-small", num_gpu_blocks=64) as worker,
        running_epp([worker], router=router) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        try:
            held = []
            status = None
            for i in range(10):  # each books ~40 of 64 blocks and never finishes
                stream = client.stream()
                first, _, _ = await stream.request(chat_body(f"{i} " + "word " * 600))
                held.append(stream)
                if first.HasField("immediate_response"):
                    status, headers, error = _immediate(first)
                    break
            assert status == 503
            assert headers["retry-after"] == "2"
            assert "busy" in error["error"]["message"]
        finally:
            for stream in held:
                stream.call.cancel()
            await client.close()


@pytest.mark.parametrize("mode", ["NONE", "STREAMED"])
async def test_request_body_mode_it_cannot_serve_fails_precondition(epp, client, mode):
    config = protocol_config(
        request_mode=processing_mode_pb2.ProcessingMode.BodySendMode.Value(mode)
    )
    stream = client.stream()
    await stream.send(request_headers(config=config))
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stream.call.read()
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = failure.value.details()
    # It names the mode it got and the setting to change.
    assert mode in details
    assert "processing_mode.request_body_mode" in details and "FULL_DUPLEX_STREAMED" in details


async def test_trailers_end_the_body(epp, client):
    body = chat_body("with trailers")
    stream = client.stream()
    await stream.send(
        request_headers(content_length=len(body)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body)),
        pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    )
    first, second, third = await stream.recv_n(3)
    assert first.HasField("request_headers")
    streamed = second.request_body.response.body_mutation.streamed_response
    assert streamed.body == body and not streamed.end_of_stream  # the trailers end the stream
    assert third.HasField("request_trailers")


async def test_cancelled_mid_response_frees_the_booking(epp, client):
    stream = client.stream()
    first, _, _ = await stream.request(chat_body("cancel me " * 50))
    assert first.HasField("request_headers")
    await stream.send(response_headers())
    await stream.recv()
    await stream.send(response_body(b"data: {}\n\n"))
    await stream.recv()
    assert booked(epp) == 1
    stream.call.cancel()  # the client went away: Envoy resets the stream
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


async def test_many_concurrent_streams_all_freed(epp, client):
    async def one(i):
        stream = client.stream()
        first, _, _ = await stream.request(chat_body(f"concurrent {i} " * 30))
        assert first.HasField("request_headers")
        await stream.finish_response()

    await asyncio.gather(*(one(i) for i in range(20)))
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


async def test_answered_response_headers_read_the_queued_kv_events(epp, client):
    """Once it has answered a response's headers (awake anyway, that response on its way) the
    EPP reads the KV events queued, so the next pick finds fewer left to read on its path; a
    request's own messages read only at its pick, and response body chunks not at all."""
    original = epp.pipeline.read_events
    assert original is not None  # the EPP reads KV events
    reads = 0

    def counting() -> None:
        nonlocal reads
        reads += 1
        original()

    epp.pipeline.read_events = counting
    try:
        stream = client.stream()
        first, _, _ = await stream.request(chat_body("reads after the response head " * 20))
        assert first.HasField("request_headers")
        assert reads == 1  # the pick's
        await stream.send(response_headers())
        assert (await stream.recv()).HasField("response_headers")
        await wait_for(lambda: reads == 2, "a read after the response headers' answer")
        await stream.send(response_body(b"data: {}\n\n"))
        await stream.recv()
        await stream.send(response_body(b"data: [DONE]\n\n", end_of_stream=True))
        await stream.recv()
        assert reads == 2
    finally:
        epp.pipeline.read_events = original
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


def _ending(kind: str) -> list[pb.ProcessingRequest]:
    if kind == "body":
        return [response_headers(), response_body(b"data: [DONE]\n\n", end_of_stream=True)]
    if kind == "headers":  # a response without a body
        ending = response_headers()
        ending.response_headers.end_of_stream = True
        return [ending]
    return [  # the body ended by trailers
        response_headers(),
        response_body(b"data: [DONE]\n\n"),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
    ]


@pytest.mark.parametrize("kind", ["body", "headers", "trailers"])
async def test_stream_ends_with_ok_once_the_response_is_complete(epp, client, kind):
    stream = client.stream()
    first, _, _ = await stream.request(chat_body(f"ends with {kind} " * 20))
    assert first.HasField("request_headers")
    for message in _ending(kind):
        await stream.send(message)
        assert (await stream.recv()).WhichOneof("response") is not None
    # Nothing is left to process: the EPP closes the stream itself, without waiting for
    # Envoy's half-close, and the booking is free.
    async with asyncio.timeout(10):
        assert await stream.call.read() is grpc.aio.EOF
    assert await stream.call.code() == grpc.StatusCode.OK
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


async def test_past_the_admission_bound_new_requests_get_429_at_once():
    """With `max_pending_picks` requests waiting to be routed (their bodies still arriving), the
    next is refused at its headers with 429 + Retry-After, not queued; once one is routed, new
    requests are admitted again."""
    async with (
        mock_worker(model=MODEL, name="epp-admission") as worker,
        running_epp([worker], admission=AdmissionLimits(max_pending_picks=2)) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        body = chat_body("hello there")
        waiting = [client.stream(), client.stream()]
        try:
            for stream in waiting:  # headers and half a body: admitted, not routed
                await stream.send(request_headers(content_length=len(body)))
                await stream.send(pb.ProcessingRequest(request_body=pb.HttpBody(body=body[:5])))
            await wait_for(
                lambda: epp.service.admission.pending == 2, "two admitted requests", within=10
            )
            assert epp.metrics.registry.get_sample_value("dynamograph_epp_pending_picks") == 2
            refused = client.stream()
            await refused.send(request_headers(content_length=len(body)))
            status, headers, error = _immediate(await refused.recv(within=5))
            assert status == 429 and headers["retry-after"] == "1"
            assert "saturated" in error["error"]["message"]
            # the first waiting request completes its body: routed, and a slot frees
            first = waiting[0]
            await first.send(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=body[5:], end_of_stream=True))
            )
            assert set_headers(await first.recv())["x-worker-instance-id"]
            assert epp.service.admission.pending == 1
            admitted, _, _ = await client.stream().request(body)
            assert not admitted.HasField("immediate_response")
        finally:
            for stream in waiting:
                stream.call.cancel()
            await client.close()
        await wait_for(
            lambda: epp.service.admission.pending == 0, "cancelled streams to leave", within=10
        )


async def test_while_the_event_loop_runs_behind_new_requests_get_429_at_once():
    """An EPP short of CPU for what it already holds (here: a callback that keeps the loop busy
    0.3 s at a time) refuses new requests at their headers with 429 + Retry-After, whatever the
    count waiting to be routed; once the loop keeps time again, they are admitted."""
    async with (
        mock_worker(model=MODEL, name="epp-loop-lag") as worker,
        running_epp([worker], admission=AdmissionLimits(max_loop_lag_s=0.05)) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        try:
            admitted, _, _ = await client.stream().request(chat_body("before"))
            assert not admitted.HasField("immediate_response")
            with loop_hogged():
                await wait_for(lambda: epp.loop_lag.behind() > 0.05, "the loop to run behind")
                refused = client.stream()
                await refused.send(request_headers(content_length=10))
                status, headers, error = _immediate(await refused.recv(within=10))
                assert status == 429 and headers["retry-after"] == "1"
                assert "event loop runs" in error["error"]["message"]
                assert epp.service.admission.pending == 0
                assert booked(epp) == 1  # the first request's booking only: none for the refused
            await wait_for(lambda: epp.loop_lag.behind() < 0.05, "the loop to keep time again")
            admitted, _, _ = await client.stream().request(chat_body("after"))
            assert not admitted.HasField("immediate_response")
        finally:
            await client.close()


async def test_one_long_pause_of_the_event_loop_refuses_nobody():
    """One long pause of the loop (a collection, a slow import: here 1.5 s in one callback) is
    not a backlog: the request that waited through it and the ones after it are admitted, and
    the lag the EPP reports stays under its bound (it read 0.7 s, and refused them, when every
    delay counted)."""
    async with (
        mock_worker(model=MODEL, name="epp-loop-pause") as worker,
        running_epp([worker], admission=AdmissionLimits(max_loop_lag_s=0.05)) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        loop = asyncio.get_running_loop()
        try:
            admitted, _, _ = await client.stream().request(chat_body("before"))
            assert not admitted.HasField("immediate_response")
            loop.call_soon(time.sleep, 1.5)
            waited = asyncio.ensure_future(client.stream().request(chat_body("during")))
            first, _, _ = await waited
            assert not first.HasField("immediate_response"), "refused after one pause"
            for i in range(5):
                after, _, _ = await client.stream().request(chat_body(f"after {i}"))
                assert not after.HasField("immediate_response"), "refused after one pause"
                await asyncio.sleep(0.02)
            assert epp.loop_lag.behind() < 0.05
        finally:
            await client.close()


@pytest.mark.parametrize("filler", ["a", " "], ids=["no-whitespace", "whitespace"])
async def test_a_10_mb_prompt_does_not_hold_up_small_requests(filler):
    """A ~10 MB prompt (BPE's worst case without whitespace, or all spaces) is answered, and
    small requests sent after it are routed before it: its tokenizing runs off the event loop
    and is bounded by max_prompt_chars."""
    async with (
        mock_worker(model=MODEL, name=f"epp-big-{ord(filler)}") as worker,
        running_epp([worker]) as epp,
    ):
        client = ExtProcClient(epp.grpc_port)
        order: list[str] = []

        async def send(name: str, body: bytes) -> None:
            stream = client.stream()
            first, _, _ = await stream.request(body, chunk=1 << 20)
            assert not first.HasField("immediate_response"), _immediate(first)
            order.append(name)
            stream.call.cancel()

        try:
            big = asyncio.create_task(send("big", chat_body(filler * 9_500_000)))
            await wait_for(
                lambda: epp.pipeline.preparing == 1, "the big prompt being tokenized", within=20
            )
            await asyncio.gather(*(send(f"small{i}", chat_body(f"hi {i}")) for i in range(5)))
            await big
        finally:
            await client.close()
        assert order[-1] == "big" and len(order) == 6
        await wait_for(lambda: booked(epp) == 0, "every booking freed", within=10)
