"""Dynamo's session actions behind the gateway (issue 20, docs/nvext.md): an `open` binds the
session once the engine accepted the turn — the EPP learns that from the response's `:status`
— and not when the engine refused it. Two EPP replicas with replica sync (docs/epp.md): a
session opened through one is routed to its worker by the other, and closed through the other
it is unbound in both."""

import pytest

from e2e.waiting import wait_for

from .conftest import ExtProcClient, chat_body, response_headers, set_headers, two_replicas

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


async def turn(client: ExtProcClient, control: dict, status: int = 200, **nvext) -> int:
    """One turn of a session through an EPP, answered with `status`: the worker it went to."""
    stream = client.stream()
    body = chat_body("next turn please", nvext={"session_control": control, **nvext})
    first, _, _ = await stream.request(body)
    worker = int(set_headers(first)["x-worker-instance-id"])
    await stream.send(response_headers(status=status, content_type="application/json"))
    assert (await stream.recv()).HasField("response_headers")
    stream.call.cancel()
    return worker


async def test_a_session_opened_through_one_replica_is_sticky_through_the_other(workers):
    async with two_replicas(workers) as (a, b):
        client_a, client_b = ExtProcClient(a.grpc_port), ExtProcClient(b.grpc_port)
        try:
            # One session per worker, each opened through A on its worker (pinned), so that
            # B's unpinned turns can only all land right by following the bindings.
            ids = [w.config.instance_id for w in workers]
            for wid in ids:
                opened = {"session_id": f"chat-{wid}", "action": "open"}
                assert await turn(client_a, opened, backend_instance_id=wid) == wid
            for wid in ids:
                sid = f"chat-{wid}"
                await wait_for(
                    lambda sid=sid, wid=wid: b.router.sessions.binding(sid) == (wid, 0),
                    f"B to hold A's binding of {sid}",
                )
                assert await turn(client_b, {"session_id": sid}) == wid
            # closed through B: it goes to the bound worker, and A unbinds too
            first = f"chat-{ids[0]}"
            assert await turn(client_b, {"session_id": first, "action": "close"}) == ids[0]
            assert b.router.sessions.binding(first) is None
            await wait_for(
                lambda: a.router.sessions.get(first) is None, "A to drop the closed session"
            )
            assert a.router.sessions.binding(f"chat-{ids[1]}") == (ids[1], 0)
        finally:
            await client_a.close()
            await client_b.close()
