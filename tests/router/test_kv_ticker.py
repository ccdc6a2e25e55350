"""The KV-event ticker: readers of several sockets share its rounds. A steady stream is read in
rounds at most every interval (not once per batch), a batch after a quiet spell is read at
once, and nothing is lost either way. `bench epp` measures what this saves."""

import asyncio

import pytest
import zmq

from dynamograph.router.kv_events import Ticker, read_batches, readable
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

WARM_UP = b"warm-up"


class Reader:
    """What a subscriber does on the ticker's rounds: drain its socket, count what it read."""

    def __init__(self, ticker: Ticker, socket: zmq.Socket[bytes]):
        self.ticker, self.socket = ticker, socket
        self.read = 0  # every batch
        self.streamed = 0  # the stream's batches, not `subscribed`'s warm-ups
        self.rounds = 0
        ticker.watch(socket)
        self.task = asyncio.create_task(self._run())

    async def _dispatch(self, frames: list[bytes]) -> None:
        self.read += 1
        self.streamed += frames[2] != WARM_UP

    async def _run(self) -> None:
        while True:
            while readable(self.socket):
                await read_batches(self.socket, self._dispatch, "test")
            await self.ticker.next_round()
            self.rounds += 1


async def pairs(context: zmq.Context, n: int) -> list[tuple[zmq.Socket, zmq.Socket]]:
    out = []
    for _ in range(n):
        pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        pub.bind(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        out.append((pub, sub))
    return out


async def subscribed(pub: zmq.Socket, reader: Reader) -> None:
    """A PUB drops what it sends before the subscription reached it: send until one arrives."""

    async def arrived() -> bool:
        if reader.read:
            return True
        # on a loaded machine several may be in flight: later ones arrive after the first
        pub.send_multipart([b"", b"0", WARM_UP])
        return False

    await wait_for(arrived, "the subscription to reach the publisher", within=10)


async def test_a_steady_stream_is_read_in_rounds_not_batch_by_batch():
    context = zmq.Context()
    ticker = Ticker(interval_s=0.05)
    sockets = await pairs(context, 2)
    readers = [Reader(ticker, sub) for _, sub in sockets]
    try:
        for (pub, _), reader in zip(sockets, readers, strict=True):
            await subscribed(pub, reader)
        rounds = [r.rounds for r in readers]
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 400
        for i in range(sent):  # a batch every ~2 ms on each socket
            for pub, _ in sockets:
                pub.send_multipart([b"", str(i).encode(), b"x" * 64])
            await asyncio.sleep(0.002)
        await wait_for(
            lambda: all(r.streamed == sent for r in readers),
            "every batch read",
            within=20,
        )
        elapsed = loop.time() - start
        for reader, before in zip(readers, rounds, strict=True):
            # a slower machine only makes fewer rounds; per-batch reading would make ~400
            assert reader.rounds - before <= elapsed / ticker.interval_s + 3, (
                reader.rounds - before,
                elapsed,
            )
    finally:
        for reader in readers:
            reader.task.cancel()
        await asyncio.gather(*(r.task for r in readers), return_exceptions=True)
        for _, sub in sockets:
            ticker.unwatch(sub)
        await ticker.close()
        context.destroy(linger=0)


async def test_a_batch_after_a_quiet_spell_is_read_at_once_not_after_the_interval():
    context = zmq.Context()
    ticker = Ticker(interval_s=60.0)  # were the first batch held for the interval: a timeout
    [(pub, sub)] = await pairs(context, 1)
    reader = Reader(ticker, sub)
    try:
        await subscribed(pub, reader)
    finally:
        reader.task.cancel()
        await asyncio.gather(reader.task, return_exceptions=True)
        ticker.unwatch(sub)
        await ticker.close()
        context.destroy(linger=0)
