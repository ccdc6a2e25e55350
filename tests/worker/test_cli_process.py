"""`dynamograph worker` as a process: the contract's command line, identity, clean shutdown."""

import argparse
import asyncio
import os

import pytest

from dynamograph.protocol import tokenization
from dynamograph.protocol.engine import Role
from dynamograph.protocol.identity import instance_id
from dynamograph.worker import cli as worker_cli
from dynamograph.worker.testing import mock_worker, worker_process

from .conftest import post_json

pytestmark = pytest.mark.integration


async def test_cli_worker_serves_and_describes_itself():
    os.environ.pop("POD_NAME", None)
    async with worker_process(
        "--model", "Qwen/Qwen3-0.6B", "--served-model-name", "qwen", "--role", "decode",
        "--block-size", "32", "--num-gpu-blocks", "512", "--data-parallel-size", "2",
        "--advertise-host", "10.1.2.3", name="graph-decode-0",
    ) as w:  # fmt: skip
        cfg = w.config
        assert cfg.name == "graph-decode-0" and cfg.instance_id == instance_id("graph-decode-0")
        assert cfg.role is Role.DECODE and cfg.served_model_name == "qwen"
        assert (cfg.kv_cache_block_size, cfg.total_kv_blocks, cfg.data_parallel_size) == (
            32,
            512,
            2,
        )
        assert cfg.kv_events.endpoint.startswith("tcp://10.1.2.3:")
        assert cfg.tokenizer.startswith("qwen:")
        out = await post_json(
            w.url, "/v1/completions", {"model": "qwen", "prompt": "hi", "max_tokens": 2}
        )
        assert out["usage"]["completion_tokens"] == 2
        proc = w.process
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 15) == 0  # SIGTERM drains and exits cleanly


async def test_worker_process_reports_a_failed_start():
    with pytest.raises(RuntimeError, match=r"exited with 2: .*--speedup must be positive"):
        async with worker_process("--speedup", "-1"):
            pass


@pytest.mark.parametrize("flag", [False, True])
async def test_fast_tokenizer_flag_builds_fastokens_before_serving(monkeypatch, flag):
    """`--fast-tokenizer` reaches the engine, which then serves its first request with
    fastokens; without it the reference encodes until it has paid for the build."""
    monkeypatch.setattr(tokenization, "_loaded", type(tokenization._loaded)())
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    args = parser.parse_args(["--tokenizer", "qwen:qwen-7b-chat"] + ["--fast-tokenizer"] * flag)
    config = worker_cli.mock_config(args)
    assert config.fast_tokenizer is flag
    async with mock_worker(tokenizer=config.tokenizer, fast_tokenizer=config.fast_tokenizer) as w:
        assert w.engine.tokenizer.backend == ("fastokens" if flag else "tiktoken")
