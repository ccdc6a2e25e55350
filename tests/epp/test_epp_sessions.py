"""Dynamo's session actions behind the gateway (issue 20, docs/nvext.md): an `open` binds the
session once the engine accepted the turn — the EPP learns that from the response's `:status`
— and not when the engine refused it."""

import pytest

from .conftest import chat_body, response_headers, set_headers

pytestmark = pytest.mark.integration


async def test_open_binds_on_the_engines_200_and_not_on_a_refusal(epp, client):
    sessions = epp.router.sessions
    for sid, status in (("accepted", 200), ("refused", 400)):
        control = {"session_control": {"session_id": sid, "action": "open"}}
        stream = client.stream()
        first, _, _ = await stream.request(chat_body("hello there", nvext=control))
        picked = int(set_headers(first)["x-worker-instance-id"])
        assert sessions.binding(sid) is None  # not before the engine answered
        await stream.send(response_headers(status=status, content_type="application/json"))
        assert (await stream.recv()).HasField("response_headers")
        expected = (picked, 0) if status == 200 else None
        assert sessions.binding(sid) == expected
        stream.call.cancel()
