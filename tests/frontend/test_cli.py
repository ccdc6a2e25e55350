"""`dynamograph frontend` as the operator runs it: its own process, in front of real workers."""

import argparse
import asyncio
import signal
import sys

import openai
import pytest

from dynamograph.frontend import cli
from dynamograph.frontend.server import Frontend
from dynamograph.protocol.engine import Role
from dynamograph.worker.testing import free_port, mock_worker
from e2e.waiting import wait_for

from .conftest import get_json, route

pytestmark = pytest.mark.integration


async def test_frontend_command_serves_and_stops_cleanly(model):
    async with (
        mock_worker(role=Role.DECODE) as decode,
        mock_worker(role=Role.PREFILL) as prefill,
    ):
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "dynamograph.cli", "frontend", "--host", "127.0.0.1"],
            *["--port", str(port), "--engine-url", decode.url, "--worker", prefill.url],
            stderr=asyncio.subprocess.PIPE,
        )
        url = f"http://127.0.0.1:{port}"
        try:

            async def ready() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(f"frontend exited: {await proc.stderr.read()!r}")
                try:
                    health = await get_json(url + "/health")
                except OSError:
                    return False
                return health["status"] == "ok" and health["workers"] == 2

            await wait_for(ready, within=60, what="the frontend process to be ready")
            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key="unused", max_retries=0
            ) as api:
                out = await api.completions.create(
                    model=model,
                    prompt="The hand-off works across processes too. " * 4,
                    max_tokens=3,
                    extra_headers=route(decode, prefill=prefill),
                )
            assert out.usage.completion_tokens == 3
            assert out.usage.prompt_tokens_details.cached_tokens > 0
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            code = await asyncio.wait_for(proc.wait(), 20)
        assert code == 0


def test_direct_mode_needs_the_engine_url(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args([])) == 2
    assert "--engine-url is required in direct mode" in capsys.readouterr().err
    assert cli.run(parser.parse_args(["--mode", "kv", "--discovery", "static"])) == 2
    assert "--mode kv without --engine-url needs workers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "in_file", "expected"),
    [
        ((), "false", False),
        ((), "true", True),
        (("--kv-events", "on"), "false", True),
        (("--kv-events", "off"), "true", False),
    ],
)
def test_kv_events_flag_overrides_the_router_config_only_when_given(
    tmp_path, flags, in_file, expected
):
    config = tmp_path / "router.yaml"
    config.write_text(f"use_kv_events: {in_file}\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--mode", "kv", "--router-config", str(config), *flags])
    frontend = Frontend(cli.config_from_args(args))
    assert frontend.routing.config.use_kv_events is expected


def test_kv_events_on_by_default():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    frontend = Frontend(cli.config_from_args(parser.parse_args(["--mode", "kv"])))
    assert frontend.routing.config.use_kv_events is True
