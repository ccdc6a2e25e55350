"""KV events from engines whose publisher connects (`KvEventsEndpoint.bind`, llm-d's layout):
two workers' PUB sockets dial the one SUB the router binds, each worker's blocks land on its
own slot by topic, a topic that only prefix-matches a subscription feeds nobody, and a worker
that goes away stops being fed while the endpoint stays bound for the other."""

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dynamograph.protocol.engine import EngineConfig, KvEventsEndpoint
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import MAP, BlockStored, EventBatch, encode_batch, encode_seq
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.kv_events import KvEventIngest
from dynamograph.router.scheduler import Router
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

BS = 16
MODEL = "m"


def worker(wid: int, host: str, endpoint: str) -> WorkerRecord:
    config = EngineConfig(
        model=MODEL, tokenizer="qwen", name=f"w{wid}", instance_id=wid, kv_cache_block_size=BS,
        kv_events=KvEventsEndpoint(endpoint=endpoint, bind=True, topic=f"kv@{host}@{MODEL}"),
    )  # fmt: skip
    return WorkerRecord(f"w{wid}", wid, f"http://{host}:1", None, config)


def frame(topic: str, seq: int, tokens: np.ndarray, first_hash: int) -> list[bytes]:
    n = tokens.size // BS
    event = BlockStored(list(range(first_hash, first_hash + n)), None, tokens.tolist(), BS)
    # llm-d's simulator writes map-form events: what vLLM >= 0.24 sends
    payload = encode_batch(EventBatch(0.0, [event], 0), layout=MAP)
    return [topic.encode(), encode_seq(seq), payload]


async def test_two_publishers_dial_one_bound_endpoint_and_are_told_apart_by_topic():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = Router()
    for wid in (1, 2):
        router.add_worker(wid, block_size=BS, total_blocks=1 << 16)
    ingest = KvEventIngest(router)
    ctx = zmq.asyncio.Context()
    pubs = []
    try:
        a, b = worker(1, "127.0.0.2", endpoint), worker(2, "127.0.0.3", endpoint)
        ingest.add(a)
        ingest.add(b)
        assert list(ingest.bound) == [endpoint]
        for _ in range(2):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(endpoint)
            pubs.append(pub)
        tokens_a = np.arange(4 * BS, dtype="<u4")
        tokens_b = np.arange(1000, 1000 + 3 * BS, dtype="<u4")
        subs = {s.worker_id: s for subs in ingest.subscribers.values() for s in subs}

        async def publish_until_stored(pub, parts, wid, tokens):
            # a PUB drops what it sends before the subscription reached it: send again (a
            # repeated sequence number is a duplicate to the router)
            async def sent_and_stored():
                if router.index.find_matches(block_hash_array(tokens, BS)):
                    return True
                await pub.send_multipart(parts)
                return False

            await wait_for(sent_and_stored, f"worker {wid}'s batch applied", within=20)

        topic_a, topic_b = f"kv@127.0.0.2@{MODEL}", f"kv@127.0.0.3@{MODEL}"
        await publish_until_stored(pubs[0], frame(topic_a, 1, tokens_a, 100), 1, tokens_a)
        await publish_until_stored(pubs[1], frame(topic_b, 1, tokens_b, 200), 2, tokens_b)
        assert router.index.find_matches(block_hash_array(tokens_a, BS)) == {(1, 0): 4}
        assert router.index.find_matches(block_hash_array(tokens_b, BS)) == {(2, 0): 3}

        # a topic the SUB's prefix filter lets through but that is nobody's exactly, then one
        # of worker 1's on the same connection (so after it): only the latter is applied
        tokens_x = np.arange(9000, 9000 + 2 * BS, dtype="<u4")
        await pubs[0].send_multipart(frame(topic_a + "x", 2, tokens_x, 300))
        tokens_a2 = np.arange(7000, 7000 + BS, dtype="<u4")
        await publish_until_stored(pubs[0], frame(topic_a, 2, tokens_a2, 350), 1, tokens_a2)
        assert router.index.find_matches(block_hash_array(tokens_a2, BS)) == {(1, 0): 1}
        assert router.index.find_matches(block_hash_array(tokens_x, BS)) == {}

        # worker 1 goes away: its frames feed nobody; worker 2's (sent after, on the same
        # connection) still arrive at the endpoint, which stays bound
        ingest.remove(a)
        applied_a = subs[1].applied
        assert list(ingest.bound) == [endpoint]
        tokens_a3 = np.arange(8000, 8000 + BS, dtype="<u4")
        await pubs[0].send_multipart(frame(topic_a, 3, tokens_a3, 380))
        tokens_b2 = np.arange(5000, 5000 + 2 * BS, dtype="<u4")
        await publish_until_stored(pubs[0], frame(topic_b, 2, tokens_b2, 400), 2, tokens_b2)
        assert router.index.find_matches(block_hash_array(tokens_b2, BS)) == {(2, 0): 2}
        assert subs[1].applied == applied_a
        assert router.index.find_matches(block_hash_array(tokens_a3, BS)) == {}
    finally:
        for pub in pubs:
            pub.close(linger=0)
        await ingest.close()
        ctx.destroy(linger=0)


async def test_two_workers_cannot_share_a_topic_on_one_endpoint():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router = Router()
    ingest = KvEventIngest(router)
    try:
        ingest.add(worker(1, "127.0.0.2", endpoint))
        ingest.add(worker(2, "127.0.0.2", endpoint))  # same host: same topic
        assert 1 in ingest.subscribers and 2 not in ingest.subscribers  # routed on load only
    finally:
        await ingest.close()
