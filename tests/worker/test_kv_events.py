"""KV events on ZMQ, decoded with plain msgpack (independent of our codec).

The events must describe exactly the blocks the cache holds (stored, evicted, cleared), carry
consecutive sequence numbers, and the replay socket must return batches a subscriber missed.
"""

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio

from dynamograph.protocol.kv_events import BlockStored
from dynamograph.worker.events import bind_publishers
from dynamograph.worker.testing import mock_worker
from e2e.waiting import wait_for

from .conftest import MODEL, post_json

pytestmark = pytest.mark.integration

BLOCK = 16
BLOCKS = 48


def decode(frames):
    """[topic, seq, payload] with seq 8-byte big-endian and payload [ts, events, dp_rank]."""
    _topic, seq, payload = frames
    _ts, events, dp_rank = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return int.from_bytes(seq, "big"), events, dp_rank


async def replay(ctx, endpoint, start, pause=0.0, topic=None):
    """Batches from `start` on; `pause` seconds pass before the first is read. `topic`: the
    frame vLLM 0.26 on puts before each seq (the end's is empty), None for the older answers."""
    head, end = ([b""], [b""]) if topic is None else ([b"", topic], [b"", b""])
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        await asyncio.sleep(pause)
        out = []
        while True:
            *first, seq, payload = await asyncio.wait_for(sock.recv_multipart(), 10)
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert first == end and payload == b""
                return out
            assert first == head
            out.append(decode([b"", seq, payload]))
    finally:
        sock.close()


def apply(state: dict, events, block_size=BLOCK):
    """Rebuild the cache's block set from events; checks each event's own consistency."""
    for event in events:
        tag = event[0]
        if tag == "BlockStored":
            hashes, parent, tokens, size = event[1], event[2], event[3], event[4]
            assert size == block_size and len(tokens) == size * len(hashes)
            assert parent is None or parent in state, "stored block's parent is not cached"
            for i, h in enumerate(hashes):
                assert h not in state, "block stored twice without removal"
                state[h] = tokens[i * size : (i + 1) * size]
        elif tag == "BlockRemoved":
            for h in event[1]:
                assert h in state, "removed a block that was never stored"
                del state[h]
        elif tag == "AllBlocksCleared":
            state.clear()
        else:
            raise AssertionError(f"unknown event {tag}")


async def wait_idle(engine):
    """Until every rank has finished its requests and published its last step's events."""
    await wait_for(
        lambda: all(r.load == 0 and not r.cache.events for r in engine.ranks),
        "the engine to go idle with its events published",
        within=10,
    )


async def test_events_mirror_the_cache_and_replay_fills_gaps():
    ctx = zmq.asyncio.Context()
    async with mock_worker(model=MODEL, num_gpu_blocks=BLOCKS, block_size=BLOCK) as w:
        kv = w.config.kv_events
        cache = w.engine.ranks[0].cache
        early = ctx.socket(zmq.SUB)
        early.setsockopt(zmq.LINGER, 0)
        early.setsockopt(zmq.SUBSCRIBE, b"")
        # PUB drops batches sent before a subscription lands (slow joiner): what `early` misses
        # at the start, the replay from 0 below must hold.
        early.connect(kv.endpoint)
        prompts = [f"prompt number {i}: " + "lorem ipsum dolor sit amet " * 30 for i in range(6)]
        for p in prompts[:3]:
            await post_json(
                w.url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 20}
            )
        late = ctx.socket(zmq.SUB)  # joins after the first batches: must replay them
        late.setsockopt(zmq.LINGER, 0)
        late.setsockopt(zmq.SUBSCRIBE, b"")
        late.connect(kv.endpoint)
        # Enough distinct prompts to overflow 48 blocks: evictions follow.
        for p in prompts[3:]:
            await post_json(
                w.url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 20}
            )
        for extra in range(10):  # on a slow machine the late subscription may land late
            if await late.poll(200):
                break
            prompt = f"extra prompt {extra}: " + "lorem ipsum dolor sit amet " * 30
            await post_json(
                w.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 20}
            )
        await wait_idle(w.engine)

        received = []
        while await early.poll(200):
            received.append(decode(await early.recv_multipart()))
        seqs = [s for s, _, _ in received]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "gap in sequence numbers"
        # Replay from 0 returns the whole history (and whatever a slow join cost us).
        history = await replay(ctx, kv.replay_endpoint, 0)
        assert [s for s, _, _ in history] == list(range(seqs[-1] + 1))
        assert history[seqs[0] :] == received  # identical batches, in order
        state: dict = {}
        for _, events, rank in history:
            assert rank == 0
            apply(state, events)
        assert set(state) == set(cache.cached), "events disagree with the cache's blocks"
        assert any(e[0] == "BlockRemoved" for _, evs, _ in history for e in evs)
        # The newest prompt's blocks are cached, and the events carry its exact token ids, so
        # a router can rebuild its own content hashes from them.
        tokenized = await post_json(w.url, "/tokenize", {"model": MODEL, "prompt": prompts[-1]})
        tokens = tokenized["tokens"]
        stored = {tuple(t) for t in state.values()}
        assert all(
            tuple(tokens[i * BLOCK : (i + 1) * BLOCK]) in stored
            for i in range(len(tokens) // BLOCK)
        )

        # The late subscriber missed the first batches; replay from its first seq onwards
        # returns exactly what it saw, and from 0 what it missed.
        late_received = []
        while await late.poll(200):
            late_received.append(decode(await late.recv_multipart()))
        first_late = late_received[0][0]
        assert first_late > 0 and late_received == history[first_late:]
        partial = await replay(ctx, kv.replay_endpoint, first_late)
        assert partial == late_received
        last = seqs[-1]

        # Reset: one AllBlocksCleared, and the cache is empty.
        status = await post_json(w.url, "/reset_prefix_cache", None, expect=200)
        assert status is None
        assert await early.poll(2000)
        seq, events, _ = decode(await early.recv_multipart())
        assert seq == last + 1 and events == [["AllBlocksCleared"]]
        assert not cache.cached
        early.close()
        late.close()
    ctx.term()


async def test_data_parallel_ranks_publish_on_consecutive_ports():
    from dynamograph.protocol.kv_events import endpoint_for_rank

    ctx = zmq.asyncio.Context()
    async with mock_worker(model=MODEL, data_parallel_size=2) as w:
        kv = w.config.kv_events
        for rank in (1, 0):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint_for_rank(kv.endpoint, rank))
            try:
                # PUB drops what is sent before the subscription lands: retry with new prompts.
                for attempt in range(10):
                    prompt = f"attempt {attempt} for rank {rank}: " + "sixteen tokens " * 8
                    await post_json(
                        w.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2},
                        headers={"X-data-parallel-rank": str(rank)},
                    )  # fmt: skip
                    if await sub.poll(500):
                        break
                _, events, dp_rank = decode(await sub.recv_multipart())
                assert dp_rank == rank and events[0][0] == "BlockStored"
            finally:
                sub.close()
            history = await replay(ctx, endpoint_for_rank(kv.replay_endpoint, rank), 0)
            assert history[0][0] == 0 and {r for _, _, r in history} == {rank}
    ctx.term()


async def test_map_layout_of_vllm_024_to_033():
    """`--kv-events-layout map`: events as vLLM 0.24 to 0.33 encode them, `type`-tagged maps;
    the replay's answers carry the topic before the seq, as vLLM 0.26 on."""
    ctx = zmq.asyncio.Context()
    async with mock_worker(model=MODEL, kv_events_layout="map") as w:
        prompt = "a prompt long enough to fill a few blocks of sixteen tokens " * 4
        await post_json(
            w.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        )
        await wait_idle(w.engine)
        history = await replay(ctx, w.config.kv_events.replay_endpoint, 0, topic=b"")
        stored = history[0][1][0]
        assert stored["type"] == "BlockStored" and stored["medium"] == "GPU"
        assert stored["block_size"] == 16 and len(stored["token_ids"]) == 16 * len(
            stored["block_hashes"]
        )
        assert set(stored["block_hashes"]) <= set(w.engine.ranks[0].cache.cached)
    ctx.term()


async def test_a_topic_goes_on_every_batch_and_in_the_engine_document():
    """`--kv-events-topic` (vLLM's kv_events_config `topic`): every live batch's first frame,
    what a SUB filtering on it (llm-d's "kv@") receives, and the topic the engine document
    names; the replay's answers carry it too in the map layouts."""
    topic = "kv@127.0.0.1:8000@" + MODEL
    ctx = zmq.asyncio.Context()
    async with mock_worker(model=MODEL, kv_events_layout="map", kv_events_topic=topic) as w:
        assert w.config.kv_events.topic == topic
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.connect(w.config.kv_events.endpoint)
        prompt = "a prompt long enough to fill a few blocks of sixteen tokens " * 4

        async def first_batch() -> list[bytes]:
            nonlocal prompt
            while True:  # a SUB misses what is sent before its subscription arrives
                await post_json(
                    w.url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                )
                try:
                    return await asyncio.wait_for(sub.recv_multipart(), 1)
                except TimeoutError:
                    prompt += " more"

        frames = await asyncio.wait_for(first_batch(), 30)
        assert frames[0] == topic.encode()
        assert decode(frames)[1][0]["type"] == "BlockStored"
        await wait_idle(w.engine)
        history = await replay(ctx, w.config.kv_events.replay_endpoint, 0, topic=topic.encode())
        assert history and history[0][1][0]["type"] == "BlockStored"
        sub.close()
    ctx.term()


async def test_a_replay_of_the_whole_buffer_arrives_whole_to_a_slow_reader():
    """A ROUTER drops what exceeds its send queue (ZMQ's default: 1,000 messages): a replay of
    thousands of batches to a reader that is busy for a moment (a router catching up) must
    still arrive whole, or the reader sees a hole and clears what it knows."""
    ctx = zmq.asyncio.Context()
    (publisher,), _, replay_port = bind_publishers(ctx, "127.0.0.1", 0, 0, 1)
    batches = 8_000  # ~34 MB: more than the loopback socket buffers hold
    try:
        tokens = list(range(1000, 1000 + 63 * BLOCK))
        for i in range(batches):
            publisher.publish([BlockStored([i], None, tokens, BLOCK)])
        history = await replay(ctx, f"tcp://127.0.0.1:{replay_port}", 0, pause=1.0)
        assert [seq for seq, _, _ in history] == list(range(batches))
    finally:
        await publisher.close()
        ctx.destroy(linger=0)
