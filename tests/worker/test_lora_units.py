"""LoRA pieces of the worker without I/O: the `--lora-modules` forms, vLLM's ids, the vLLM argv
and `--max-loras` in the scheduler."""

import argparse

import numpy as np
import pytest

from dynamograph.protocol.engine import EngineConfig, served_models
from dynamograph.worker import cli as worker_cli
from dynamograph.worker.kv_cache import KvCache
from dynamograph.worker.lora import LoraModule, adapter_ids, parse_lora_module
from dynamograph.worker.mock import MockConfig
from dynamograph.worker.scheduler import Scheduler, Sequence, Status
from dynamograph.worker.vllm import vllm_argv

pytestmark = pytest.mark.unit


def worker_args(*argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    worker_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_lora_modules_take_both_of_vllms_forms_in_load_order():
    args = worker_args(
        "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "qwen"}',
        "--lora-modules", "third=/x",
    )  # fmt: skip
    assert args.lora_modules == [
        LoraModule("sql", "/adapters/sql"),
        LoraModule("chat", "/adapters/chat", "qwen"),
        LoraModule("third", "/x"),
    ]
    assert adapter_ids(args.lora_modules) == {1: "sql", 2: "chat", 3: "third"}
    config = worker_cli.mock_config(args)
    assert config.lora_modules == args.lora_modules and config.max_loras == 1


@pytest.mark.parametrize(
    "bad", ["=path", "name=", "{not json", '{"name": "a"}', '{"name": "a", "path": "/p", "x": 1}']
)
def test_malformed_lora_modules_are_refused_with_the_expected_form(bad):
    with pytest.raises(argparse.ArgumentTypeError, match=r"NAME=PATH|name and path|keys name"):
        parse_lora_module(bad)


def test_adapter_sets_vllm_would_not_serve_are_refused():
    twice = MockConfig(lora_modules=[LoraModule("a", "/1"), LoraModule("a", "/2")])
    with pytest.raises(ValueError, match="'a' is given twice"):
        twice.validate()
    shadow = MockConfig(served_model_name="qwen", lora_modules=[LoraModule("qwen", "/p")])
    with pytest.raises(ValueError, match="served model's name"):
        shadow.validate()
    with pytest.raises(ValueError, match="--max-loras"):
        MockConfig(max_loras=0).validate()


def test_served_models_maps_names_to_adapters_and_bases_win():
    def engine(name, adapters):
        return EngineConfig(
            model="Qwen/Qwen3-0.6B", served_model_name=name, context_length=1024,
            kv_cache_block_size=16, total_kv_blocks=10, max_num_seqs=1,
            max_num_batched_tokens=16, instance_id=1, name="w", tokenizer="qwen",
            lora_adapters=adapters,
        )  # fmt: skip

    pool = [engine("qwen", {1: "sql"}), engine("qwen", {1: "chat", 2: "qwen-2"})]
    assert served_models(pool) == {"qwen": None, "sql": "sql", "chat": "chat", "qwen-2": "qwen-2"}
    # an adapter named like another pool member's base model is that base model
    assert served_models([engine("qwen", {}), engine("other", {1: "qwen"})])["qwen"] is None
    # old workers send no lora_adapters: the base model only
    old = engine("qwen", {}).model_dump(exclude={"lora_adapters"})
    assert served_models([EngineConfig.model_validate(old)]) == {"qwen": None}


def test_vllm_argv_enables_lora_and_passes_the_modules_on():
    args = worker_args("--engine", "vllm", "--lora-modules", "sql=/a/sql",
                       '{"name": "chat", "path": "/a/chat", "base_model_name": "qwen"}',
                       "--max-loras", "4")  # fmt: skip
    argv = vllm_argv(args)
    at = argv.index("--lora-modules")
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "4"
    assert argv[at + 1] == "sql=/a/sql"
    assert parse_lora_module(argv[at + 2]) == LoraModule("chat", "/a/chat", "qwen")
    assert "--enable-lora" not in vllm_argv(worker_args("--engine", "vllm"))


def test_max_loras_keeps_a_second_adapter_waiting_in_its_place():
    bs = 4
    sched = Scheduler(KvCache(64, bs), max_num_seqs=8, max_num_batched_tokens=64, max_loras=1)

    def seq(rid, lora):
        return Sequence(rid, np.arange(8, dtype="<u4") + len(rid), 2, bs, lora_name=lora)

    a1, b1, base, a2 = seq("a1", "a"), seq("b1", "b"), seq("base", None), seq("a2", "a")
    for s in (a1, b1, base, a2):
        sched.add(s)
    plan = sched.schedule(0.0)
    # b1 is skipped (adapter a holds the one slot); base-model and same-adapter work is not
    assert [s.seq for s in plan.scheduled] == [a1, base, a2]
    assert list(sched.waiting) == [b1] and b1.status is Status.WAITING
    for s in (a1, a2):
        sched.remove(s)
    plan = sched.schedule(1.0)
    assert b1 in [s.seq for s in plan.scheduled]  # adapter a drained: b gets the slot
