"""Pure logic of the mock engine: KV cache, scheduler, cost model, stream contract, vLLM argv."""

import argparse
import json

import numpy as np
import pytest

from dynamograph.protocol.graph import VLLM_OWNED_FLAGS, owned_vllm_flag
from dynamograph.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from dynamograph.worker import cli as worker_cli
from dynamograph.worker.cost import CostModel
from dynamograph.worker.engine import (
    EngineOutput,
    FinishReason,
    StreamContractError,
    Usage,
    validate_stream,
)
from dynamograph.worker.kv_cache import KvCache, chained_hashes
from dynamograph.worker.scheduler import Scheduler, Sequence, Status
from dynamograph.worker.vllm import missing, vllm_argv

pytestmark = pytest.mark.unit

BS = 4


def seq(rid, tokens, max_tokens=4):
    return Sequence(rid, np.asarray(tokens, dtype="<u4"), max_tokens, BS)


def test_chained_hashes_depend_on_the_prefix():
    a = chained_hashes(np.arange(8, dtype="<u4"), BS)
    b = chained_hashes(np.r_[np.arange(4, 8), np.arange(4, 8)].astype("<u4"), BS)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first block
    assert chained_hashes(np.arange(8, dtype="<u4"), BS) == a  # deterministic


def test_cache_commit_hit_release_and_lru_eviction():
    cache = KvCache(num_blocks=4, block_size=BS)
    tokens = np.arange(8, dtype="<u4")
    hashes = chained_hashes(tokens, BS)
    blocks = cache.allocate(2)
    cache.commit(blocks, hashes, tokens, 0, None)
    (stored,) = cache.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == hashes and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == BS
    assert cache.cached_prefix(hashes) == blocks
    cache.release(blocks)
    assert cache.usage == 0.0 and cache.cached_prefix(hashes) == blocks  # free but cached
    cache.touch(blocks[:1])  # a prefix hit takes the block out of the free queue
    assert cache.num_free == 3
    fresh = cache.allocate(3)  # uncached blocks go first, then the LRU cached one (blocks[1])
    assert blocks[1] in fresh and blocks[0] not in fresh
    (removed,) = cache.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [hashes[1]]
    assert cache.cached_prefix(hashes) == blocks[:1]
    with pytest.raises(Exception, match="need 1 blocks"):
        cache.allocate(1)
    assert cache.reset() is False  # blocks in use
    cache.release(fresh)
    cache.release(blocks[:1])
    assert cache.reset() is True
    assert isinstance(cache.take_events()[0], AllBlocksCleared) and not cache.cached


def test_each_evicted_block_is_its_own_event_as_vllm_sends_it():
    cache = KvCache(num_blocks=4, block_size=BS)
    tokens = np.arange(4 * BS, dtype="<u4")
    hashes = chained_hashes(tokens, BS)
    blocks = cache.allocate(4)
    cache.commit(blocks, hashes, tokens, 0, None)
    cache.take_events()
    cache.release(blocks)  # tail blocks first: a prefix outlives its suffix
    cache.allocate(3)
    removed = cache.take_events()
    assert [type(e) for e in removed] == [BlockRemoved] * 3
    assert [e.block_hashes for e in removed] == [[hashes[3]], [hashes[2]], [hashes[1]]]


def test_scheduler_prefix_hit_caps_one_token_short_and_chunks_prefill():
    cache = KvCache(num_blocks=16, block_size=BS)
    sched = Scheduler(cache, max_num_seqs=4, max_num_batched_tokens=6)
    first = seq("a", range(12))
    sched.add(first)
    plan = sched.schedule(0.0)
    assert [(s.seq.request_id, s.num_tokens) for s in plan.scheduled] == [("a", 6)]  # chunked
    assert sched.complete(plan) == []  # prompt not finished: no token yet
    plan = sched.schedule(0.0)
    assert sched.complete(plan) == [first]
    first.append(99)
    sched.remove(first)
    cache.release(first.blocks or [])
    # Same 12-token prompt: 2 of 3 blocks hit (the last block holds the token to compute).
    again = seq("b", range(12))
    sched.add(again)
    plan = sched.schedule(0.0)
    assert plan.scheduled[0].computed_before == 8 and plan.scheduled[0].num_tokens == 4
    assert again.num_cached_tokens == 8


def test_scheduler_respects_max_num_seqs_and_preempts_when_full():
    cache = KvCache(num_blocks=4, block_size=BS)
    sched = Scheduler(cache, max_num_seqs=2, max_num_batched_tokens=100)
    a, b, c = seq("a", range(4), 8), seq("b", range(10, 14), 8), seq("c", range(20, 24), 8)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule(0.0)
    assert {s.seq.request_id for s in plan.scheduled} == {"a", "b"} and c.status is Status.WAITING
    for s in sched.complete(plan):
        s.append(1)
    # Both grow one token per step; the 9th token of each needs a third block: 6 > 4 blocks.
    for _ in range(10):
        plan = sched.schedule(0.0)
        for s in sched.complete(plan):
            s.append(1)
        if plan.preempted:
            break
    assert plan.preempted == [b] and b.status is Status.WAITING and b.blocks == []
    assert sched.stats.preemptions == 1


def test_the_priority_policy_admits_by_priority_and_preempts_the_least_important():
    """vLLM's `--scheduling-policy priority`: waiting sequences by (priority, arrival), lower
    first; the preemption victim is the running one last in that order, not the newest."""
    cache = KvCache(num_blocks=6, block_size=BS)
    sched = Scheduler(cache, max_num_seqs=3, max_num_batched_tokens=100, priority_policy=True)
    a, b, c = seq("a", range(4), 8), seq("b", range(10, 14), 8), seq("c", range(20, 24), 8)
    a.priority, b.priority, c.priority = 5, -1, 0
    sched.add(a)
    plan = sched.schedule(0.0)
    for s in sched.complete(plan):
        s.append(1)
    sched.add(c)
    sched.add(b)  # arrives last, goes first
    assert list(sched.waiting) == [b, c]
    for _ in range(10):  # all three grow; 3 blocks each do not fit in 6: one is preempted
        plan = sched.schedule(0.0)
        for s in sched.complete(plan):
            s.append(1)
        if plan.preempted:
            break
    # a, the least important, gives way (first-come order would take c, the newest)
    assert plan.preempted == [a] and a.status is Status.WAITING and list(sched.waiting) == [a]


def test_cost_model_shape():
    cost = CostModel()
    assert cost.step_time(0, 0, []) == 0.0
    one = cost.step_time(1, 100, [])
    batch = cost.step_time(32, 3200, [])
    assert batch < 2 * one  # decode is memory-bound: batching is nearly free
    assert cost.step_time(2000, 0, [(0, 2000)]) > 5 * cost.step_time(200, 0, [(0, 200)])
    assert cost.step_time(64, 0, [(4000, 64)]) > cost.step_time(64, 0, [(0, 64)])
    assert 0 < cost.transfer_time(1000) < cost.step_time(1000, 0, [(0, 1000)])


def out(tokens=1, reason=None, usage=None, error=None):
    return EngineOutput(token_ids=[1] * tokens, finish_reason=reason, usage=usage, error=error)


def test_stream_validator():
    ok = [out(), out(), out(1, FinishReason.LENGTH, Usage(5, 3, 0))]
    assert validate_stream(ok, max_tokens=3).completion_tokens == 3
    bad = {
        "got 0": [out()],
        "without a terminal": [],
        "exactly one terminal": [out(1, FinishReason.STOP, Usage(1, 1, 0))] * 2,
        "usage says": [out(2, FinishReason.STOP, Usage(1, 1, 0))],
        "must say what went wrong": [out(0, FinishReason.ERROR, Usage(1, 0, 0))],
        "max_tokens": [out(3, FinishReason.LENGTH, Usage(1, 3, 0))],
        "no usage": [out(0, FinishReason.CANCELLED)],
        "cached tokens": [out(0, FinishReason.STOP, Usage(1, 0, 2))],
    }
    for fragment, chunks in bad.items():
        with pytest.raises(StreamContractError, match=fragment):
            validate_stream(chunks, max_tokens=2)


def worker_args(*argv):
    parser = argparse.ArgumentParser()
    worker_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_vllm_argv_by_role():
    args = worker_args("--engine", "vllm", "--model", "Qwen/Qwen3-8B", "--served-model-name", "qwen",
                       "--port", "8001", "--block-size", "32", "--data-parallel-size", "2",
                       "--kv-events-port", "6000", "--kv-replay-port", "6100")  # fmt: skip
    argv = vllm_argv(args)
    assert argv[:3] == ["vllm", "serve", "Qwen/Qwen3-8B"]
    flags = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--port"] == "8001" and flags["--served-model-name"] == "qwen"
    assert flags["--block-size"] == "32" and flags["--data-parallel-size"] == "2"
    events = json.loads(flags["--kv-events-config"])
    assert events == {
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:6100", "topic": "",
    }  # fmt: skip
    assert "--kv-transfer-config" not in argv and "--num-gpu-blocks-override" not in argv
    for role in ("prefill", "decode"):
        argv = vllm_argv(worker_args("--engine", "vllm", "--role", role, "--num-gpu-blocks", "100"))
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert transfer == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert argv[argv.index("--num-gpu-blocks-override") + 1] == "100"


def test_every_flag_the_launcher_sets_is_owned_by_the_graph():
    """What `engine.extraArgs` may not repeat (protocol/graph.py) is every flag vllm_argv sets,
    with every option that adds flags turned on."""
    args = worker_args("--engine", "vllm", "--role", "prefill", "--num-gpu-blocks", "8",
                       "--tokenizer", __file__, "--tensor-parallel-size", "4",
                       "--pipeline-parallel-size", "2", "--lora-modules", "a=/a")  # fmt: skip
    argv = vllm_argv(args)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    flags = {a for a in argv if a.startswith("-")}
    assert flags - set(VLLM_OWNED_FLAGS) == set()
    assert {owned_vllm_flag(f) for f in flags} == flags


def test_mock_refuses_tensor_and_pipeline_parallel(capsys):
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        assert worker_cli.run(worker_args(flag, "2")) == 2
        assert "vllm settings" in capsys.readouterr().err


def test_mock_rejects_bad_flags(capsys):
    assert worker_cli.run(worker_args("--speedup", "0")) == 2
    assert "--speedup must be positive" in capsys.readouterr().err
    assert worker_cli.run(worker_args("--max-num-seqs", "0")) == 2


def test_vllm_engine_explains_what_is_missing(capsys):
    problems = missing()
    if not problems:
        pytest.skip("vLLM is installed here; the missing-vLLM path cannot be exercised")
    assert worker_cli.run(worker_args("--engine", "vllm")) == 2
    err = capsys.readouterr().err
    assert "vllm" in err and "--engine mock" in err


def test_protocol_decodes_vllm_024_map_layout_too():
    """vLLM >= 0.24 encodes events as `type`-tagged maps; the shared decoder reads every layout."""
    import msgpack

    from dynamograph.protocol.kv_events import decode_batch

    payload = msgpack.packb([
        1.5,
        [
            {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
             "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
             "lora_name": None, "group_idx": 0},
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ])  # fmt: skip
    batch = decode_batch(payload)
    stored, removed, cleared = batch.events
    assert stored == BlockStored([7, 8], None, list(range(32)), 16, None, "GPU")
    assert removed == BlockRemoved([7], "GPU") and isinstance(cleared, AllBlocksCleared)
    from dynamograph.protocol.kv_events import LAYOUTS, EventBatch, encode_batch

    again = EventBatch(1.5, [stored, removed, cleared], 0)
    for layout in LAYOUTS:
        assert decode_batch(encode_batch(again, layout=layout)) == again, layout
    with pytest.raises(ValueError, match="lacks token_ids"):
        decode_batch(msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                           "parent_block_hash": None, "block_size": 16}], 0]))  # fmt: skip


async def test_output_collector_merges_while_the_reader_lags():
    from dynamograph.worker.engine import OutputCollector

    c = OutputCollector()
    c.put(EngineOutput(token_ids=[1], text=" a"))
    c.put(EngineOutput(token_ids=[2], text=" b"))
    c.put(
        EngineOutput(
            token_ids=[3], text=" c", finish_reason=FinishReason.LENGTH, usage=Usage(1, 3, 0)
        )
    )
    merged = await c.get()
    assert merged.token_ids == [1, 2, 3] and merged.text == " a b c"
    assert merged.finish_reason is FinishReason.LENGTH and merged.usage.completion_tokens == 3
    validate_stream([merged], max_tokens=3)


@pytest.mark.parametrize("final_only", [False, True])
async def test_output_collector_final_only_wakes_its_reader_for_the_first_and_last_token(
    final_only,
):
    """A non-streamed request's reader (vLLM's FINAL_ONLY) is woken twice, whatever the
    length: for the first token (its time) and for the rest merged with the finish."""
    import asyncio

    from dynamograph.worker.engine import OutputCollector

    c = OutputCollector(final_only=final_only)
    got: list[EngineOutput] = []

    async def read() -> None:
        while not (got and got[-1].is_terminal):
            got.append(await c.get())

    reader = asyncio.create_task(read())
    for i in range(1, 6):
        await asyncio.sleep(0)  # the reader runs whenever it has been woken
        last = i == 5
        c.put(
            EngineOutput(
                token_ids=[i], text=f" {i}", usage=Usage(1, 5, 0) if last else None,
                finish_reason=FinishReason.LENGTH if last else None,
            )
        )  # fmt: skip
    await asyncio.wait_for(reader, 5)
    assert [o.token_ids for o in got] == (
        [[1], [2, 3, 4, 5]] if final_only else [[1], [2], [3], [4], [5]]
    )
    validate_stream(got, max_tokens=5)
