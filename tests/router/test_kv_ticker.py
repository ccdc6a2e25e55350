"""The KV-event ticker: readers of several sockets share its rounds. A steady stream is read in
rounds at most every interval (not once per batch), a batch after a quiet spell is read at
once, a routing decision reads what is queued itself (and the rounds go on while decisions
find batches), and nothing is lost either way. `bench epp` measures what this saves."""

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import zmq

from dynamograph.router.kv_events import DECISION_READ_S, DECISION_SHARE, Ticker, read_batches
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for

pytestmark = pytest.mark.integration

WARM_UP = b"warm-up"


class Reader:
    """What a subscriber does when the ticker reads it: drain its socket, count what it read
    and when (a background round, or a decision's `Ticker.read`)."""

    def __init__(self, ticker: Ticker, socket: zmq.Socket[bytes]):
        self.socket = socket
        self.endpoint = "test"
        self.read_batches = 0  # every batch
        self.streamed = 0  # the stream's batches, not `subscribed`'s warm-ups
        self.reads = 0  # times the ticker read it
        ticker.add(self, socket)

    def _handle(self, frames: list[bytes]) -> bool:
        self.read_batches += 1
        self.streamed += frames[2] != WARM_UP
        return True

    def read(self, limit: int) -> int:
        self.reads += 1
        return read_batches(self.socket, self._handle, self.endpoint, limit)


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


@contextlib.asynccontextmanager
async def one_reader(
    interval_s: float,
) -> AsyncIterator[tuple[Ticker, zmq.Socket, zmq.Socket, Reader]]:
    """A ticker reading one SUB socket fed by its PUB: (ticker, pub, sub, reader)."""
    context = zmq.Context()
    ticker = Ticker(interval_s=interval_s)
    [(pub, sub)] = await pairs(context, 1)
    reader = Reader(ticker, sub)
    try:
        yield ticker, pub, sub, reader
    finally:
        ticker.remove(reader)
        await ticker.close()
        context.destroy(linger=0)


async def subscribed(pub: zmq.Socket, reader: Reader) -> None:
    """A PUB drops what it sends before the subscription reached it: send until one arrives."""

    async def arrived() -> bool:
        if reader.read_batches:
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
        reads = [r.reads for r in readers]
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
        for reader, before in zip(readers, reads, strict=True):
            # a slower machine only makes fewer rounds; per-batch reading would make ~400
            assert reader.reads - before <= elapsed / ticker.interval_s + 3, (
                reader.reads - before,
                elapsed,
            )
    finally:
        for reader in readers:
            ticker.remove(reader)
        await ticker.close()
        context.destroy(linger=0)


async def test_a_batch_after_a_quiet_spell_is_read_at_once_not_after_the_interval():
    # were the first batch held for the interval: a timeout
    async with one_reader(interval_s=60.0) as (_, pub, _, reader):
        await subscribed(pub, reader)


async def test_a_decision_reads_what_is_queued_and_the_rounds_wait_for_their_interval():
    """Decisions read the queued batches themselves; decisions close together share a read."""
    async with one_reader(interval_s=60.0) as (ticker, pub, sub, reader):
        await subscribed(pub, reader)  # the first batch starts a round; the next waits 60 s
        await asyncio.sleep(0.05)  # that round's read done: the rounds now wait their interval
        before = reader.read_batches
        for i in range(5):
            pub.send_multipart([b"", str(i).encode(), b"x"])
        await wait_for(lambda: sub.poll(0), "the batches to reach the SUB", within=10)
        await asyncio.sleep(0.05)  # every one of them arrived by now, on loopback
        assert reader.read_batches == before  # no round read them: the next is a minute away
        assert ticker.read(limit=2) == 2  # the decision's read takes them, on the spot
        assert ticker.read() == 0  # one right after shares that read (DECISION_READ_S)
        await asyncio.sleep(DECISION_READ_S * 2)
        assert ticker.read() == 3  # a later one reads again
        assert reader.read_batches == before + 5


async def test_a_decision_takes_a_share_of_a_burst_and_later_reads_the_rest():
    async with one_reader(interval_s=60.0) as (ticker, pub, sub, reader):
        await subscribed(pub, reader)  # a round reads it; the next is a minute away
        await asyncio.sleep(0.05)
        before = reader.read_batches
        burst = 100
        for i in range(burst):
            pub.send_multipart([b"", str(i).encode(), b"x"])
        await wait_for(lambda: sub.poll(0), "the burst to reach the SUB", within=10)
        await asyncio.sleep(0.1)
        assert ticker.read(limit=16) == 16  # a decision waits for its share only
        while reader.read_batches < before + burst:
            await asyncio.sleep(DECISION_READ_S)
            assert ticker.read() <= DECISION_SHARE
        assert reader.read_batches == before + burst


async def test_while_the_sockets_are_quiet_a_decision_asks_none_of_them():
    """Once a round found every socket empty, their descriptors are watched: a batch arriving
    wakes the rounds, so decisions meanwhile have nothing to read and ask no socket."""
    async with one_reader(interval_s=0.01) as (ticker, pub, _, reader):
        await subscribed(pub, reader)
        await asyncio.sleep(0.2)  # the rounds found nothing more and stopped
        reads = reader.reads
        for _ in range(3):
            assert ticker.read() == 0
            await asyncio.sleep(DECISION_READ_S * 2)
        assert reader.reads == reads
        pub.send_multipart([b"", b"1", b"x"])  # an arrival is still read, by a round
        await wait_for(lambda: reader.streamed == 1, "the new batch", within=10)


async def test_while_decisions_read_the_rounds_back_off():
    """Requests keep the index fresh themselves: while decisions read, each round waits twice
    as long as the one before (up to `ROUND_BACKOFF` intervals), so a steady stream costs
    far fewer rounds than one per interval. Nothing is lost."""
    async with one_reader(interval_s=0.02) as (ticker, pub, _, reader):
        await subscribed(pub, reader)
        before, decisions = reader.reads, 0
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 160
        for i in range(sent):  # a batch every ~10 ms, a decision every ~50 ms
            pub.send_multipart([b"", str(i).encode(), b"x"])
            await asyncio.sleep(0.01)
            if i % 5 == 4:
                ticker.read()
                decisions += 1
        elapsed = loop.time() - start
        rounds = reader.reads - before - decisions
        # one per interval would be ~80 on an idle machine; backed off, ~15
        assert rounds <= elapsed / ticker.interval_s / 3, (rounds, elapsed)
        await wait_for(lambda: reader.streamed == sent, "every batch read", within=10)


async def test_a_reader_waiting_for_its_replay_holds_its_batches_without_spinning_the_loop():
    """A subscriber replaying reads nothing meanwhile, its socket's batches left queued: the
    ticker then checks back every interval (it must not arm, find them queued and fire again
    at once, round after round, never letting the replay run), and reads them after."""
    async with one_reader(interval_s=0.02) as (ticker, pub, _, reader):
        await subscribed(pub, reader)
        before, busy_read, calls = reader.read_batches, reader.read, []
        reader.read = lambda limit: calls.append(limit) or 0  # replaying: reads nothing
        for i in range(3):
            pub.send_multipart([b"", str(i).encode(), b"x"])
        await asyncio.sleep(0.3)  # a spinning ticker would never give this sleep back
        assert reader.read_batches == before
        assert 1 <= len(calls) <= 0.3 / ticker.interval_s + 5  # rounds, not a spin
        reader.read = busy_read  # the replay ended
        ticker.poke()
        await wait_for(lambda: reader.read_batches == before + 3, "the held batches", within=10)
