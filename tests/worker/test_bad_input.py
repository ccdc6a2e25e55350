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
        ({"model": MODEL, "prompt": "hi", "nvext": {"dp_rnak": 1}}, "nvext.dp_rnak"),
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
