"""Bad requests get OpenAI error envelopes with a status and a message a person can act on."""

import aiohttp
import openai
import pytest

from dynamograph.worker.testing import mock_worker

from .conftest import MODEL

pytestmark = pytest.mark.integration


@pytest.fixture
async def small():
    async with mock_worker(model=MODEL, context_length=256, kv_events=False) as w:
        yield w


async def raw_post(url, path, data: bytes, headers=None):
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + path, data=data, headers=headers or {}) as resp,
    ):
        return resp.status, await resp.json()


async def test_unknown_model_is_404(small):
    async with openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.NotFoundError) as err:
            await c.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert "no-such-model" in err.value.message and "does not exist" in err.value.message


async def test_malformed_json_is_400(small):
    status, body = await raw_post(small.url, "/v1/chat/completions", b'{"model": ')
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in body["error"]["message"]
    status, body = await raw_post(small.url, "/v1/completions", b"[1, 2]")
    assert status == 400 and "JSON object" in body["error"]["message"]


async def test_over_long_prompt_names_the_limit(small):
    async with openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=MODEL, prompt=[1000] * 400, max_tokens=10)
    message = err.value.message
    assert "maximum context length is 256 tokens" in message
    assert "400 in the messages" in message


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "'max_tokens' must be a positive"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, "only n=1"),
        ({"model": MODEL, "messages": []}, "non-empty 'messages'"),
        ({"model": MODEL, "prompt": "hi", "nvext": {"dp_rank": "one"}}, "nvext.dp_rank"),
        ({"prompt": "hi"}, "'model'"),
        ({"model": MODEL, "prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}},
         "needs remote_engine_id"),
    ],
)  # fmt: skip
async def test_bad_fields_are_400(small, body, fragment):
    import orjson

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, resp = await raw_post(small.url, path, orjson.dumps(body))
    assert status == 400, resp
    assert fragment in resp["error"]["message"]


async def test_bad_dp_rank_header_is_400(small):
    import orjson

    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    status, resp = await raw_post(small.url, "/v1/completions", body, {"X-data-parallel-rank": "3"})
    assert status == 400 and "ranks 0..0" in resp["error"]["message"]
    status, resp = await raw_post(small.url, "/v1/completions", body, {"X-data-parallel-rank": "x"})
    assert status == 400 and "X-data-parallel-rank" in resp["error"]["message"]


async def test_a_10_mb_prompt_of_spaces_is_tokenized_and_refused_with_the_context_limit(small):
    """It was a 500: tiktoken's pre-tokenizer regex backtracks over a run of whitespace and
    gives up past ~1M characters. Long runs of spaces are now encoded without it (exactly:
    tests/protocol/test_tokenization_spaces.py), so the prompt's real length is named."""
    import orjson

    body = orjson.dumps({"model": MODEL, "prompt": " " * 10_000_000, "max_tokens": 1})
    status, resp = await raw_post(small.url, "/v1/completions", body)
    assert status == 400, resp
    message = resp["error"]["message"]
    assert "maximum context length is 256 tokens" in message
    assert "78125 in the messages" in message  # 10M spaces = 78,125 tokens of 128 spaces


async def test_a_prompt_the_tokenizer_gives_up_on_is_400_not_500(small):
    """A long run of whitespace next to a newline still exceeds tiktoken's backtracking limit
    (only runs of spaces alone are split off): a 400 saying so, not a 500."""
    import orjson

    prompt = "x\n" + " " * 1_500_000 + "y"
    body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
    status, resp = await raw_post(small.url, "/v1/completions", body)
    assert status == 400, resp
    # Which it is depends on the encoder in use: tiktoken's regex gives up on this text
    # ("could not be tokenized"); fastokens encodes it, and it is then too long for the model.
    message = resp["error"]["message"]
    assert "could not be tokenized" in message or "maximum context length" in message, message


async def test_negative_seed_is_accepted_as_vllm_does_and_out_of_range_is_400(small):
    """vLLM takes any 64-bit signed seed (`ge=_LONG_INFO.min`); -1 was a 500 here (numpy
    refuses negative seeds). The same seed still gives the same text."""
    async with openai.AsyncOpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0) as c:
        texts = {
            (await c.completions.create(model=MODEL, prompt="hi", max_tokens=8, seed=seed))
            .choices[0]
            .text
            for seed in (-1, -1)
        }
        assert len(texts) == 1
        other = await c.completions.create(model=MODEL, prompt="hi", max_tokens=8, seed=-2)
        assert other.choices[0].text not in texts
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=1, seed=2**63)
        assert "'seed' must be a 64-bit signed integer" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:  # (orjson reads it as a float)
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=1, seed=-(2**63) - 1)
        assert "'seed' must be" in err.value.message


async def test_non_utf8_request_id_is_400_and_debug_requests_keeps_answering(small):
    """A request id that is not text was a 500, and stayed in the request log, where it made
    every later `/debug/requests` a 500 too."""
    import asyncio

    import orjson

    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    port = int(small.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nx-request-id: \xff\xfe\x80id\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
    )
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b"x-request-id must be printable ASCII" in reply
    status, _ = await raw_post(small.url, "/v1/completions", body, {"x-request-id": "x" * 257})
    assert status == 400
    status, resp = await raw_post(small.url, "/v1/completions", body, {"x-request-id": "ok-1"})
    assert status == 200 and resp["id"] == "cmpl-ok-1"
    async with aiohttp.ClientSession() as http, http.get(small.url + "/debug/requests") as r:
        assert r.status == 200
        assert [e["request_id"] for e in (await r.json())["recent"]] == ["ok-1"]


async def test_json_nested_past_the_depth_limit_is_400_naming_it(small):
    """nvext nested 1,000 deep was a RecursionError (500) inside validation."""
    from dynamograph.protocol.openai import MAX_JSON_DEPTH

    head = b'{"model": "%s", "prompt": "hi", "max_tokens": 1, ' % MODEL.encode()
    deep = head + b'"nvext": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}"
    status, resp = await raw_post(small.url, "/v1/completions", deep)
    assert status == 400, resp
    assert f"deeper than {MAX_JSON_DEPTH} levels" in resp["error"]["message"]
    # At the limit (the body itself is level 1) the request is served; the extra field ignored.
    ok = head + b'"x": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    status, resp = await raw_post(small.url, "/v1/completions", ok)
    assert status == 200, resp
