"""Replays that arrive with holes: an engine's replay ROUTER drops what exceeds its send queue
(vLLM's: ZMQ's default of 1,000 batches) while the router reads, so a long replay can skip
batches. The subscriber must not apply across a hole: it asks again from the first missing
batch, and gives up (incomplete, an unbroken run only) when the engine no longer has it. Both
replay layouts are read: `[seq, payload]` and newer vLLM's `[topic, seq, payload]`."""

import asyncio

import pytest
import zmq
import zmq.asyncio

from dynamograph.protocol.kv_events import END_SEQ, EventBatch, encode_batch, encode_seq
from dynamograph.router.kv_events import RankSubscriber, Ticker
from dynamograph.router.scheduler import Router
from dynamograph.worker.testing import free_port

pytestmark = pytest.mark.integration

PAYLOAD = encode_batch(EventBatch(0.0, [], 0))


async def serve_replays(router_socket, answers: list[list[int]], topic: bytes | None) -> None:
    """Answer each replay request with the next list of sequence numbers, then END."""
    for seqs in answers:
        client, _, _start = await router_socket.recv_multipart()
        head = [client, b""] + ([topic] if topic is not None else [])
        for seq in seqs:
            await router_socket.send_multipart([*head, encode_seq(seq), PAYLOAD])
        await router_socket.send_multipart([*head, END_SEQ, b""])


async def fetch(answers: list[list[int]], topic: bytes | None = None):
    context = zmq.asyncio.Context()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    server = context.socket(zmq.ROUTER)
    server.bind(endpoint)
    ticker = Ticker(0.02)
    router = Router()
    router.add_worker(1, block_size=16, total_blocks=1024)
    subscriber = RankSubscriber(
        context, router, 1, 0, "tcp://127.0.0.1:9", endpoint, ticker=ticker, replay_timeout=5.0
    )
    serving = asyncio.create_task(serve_replays(server, answers, topic))
    try:
        frames, complete = await subscriber.fetch_replay(0)
        return [seq for seq, _ in frames], complete, subscriber.replays
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        await ticker.close()
        server.close(linger=0)
        context.destroy(linger=0)


@pytest.mark.parametrize("topic", [None, b"kv@10.0.0.5@m"])
async def test_a_hole_is_asked_again_from_the_first_missing_batch(topic):
    seqs, complete, asks = await fetch([[0, 1, 2, 6, 7], [3, 4, 5, 6, 7, 8]], topic)
    assert seqs == list(range(9)) and complete and asks == 2


async def test_a_hole_no_longer_buffered_leaves_the_unbroken_run_only():
    seqs, complete, asks = await fetch([[0, 1, 2, 6, 7], [6, 7, 8]])
    assert seqs == [0, 1, 2] and not complete and asks == 2


async def test_an_unbroken_replay_is_asked_once():
    seqs, complete, asks = await fetch([[4, 5, 6]])
    assert seqs == [4, 5, 6] and complete and asks == 1
