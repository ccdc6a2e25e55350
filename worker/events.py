"""KV event publisher for one engine rank: vLLM's ZmqEventPublisher, byte for byte.

- PUB socket: every batch goes out as `[topic, seq (8 bytes big-endian), msgpack EventBatch]`,
  with seq increasing by one per batch from 0; the batch in one of the layouts vLLM has used
  (`protocol.kv_events.LAYOUTS`: the array layout unless asked).
- ROUTER replay socket: a DEALER sends `[b"", start_seq]`; the publisher answers one
  `[b"", seq, payload]` per buffered batch with seq >= start_seq, then `[b"", END_SEQ, b""]`;
  with the map layouts, as vLLM 0.26 on, each answer has the topic before the seq
  (`[b"", topic, seq, payload]`, ending with `[b"", b"", END_SEQ, b""]`).
  The buffer keeps the last `buffer_steps` batches (vLLM's default: 10,000).
- With `curve` (protocol.kv_curve), both sockets are CURVE servers: encrypted, and only
  subscribers holding the graph's client key complete a handshake (the caller runs ZAP).
- With data parallelism, rank r binds `port + r` (protocol.kv_events.endpoint_for_rank).
  Port 0 picks free ports (tests): the rank-0 ports are chosen by the OS and later ranks try
  base + r, retrying with new bases until all ranks fit.
"""

import asyncio
import contextlib
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.kv_events import (
    ARRAY,
    DEFAULT_TOPIC,
    END_SEQ,
    EventBatch,
    KvEvent,
    decode_seq,
    encode_batch,
    encode_seq,
)

log = logging.getLogger(__name__)

BUFFER_STEPS = 10_000


PUB_QUEUE = 100_000  # batches queued per subscriber before PUB drops (vLLM's hwm)


def bind_address(host: str, port: int) -> str:
    """A ZMQ bind endpoint: every interface for 0.0.0.0 / :: / "" (the worker binds its
    advertised pod IP instead when it has one: `MockConfig.events_bind_host`), an IPv6
    address in brackets."""
    if host in ("0.0.0.0", "", "::"):
        return f"tcp://*:{port}"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class KvEventPublisher:
    def __init__(
        self,
        pub: zmq.asyncio.Socket,
        replay: zmq.asyncio.Socket,
        dp_rank: int,
        topic: str = DEFAULT_TOPIC,
        buffer_steps: int = BUFFER_STEPS,
        layout: str = ARRAY,
    ):
        self._pub = pub
        self._layout = layout
        self._replay = replay
        self.dp_rank = dp_rank
        self.topic = topic.encode()
        # the frames a replay answer starts with: vLLM's since 0.26 (in the map layouts' era)
        # carry the topic
        self._replay_head = [b""] if layout == ARRAY else [b"", self.topic]
        self._replay_end = [b""] if layout == ARRAY else [b"", b""]
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KvEvent]) -> int:
        """Send one batch now (never blocks: PUB drops when a subscriber is slow); returns seq."""
        seq = self.next_seq
        self.next_seq += 1
        payload = encode_batch(
            EventBatch(ts=time.time(), events=events, data_parallel_rank=self.dp_rank),
            layout=self._layout,
        )
        self.buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, encode_seq(seq), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            log.warning("KV event batch %d dropped: PUB high-water mark reached", seq)
        return seq

    async def _serve_replay(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("replay request with %d frames ignored", len(frames))
                continue
            client, _, raw = frames
            start = decode_seq(raw)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self._replay.send_multipart(
                        [client, *self._replay_head, encode_seq(seq), payload]
                    )
            await self._replay.send_multipart([client, *self._replay_end, END_SEQ, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._pub.close(linger=0)
        self._replay.close(linger=0)


def bind_publishers(
    ctx: zmq.asyncio.Context,
    host: str,
    events_port: int,
    replay_port: int,
    ranks: int,
    topic: str = DEFAULT_TOPIC,
    attempts: int = 20,
    layout: str = ARRAY,
    buffer_steps: int = BUFFER_STEPS,
    curve: CurveKeys | None = None,
) -> tuple[list[KvEventPublisher], int, int]:
    """Bind PUB + ROUTER sockets for every rank; returns (publishers, events port, replay port)."""
    last_error: Exception | None = None
    for _ in range(attempts if 0 in (events_port, replay_port) else 1):
        sockets: list[zmq.asyncio.Socket] = []
        try:
            pubs: list[list[zmq.asyncio.Socket]] = []
            ports: dict[str, int] = {}
            for kind, base, sock_type in (
                ("events", events_port, zmq.PUB),
                ("replay", replay_port, zmq.ROUTER),
            ):
                bound = []
                for rank in range(ranks):
                    sock = ctx.socket(sock_type)
                    sock.setsockopt(zmq.LINGER, 0)
                    if ":" in host:  # an IPv6 address (or every interface, v4 and v6)
                        sock.setsockopt(zmq.IPV6, 1)
                    if curve is not None:
                        curve.serve(sock)
                    if sock_type == zmq.PUB:  # vLLM's publisher queues as many for a slow router
                        sock.setsockopt(zmq.SNDHWM, PUB_QUEUE)
                    else:  # a ROUTER drops what exceeds its queue: a whole replay must fit
                        sock.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                    sockets.append(sock)
                    if rank == 0 and base == 0:
                        port = sock.bind_to_random_port(bind_address(host, 0).rsplit(":", 1)[0])
                        base_port = port
                    else:
                        base_port = base if rank == 0 else ports[kind]
                        sock.bind(bind_address(host, base_port + rank))
                    ports.setdefault(kind, base_port)
                    bound.append(sock)
                pubs.append(bound)
            publishers = [
                KvEventPublisher(
                    pubs[0][r],
                    pubs[1][r],
                    dp_rank=r,
                    topic=topic,
                    buffer_steps=buffer_steps,
                    layout=layout,
                )
                for r in range(ranks)
            ]
            return publishers, ports["events"], ports["replay"]
        except zmq.ZMQError as exc:
            last_error = exc
            for sock in sockets:
                sock.close(linger=0)
    raise OSError(
        f"cannot bind KV event sockets on {host} (events port {events_port}, replay port "
        f"{replay_port}, {ranks} rank(s)): {last_error}"
    )
