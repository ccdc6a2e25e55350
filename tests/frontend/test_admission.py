"""Overload is a fast answer in the frontend's kv mode too (the EPP's rule, router.admission):
past `--max-pending-picks` requests waiting to be routed, or while the event loop runs more than
`--max-loop-lag` behind, a new request gets 429 with Retry-After at once, counted as `shed`,
and is booked nowhere; once the backlog clears, requests are admitted again. The flags belong
to kv mode and are checked as the EPP checks them."""

import argparse
import asyncio
import contextlib
import time
from typing import Any

import aiohttp
import pytest

from dynamograph.frontend import cli
from dynamograph.frontend.routing import Mode
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.admission import (
    DEFAULT_MAX_LOOP_LAG_S,
    DEFAULT_MAX_PENDING_PICKS,
    AdmissionLimits,
)
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for
from tests.loop_hog import loop_hogged

from .conftest import frontend_metric, run_frontend

PROMPT = "Every turn of this conversation starts with the same long briefing. " * 8


async def post(fe, body: dict[str, Any]) -> tuple[int, dict, Any]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(fe.url + "/v1/completions", json=body) as r,
    ):
        return r.status, await r.json(), r.headers


async def test_past_the_pending_bound_new_requests_get_429_at_once(model):
    """A request waiting in the router queue (every worker busy) is one waiting to be routed:
    with `max_pending_picks` 1 the next is refused at once, not queued behind it."""
    config = RouterConfig(busy_threshold=0.05, queue_max_requests=8, queue_timeout_s=30)
    async with (
        mock_worker(num_gpu_blocks=64, speedup=1.0) as small,
        run_frontend(
            None, [small], mode=Mode.KV, router=config, admission=AdmissionLimits(1, 0.0)
        ) as fe,
    ):
        active = fe.routing.router.active
        hog = {"model": model, "prompt": PROMPT, "max_tokens": 800, "ignore_eos": True}
        running = asyncio.create_task(post(fe, hog))
        try:
            await wait_for(lambda: active.total_requests() == 1, what="the hog's booking")
            waiting = asyncio.create_task(
                post(fe, {"model": model, "prompt": "wait", "max_tokens": 1})
            )
            await wait_for(lambda: fe.routing.admission.pending == 1, what="a request to queue")
            assert await frontend_metric(fe, "dynamograph_frontend_pending_picks") == 1

            started = time.monotonic()
            status, out, headers = await post(fe, {"model": model, "prompt": "x", "max_tokens": 1})
            assert status == 429, out
            assert headers["retry-after"] == "1"
            assert "the frontend's router is saturated" in out["error"]["message"]
            assert "1 requests waiting to be routed" in out["error"]["message"]
            assert (
                time.monotonic() - started < 5
            )  # answered, not queued behind the hog's 800 tokens
            assert active.total_requests() == 1  # the refused one booked nothing
            shed = await frontend_metric(fe, "dynamograph_frontend_requests_total", outcome="shed")
            assert shed == 1
        finally:
            running.cancel()  # the client leaves: its booking is freed, the queue moves
            with contextlib.suppress(asyncio.CancelledError):
                await running
        status, out, _ = await waiting
        assert status == 200, out
        assert fe.routing.admission.pending == 0
        status, out, _ = await post(fe, {"model": model, "prompt": "after", "max_tokens": 1})
        assert status == 200, out
        await wait_for(lambda: active.total_requests() == 0, what="every booking to be freed")


async def test_while_the_event_loop_runs_behind_new_requests_get_429_at_once(model):
    """A frontend short of CPU for what it already holds (here: a callback that keeps its loop
    busy 0.3 s at a time) refuses new requests with 429 whatever the count waiting; once the
    loop keeps time again, they are admitted."""
    async with (
        mock_worker() as worker,
        run_frontend(None, [worker], mode=Mode.KV, admission=AdmissionLimits(64, 0.05)) as fe,
    ):
        lag = fe.routing.loop_lag
        status, out, _ = await post(fe, {"model": model, "prompt": "before", "max_tokens": 1})
        assert status == 200, out
        with loop_hogged():
            await wait_for(lambda: lag.behind() > 0.05, what="the loop to run behind")
            assert await frontend_metric(fe, "dynamograph_frontend_loop_lag_seconds") > 0.05
            status, out, headers = await post(fe, {"model": model, "prompt": "x", "max_tokens": 1})
            assert status == 429 and headers["retry-after"] == "1", out
            assert "event loop runs" in out["error"]["message"]
            assert fe.routing.admission.pending == 0
            assert fe.routing.router.active.total_requests() == 0
        await wait_for(lambda: lag.behind() < 0.05, what="the loop to keep time again")
        status, out, _ = await post(fe, {"model": model, "prompt": "after", "max_tokens": 1})
        assert status == 200, out


def _config(*flags: str):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.config_from_args(parser.parse_args(["--worker", "http://127.0.0.1:1", *flags]))


def test_the_flags_bound_kv_mode_and_are_checked(monkeypatch):
    monkeypatch.delenv("DYNAMOGRAPH_FRONTEND_MAX_PENDING_PICKS", raising=False)
    monkeypatch.delenv("DYNAMOGRAPH_FRONTEND_MAX_LOOP_LAG", raising=False)
    limits = _config("--mode", "kv").admission
    assert (limits.max_pending_picks, limits.max_loop_lag_s) == (
        DEFAULT_MAX_PENDING_PICKS,
        DEFAULT_MAX_LOOP_LAG_S,
    )
    limits = _config("--mode", "kv", "--max-pending-picks", "8", "--max-loop-lag", "0").admission
    assert (limits.max_pending_picks, limits.max_loop_lag_s) == (8, 0.0)
    monkeypatch.setenv("DYNAMOGRAPH_FRONTEND_MAX_PENDING_PICKS", "16")
    monkeypatch.setenv("DYNAMOGRAPH_FRONTEND_MAX_LOOP_LAG", "0.25")
    limits = _config("--mode", "kv").admission
    assert (limits.max_pending_picks, limits.max_loop_lag_s) == (16, 0.25)
    assert _config("--mode", "kv", "--max-pending-picks", "4").admission.max_pending_picks == 4
    # the environment alone does not make a round-robin frontend fail: the flags do
    assert _config("--mode", "round-robin").mode is Mode.ROUND_ROBIN
    with pytest.raises(ValueError, match="bound kv mode's routing; --mode is round-robin"):
        _config("--mode", "round-robin", "--max-pending-picks", "4")
    with pytest.raises(ValueError, match="--max-pending-picks must be at least 1"):
        _config("--mode", "kv", "--max-pending-picks", "0")
    with pytest.raises(ValueError, match="--max-loop-lag must be a number of seconds"):
        _config("--mode", "kv", "--max-loop-lag", "nan")
