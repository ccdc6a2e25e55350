"""The index reads a batch the same whether the compiled parser decoded it (numpy arrays) or
`decode_batch` did (lists), and whether it applies the parser's rows in one kernel call
(`KvIndex.apply_batch`) or event by event: the same prefix keys stored, the same blocks held and
matched, on a stream with what engines send (chains, evictions, signed and u64 engine hashes,
LoRA ids and names, a BlockStored with fewer hashes than full blocks, one of another block size,
an unknown parent, a clear, batches too big for the tables). And the EPP's subscribers take the
parser's path."""

import numpy as np
import pytest
import zmq.asyncio

from dynamograph.protocol import kv_events
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
    parse_batch,
)
from dynamograph.router import kernels
from dynamograph.router.index import KvIndex
from dynamograph.router.kv_events import RankSubscriber, Ticker
from dynamograph.router.scheduler import GapInfo, Router

pytestmark = pytest.mark.unit

BS = 4  # not one the compiled hasher takes: apply_batch goes event by event
KERNEL_BS = 16


def _stream(
    rng: np.random.Generator, signed: bool, bs: int = BS
) -> tuple[list[bytes], list[list[int]]]:
    """Payloads of two slots' events and the token prefixes they stored (the queries)."""
    payloads, prefixes = [], []
    held: dict[int, list[tuple[int, list[int]]]] = {0: [], 1: []}  # rank → (engine hash, tokens)
    next_hash = -(1 << 62) if signed else (1 << 64) - 5000  # negative ints / ints ≥ 2^63
    for step in range(120):
        rank = int(rng.integers(0, 2))
        chain = held[rank]
        n = int(rng.integers(1, 6))
        tokens = rng.integers(0, 1 << 32, n * bs + int(rng.integers(0, bs)), np.uint64).tolist()
        hashes = list(range(next_hash, next_hash + n))
        next_hash += n
        parent = chain[-1][0] if chain else None
        if step % 17 == 5:
            parent = 12345  # unknown to the slot: the event is skipped
        events: list = []
        if step % 13 == 7 and n > 1:
            hashes = hashes[:-1]  # fewer engine hashes than full blocks: the index trims
        lora_id, lora_name = (3, None) if step % 11 == 4 else (None, None)
        if step % 19 == 8:
            lora_id, lora_name = (3 if step % 2 else None), "sql"  # the engine names the adapter
        if step % 23 == 11:
            n = int(rng.integers(300, 700))  # more than the fresh tables have room for
            tokens = rng.integers(0, 1 << 32, n * bs, np.uint64).tolist()
            hashes = list(range(next_hash, next_hash + n))
            next_hash += n
        if step % 29 == 3:  # a block size the pool does not use: hashed as the event says
            other = [*hashes[:1]]
            events.append(BlockStored(other, None, tokens[: 2 * bs], 2 * bs))
        events.append(BlockStored(hashes, parent, tokens, bs, lora_id, lora_name=lora_name))
        if parent != 12345:
            prefix = (chain[-1][1] if chain else []) + tokens[: len(hashes) * bs]
            chain.append((hashes[-1], prefix))
            prefixes.append(prefix)
        if len(chain) > 6:
            evicted = [h for h, _ in chain[:2]]
            del chain[:2]
            events.append(BlockRemoved(evicted))
        if step == 90:
            events.append(AllBlocksCleared())
            chain.clear()
        payloads.append((rank, encode_batch(EventBatch(float(step), events, rank))))
    return payloads, prefixes


@pytest.mark.parametrize("bs", [BS, KERNEL_BS])
@pytest.mark.parametrize("signed", [False, True])
def test_index_reads_parsed_batches_as_decoded_ones(signed, bs):
    kernels.warm_up()  # the index's warm-up compiles the parser too
    assert kv_events._reader is not None
    payloads, prefixes = _stream(np.random.default_rng(int(signed)), signed, bs)
    lists, arrays, rows, unwanted = KvIndex(), KvIndex(), KvIndex(), KvIndex()
    lora_names = {3: "sql"}
    for rank, payload in payloads:
        decoded, parsed = decode_batch(payload), parse_batch(payload)
        assert parsed is not None
        slot = (1, rank)
        want = [k.tolist() for k in lists.apply_events(slot, decoded.events, lora_names)]
        got = arrays.apply_events(slot, parsed.events, lora_names)
        assert [k.tolist() for k in got] == want
        # in one kernel call: the same keys (their order within the batch aside)
        in_rows = rows.apply_batch(slot, parse_batch(payload), bs, lora_names)
        assert sorted(k.tolist() for k in in_rows) == sorted(want)
        # no prefill waits for the keys: the same index, no keys sliced out
        assert (
            unwanted.apply_batch(slot, parse_batch(payload), bs, lora_names, want_stored=False)
            == []
        )
        for r in (0, 1):
            assert arrays.block_count((1, r)) == lists.block_count((1, r))
            assert rows.block_count((1, r)) == lists.block_count((1, r))
            assert unwanted.block_count((1, r)) == lists.block_count((1, r))
    assert arrays.distinct_blocks() == rows.distinct_blocks() == lists.distinct_blocks() > 0
    assert unwanted.distinct_blocks() == lists.distinct_blocks()
    matched = 0
    for prefix in prefixes:
        for lora in (None, "sql"):
            query = block_hash_array(prefix, bs, lora)
            expected = lists.find_matches(query)
            assert arrays.find_matches(query) == rows.find_matches(query) == expected
            assert unwanted.find_matches(query) == expected
            matched += bool(expected)
    assert matched > 10  # the stream left blocks to find


class _Recording(Router):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[EventBatch] = []

    def apply_kv_batch(self, worker_id: int, seq: int, batch: EventBatch) -> GapInfo | None:
        self.batches.append(batch)
        return super().apply_kv_batch(worker_id, seq, batch)


async def test_subscribers_hand_the_router_parsed_batches():
    router = _Recording()  # its index warms the kernels up, the parser with them
    router.add_worker(7, block_size=BS, total_blocks=1024)
    context = zmq.asyncio.Context()
    ticker = Ticker(0.02)
    sub = RankSubscriber(context, router, 7, 0, "tcp://127.0.0.1:9", None, ticker=ticker)
    tokens = list(range(2 * BS))
    try:
        assert sub.handle(
            0, encode_batch(EventBatch(1.0, [BlockStored([101, 102], None, tokens, BS)]))
        )
        assert sub.handle(1, b"\xc1")  # malformed: logged and dropped, as ever
    finally:
        await ticker.close()
        context.destroy(linger=0)
    (batch,) = router.batches
    assert batch.data_parallel_rank == 0  # the subscriber's rank filled in, as ever
    assert isinstance(batch.events[0].token_ids, np.ndarray)
    assert router.index.find_matches(block_hash_array(tokens, BS)) == {(7, 0): 2}
