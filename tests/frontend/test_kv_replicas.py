"""Two kv-mode frontends as active-active replicas (`--replica-peers`): each one's router
counts the requests the other has under way (router/replicas.py, as between EPPs), a
request's end frees its booking in both, and each exports the sync on /metrics."""

import aiohttp
import pytest

from dynamograph.frontend.routing import Mode
from dynamograph.router.replicas import ReplicaSettings
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import run_frontend

pytestmark = pytest.mark.integration


def booked(fe) -> int:
    return fe.routing.router.active.total_requests()


async def test_kv_frontends_share_their_bookings(model):
    a_port, b_port = free_port(), free_port()

    def sync(own: int, peer: int) -> ReplicaSettings:
        return ReplicaSettings(bind=f"tcp://127.0.0.1:{own}", peers=[f"tcp://127.0.0.1:{peer}"])

    async with (
        mock_worker(speedup=20) as worker,  # slow enough to look at a stream under way
        run_frontend(None, [worker], mode=Mode.KV, replicas=sync(a_port, b_port)) as a,
        run_frontend(None, [worker], mode=Mode.KV, replicas=sync(b_port, a_port)) as b,
        aiohttp.ClientSession() as http,
    ):
        await wait_for(lambda: a.routing.replicas.live_peers() == 1, "a to hear b")
        await wait_for(lambda: b.routing.replicas.live_peers() == 1, "b to hear a")
        body = {"model": model, "prompt": "hello " * 40, "max_tokens": 2000, "stream": True}
        body["ignore_eos"] = True
        async with http.post(a.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")  # under way
            assert booked(a) == 1
            await wait_for(lambda: booked(b) == 1, "b to count a's request")
        # the client hung up: a frees the booking, and b hears it
        await wait_for(lambda: booked(a) == 0 and booked(b) == 0, "both to free it")
        async with http.get(b.url + "/metrics") as page:
            text = await page.text()
        assert "dynamograph_frontend_replica_peers 1.0" in text


def test_replica_flags_turn_the_sync_on_in_kv_mode_only():
    import argparse

    from dynamograph.frontend import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    base = ["--worker", "http://127.0.0.1:1", "--host", "127.0.0.1"]
    assert cli.config_from_args(parser.parse_args([*base, "--mode", "kv"])).replicas is None
    flags = ["--replica-port", "7001", "--replica-peers", "10.0.0.2:7001"]
    settings = cli.config_from_args(parser.parse_args([*base, "--mode", "kv", *flags])).replicas
    assert settings.bind == "tcp://127.0.0.1:7001"
    assert settings.peers == ["tcp://10.0.0.2:7001"]
    with pytest.raises(ValueError, match="kv mode's bookings"):
        cli.config_from_args(parser.parse_args([*base, "--mode", "round-robin", *flags]))
