"""KV events from workers into the router's index: one ZMQ SUB per worker and DP rank.

Each subscriber connects to the PUB endpoint the worker published at `/v1/engine` (rank r at
`endpoint_for_rank(endpoint, r)`), decodes vLLM's frames `[topic, seq, payload]` with
`protocol.kv_events` and feeds the router in order (`Router.apply_kv_batch`). The sockets are
read before every routing decision (`KvEventIngest.read_queued`, called by the request
pipeline's `refresh`, which the EPP also calls after answering a response's headers and a
kv-mode frontend once a decode engine has answered) and in
the ticker's background rounds (`Ticker`). Missed batches are asked again from
the worker's replay socket (DEALER → ROUTER, `[b"", start_seq]` → `[b"", seq, payload]`…
`[b"", -1, b""]`), in a task of the subscriber's own; its later batches wait in its socket
meanwhile, so they are applied in order:
- on connect and every reconnect, from the next expected sequence (0 the first time): a late
  joiner or a restarted EPP gets the worker's buffered history before live batches (ZMQ drops
  what a PUB sends before the subscription arrives);
- on a sequence gap reported by the router; when the replay cannot fill the gap, the router
  clears that slot (`Router.replay_failed`).
A worker that goes away (discovery) has its subscribers closed; the router drops its state.
With `curve` (protocol.kv_curve) both sockets are CURVE clients that trust only the graph's
workers; a failed handshake is logged (the keys are wrong on one side) and nothing is received.

Engines whose publisher connects instead (`KvEventsEndpoint.bind`: llm-d-inference-sim, llm-d's
vLLM deployments) send to a SUB the router binds (`BoundEndpoint`): one per endpoint, shared by
every worker naming it, each worker's frames told apart by their exact topic (llm-d:
`kv@<pod IP>@<model>`). The same per-worker `RankSubscriber.handle` applies them; there is no
connect event to catch up on, and no disconnect to report (a bound socket cannot say which
peer left), so only the replay endpoint, when an engine has one, fills gaps. A bound endpoint
stays bound until the ingest closes (a worker that comes back reconnects to it).
"""

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter, Histogram
from zmq.utils.monitor import parse_monitor_message

from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.kv_events import (
    END_SEQ,
    Batch,
    KvEventDecodeError,
    decode_batch_arrays,
    decode_seq,
    encode_seq,
    endpoint_for_rank,
)

from .discovery import WorkerRecord
from .scheduler import GapInfo, Router
from .tasks import cancel_all

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: building the Flag enums per read costs as much as it
_POLLIN = int(zmq.POLLIN)
RECEIVE_QUEUE = 100_000  # batches a SUB socket holds for us (vLLM's publisher sends up to as many)
ROUND_SHARE = 1024  # batches a socket gives a background round before requests get the loop
# batches a socket gives a routing decision; a burst beyond it (a restart's history) is left to
# the rounds, so no request waits for it
DECISION_SHARE = 32
# decisions within this long of a read share it: under load, asking every socket (~2 µs each,
# two per worker) happens at most 200 times a second, however many requests come
DECISION_READ_S = 0.005
INGEST_INTERVAL_S = 0.05  # background rounds, while batches keep coming, at most this often
ROUND_BACKOFF = 8  # while requests come, rounds come down to 1 per 8 intervals
REPLAY_PIECES = 8  # asks after a replay that came with holes (each must bring the missing one)
REPLAY_ATTEMPTS = 3  # replay timeouts 1 s, 2 s, 4 s (the default) before the slot is cleared
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def readable(socket: zmq.Socket[bytes]) -> bool:
    """A message is queued. Asking also re-arms the socket's file descriptor, which signals
    only changes: after a wake-up, read until this says False before waiting again."""
    return bool(cast(int, socket.getsockopt(zmq.EVENTS)) & _POLLIN)


def read_batches(
    socket: zmq.Socket[bytes], handle: Callable[[list[bytes]], bool], endpoint: str, limit: int
) -> int:
    """Up to `limit` batches queued on `socket`, each given to `handle` (False: read no further
    now, the reader waits for a replay); how many were read."""
    read = 0
    # asking first: an empty socket costs a 2 µs question, not a 6 µs zmq.Again raised
    while read < limit and readable(socket):
        try:
            frames = socket.recv_multipart(_NOBLOCK)
        except zmq.Again:
            break
        read += 1
        if len(frames) < 3:
            log.warning("KV event frame with %d parts at %s", len(frames), endpoint)
        elif not handle(frames):
            break
    return read


class Reader(Protocol):
    """What the ticker reads: a subscriber's socket or a bound endpoint's."""

    endpoint: str

    def read(self, limit: int) -> int:
        """Apply up to `limit` queued batches; how many were read."""
        ...


class Ticker:
    """When an ingest's KV-event sockets are read: before every routing decision (`read`), and
    in background rounds while batches keep coming.

    Engines publish a batch per engine step on each rank, and on this kind of machine a
    process woken from a wait pays 0.1–0.25 ms of CPU whatever it then does, more than
    applying a batch (~0.06 ms): woken per batch, ingestion would cost the EPP more than
    routing does. A routing decision needs the freshest index and runs in a process awake
    anyway, so it reads what is queued first, at no wake-up's cost (nothing while the sockets
    are quiet: their descriptors are watched then). Between decisions, a batch
    arriving after a quiet spell starts a round at once (the sockets' descriptors are watched),
    and while batches keep coming the descriptors are not watched: a round every `interval_s`
    reads what the decisions did not, whatever the number of workers, until a round finds
    nothing queued and no decision read anything since the one before. While requests come,
    the rounds matter less: each round with a decision since the one before waits twice as
    long for the next, up to `ROUND_BACKOFF` intervals; a round with none goes back to
    `interval_s`. The index is so as fresh as ZMQ's queues at each decision; between them, a
    batch waits at most `ROUND_BACKOFF` intervals while requests come and `interval_s` while
    none do (its lag is exported).
    """

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._loop = asyncio.get_running_loop()
        self._readers: dict[Reader, tuple[zmq.Socket[bytes], ...]] = {}
        self._armed = False  # the descriptors are watched
        self._decisions = 0  # decisions since the last round
        self._decided = 0  # batches they read
        self._next_read = 0.0  # when a decision next reads (`DECISION_READ_S`)
        self._signal = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="kv-events ticker")

    def add(self, reader: Reader, *sockets: zmq.Socket[bytes]) -> None:
        """Read `reader` from now on; `sockets` are what it reads (their descriptors watched)."""
        self._readers[reader] = sockets
        if self._armed:
            for socket in sockets:
                self._loop.add_reader(socket.FD, self._changed)

    def remove(self, reader: Reader) -> None:
        sockets = self._readers.pop(reader, ())
        if self._armed:
            for socket in sockets:
                self._loop.remove_reader(socket.FD)

    def poke(self) -> None:
        """A reader can read again (its replay ended): a round now, if none is coming."""
        if self._armed:
            self._changed()

    def read(self, limit: int = DECISION_SHARE) -> int:
        """What every reader holds, up to `limit` batches each (a routing decision's read).
        None while the descriptors are watched (the sockets were empty when last asked, and an
        arrival since wakes the rounds at the next loop turn) or within `DECISION_READ_S` of
        the last read."""
        self._decisions += 1
        now = time.monotonic()
        if self._armed or now < self._next_read:
            return 0
        self._next_read = now + DECISION_READ_S
        read = self._read_all(limit)[0]
        self._decided += read
        return read

    def _read_all(self, limit: int) -> tuple[int, bool]:
        """Batches read, and whether a reader had more than `limit`."""
        total, more = 0, False
        for reader in list(self._readers):
            try:
                read = reader.read(limit)
            except Exception:  # a bug: that reader stops, the others go on
                log.exception("KV events from %s failed; no longer read", reader.endpoint)
                self.remove(reader)
                continue
            total += read
            more |= read >= limit
        return total, more

    def _changed(self) -> None:
        self._disarm()  # the rounds take over until the sockets are quiet
        self._signal.set()

    def _queued(self) -> bool:
        """Whether any socket holds a message. Every socket is asked (not just until one
        says yes): asking re-arms its descriptor, which otherwise stays readable from a
        message already read (and would wake us for nothing)."""
        queued = False
        for reader, sockets in list(self._readers.items()):
            for socket in sockets:
                try:
                    queued |= readable(socket)
                except zmq.ZMQError as exc:  # closed without `remove`: a reader's bug, not ours
                    log.warning("KV events from %s left the ticker: %s", reader.endpoint, exc)
                    self._readers.pop(reader, None)
                    break
        return queued

    def _arm(self) -> None:
        queued = self._queued()
        for sockets in self._readers.values():
            for socket in sockets:
                self._loop.add_reader(socket.FD, self._changed)
        self._armed = True
        if queued:
            self._changed()

    def _disarm(self) -> None:
        if self._armed:
            for sockets in self._readers.values():
                for socket in sockets:
                    self._loop.remove_reader(socket.FD)
            self._armed = False

    async def _run(self) -> None:
        while True:
            self._arm()
            await self._signal.wait()
            self._signal.clear()
            wait = self.interval_s
            while True:
                read, more = self._read_all(ROUND_SHARE)
                if more:
                    await asyncio.sleep(0)  # let requests in before the rest
                    continue
                # quiet: watch the descriptors again (but while a reader waits for its replay,
                # what its socket holds stays queued: rounds go on, or arming would fire at once)
                if not read and not self._decided and not self._queued():
                    break
                if self._decisions:  # requests are coming and keep the index fresh: back off
                    wait = min(2 * wait, ROUND_BACKOFF * self.interval_s)
                else:
                    wait = self.interval_s
                self._decisions = self._decided = 0
                await asyncio.sleep(wait)

    async def close(self) -> None:
        await cancel_all([self._task])
        self._disarm()


@dataclass(frozen=True)
class IngestMetrics:
    """The Prometheus series ingestion reports to, `<prefix>kv_event_*` in the registry of the
    process that ingests (the EPP's, a kv-mode frontend's)."""

    kv_batches: Counter
    kv_event_lag: Histogram
    kv_gaps: Counter
    kv_replay_failures: Counter

    @classmethod
    def create(cls, prefix: str, registry: CollectorRegistry) -> "IngestMetrics":
        return cls(
            kv_batches=Counter(
                prefix + "kv_event_batches",
                "KV event batches received",
                ["source"],
                registry=registry,
            ),
            kv_event_lag=Histogram(
                prefix + "kv_event_lag_seconds",
                "age of a KV event batch when applied (now - batch timestamp)",
                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
                registry=registry,
            ),
            kv_gaps=Counter(
                prefix + "kv_event_gaps", "sequence gaps detected in KV events", registry=registry
            ),
            kv_replay_failures=Counter(
                prefix + "kv_event_replay_failures",
                "gaps replay could not fill (the worker's index state was cleared)",
                registry=registry,
            ),
        )


class RankSubscriber:
    """Events of one (worker, dp_rank): subscribe, replay, apply in order."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        router: Router,
        worker_id: int,
        dp_rank: int,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        *,
        metrics: IngestMetrics | None = None,
        replay_timeout: float = 1.0,
        on_disconnect: Callable[[int], None] | None = None,
        curve: CurveKeys | None = None,
        ticker: Ticker,
    ):
        self.context = context
        self.ticker = ticker
        self.curve = curve
        self.router = router
        self.worker_id = worker_id
        self.dp_rank = dp_rank
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.metrics = metrics
        # the counters' children by source, looked up once: `labels()` costs more per batch
        # (~2 µs) than the increment itself
        self._batch_counts: dict[str, Counter] = {}
        if metrics is not None:
            self._batch_counts = {s: metrics.kv_batches.labels(s) for s in ("live", "replay")}
        self.replay_timeout = replay_timeout
        self.on_disconnect = on_disconnect
        self.next_seq = 0  # the sequence we expect next (for replay after reconnects)
        self.synced = False  # next_seq is known (a batch applied or a complete replay)
        self.replays = 0
        self.applied = 0
        self.task: asyncio.Task[None] | None = None  # a replay under way: reading waits for it
        self._sockets: tuple[zmq.asyncio.Socket, ...] = ()  # the SUB and its monitor (`open`)

    def open(self) -> None:
        """Subscribe at `endpoint` (a bound endpoint's subscribers are fed by it instead)."""
        sub = self.context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        # A router busy with requests must fall behind, not lose batches: ZMQ's I/O thread keeps
        # queueing them for us meanwhile (ZMQ's default of 1,000 dropped the rest → a gap).
        sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        if self.curve is not None:
            self.curve.subscribe(sub)
        monitor = sub.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
        )
        self._sockets = (sub, monitor)
        sub.connect(self.endpoint)
        # Read through plain (blocking-API) shadows of the sockets, non-blocking, when the
        # ticker says: zmq.asyncio's poller costs ~0.5 ms of CPU a wake-up (futures, enum
        # flags, re-registration) on top of the wake-up itself.
        self._plain: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        self._events: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        self.ticker.add(self, self._plain, self._events)

    def close(self) -> asyncio.Task[None] | None:
        """Stop reading and close the sockets; the replay under way, cancelled, to be awaited
        (its socket closes when it ends)."""
        if self._sockets:
            self.ticker.remove(self)
            sub, monitor = self._sockets
            self._sockets = ()
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
        return task

    def read(self, limit: int) -> int:
        """Connection events first (catch up before reading live batches: they queue in the
        SUB meanwhile), then up to `limit` batches; none while a replay is under way."""
        if self.task is not None:
            return 0
        while readable(self._events):
            self._on_monitor(parse_monitor_message(self._events.recv_multipart()))
            if self.task is not None:
                return 0
        return read_batches(self._plain, self._on_frames, self.endpoint, limit)

    def _on_frames(self, frames: list[bytes]) -> bool:
        return self.handle(decode_seq(frames[1]), frames[2])

    def _on_monitor(self, event: Mapping[str, Any]) -> None:
        if event["event"] == zmq.EVENT_CONNECTED:
            self._start(self.catch_up(), "catch-up")
        elif event["event"] == zmq.EVENT_DISCONNECTED and self.on_disconnect:
            self.on_disconnect(self.worker_id)
        elif event["event"] & _HANDSHAKE_FAILED:
            log.warning(
                "KV events of worker %d: handshake with %s failed; with CURVE, check that both "
                "sides use the graph's keys (--kv-curve-dir)",
                self.worker_id,
                self.endpoint,
            )

    def _start(self, replay: Coroutine[Any, Any, None], what: str) -> None:
        """Run a replay; this subscriber reads nothing more until it ends."""
        self.task = asyncio.create_task(
            self._replaying(replay), name=f"kv-events {what} {self.worker_id}/{self.dp_rank}"
        )

    async def _replaying(self, replay: Coroutine[Any, Any, None]) -> None:
        try:
            await replay
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV event replay for worker %s failed", self.worker_id)
        self.task = None
        self.ticker.poke()  # what queued meanwhile is read now, not at the next decision

    def _decode(self, seq: int, payload: bytes) -> Batch | None:
        try:
            # numpy arrays for the hash and token lists, read by the compiled parser (the index
            # wants arrays: Python lists would be built only to be converted back)
            batch = decode_batch_arrays(payload)
        except KvEventDecodeError as exc:
            log.warning("bad KV event batch %d from worker %s: %s", seq, self.worker_id, exc)
            return None
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.dp_rank
        return batch

    def _apply(self, seq: int, batch: Batch, source: str) -> GapInfo | None:
        gap = self.router.apply_kv_batch(self.worker_id, seq, batch)
        self.applied += 1
        if self.metrics is not None:
            self._batch_counts[source].inc()
            self.metrics.kv_event_lag.observe(max(0.0, time.time() - float(batch.ts)))
        if gap is None:
            # Sequence 0 after others: the publisher restarted (the router cleared the slot).
            if seq == 0 or seq >= self.next_seq:
                self.next_seq = seq + 1
            self.synced = True
        return gap

    def handle(self, seq: int, payload: bytes) -> bool:
        """Apply a live batch in order; False when batches before it are missing: a replay
        fills the gap, then applies this one (`task`)."""
        batch = self._decode(seq, payload)
        if batch is None:
            return True
        if self.synced and seq > self.next_seq:
            # We know what comes next even when the router has not seen this slot yet.
            start = self.next_seq
        else:
            gap = self._apply(seq, batch, "live")
            if gap is None:
                return True
            start = gap.start_seq
        log.info(
            "KV event gap on worker %s rank %s: expected %d, got %d; replaying",
            self.worker_id,
            self.dp_rank,
            start,
            seq,
        )
        if self.metrics is not None:
            self.metrics.kv_gaps.inc()
        self._start(self.fill_gap(start, seq, batch), "replay")
        return False

    async def fill_gap(self, start: int, seq: int, batch: Batch) -> None:
        """Replay `start`..`seq - 1`, then apply `batch` (`seq`); when the replay cannot,
        start this slot over from `batch`."""
        frames, _ = await self.replay_patiently(start)
        if frames and frames[0][0] == start:
            for replayed_seq, replayed in frames:
                self._apply(replayed_seq, replayed, "replay")
            if self.next_seq > seq:
                return
        # The replay could not fill the gap: start this slot over from the freshest state.
        if self.applied == 0:  # nothing seen yet: joining a worker that has run a while
            log.info(
                "joined worker %s rank %s at KV event %d (its replay keeps fewer); blocks it "
                "cached before count once it stores them again",
                self.worker_id,
                self.dp_rank,
                seq,
            )
        else:
            log.warning(
                "replay of worker %s rank %s could not fill %d..%d; clearing its index state",
                self.worker_id,
                self.dp_rank,
                start,
                seq - 1,
            )
        self._restart([(seq, batch), *(f for f in frames if f[0] > seq)])

    def _restart(self, frames: list[tuple[int, Batch]]) -> None:
        if self.metrics is not None:
            self.metrics.kv_replay_failures.inc()
        self.router.replay_failed(self.worker_id, self.dp_rank)
        self.next_seq, self.synced = 0, False
        for seq, batch in frames:
            self._apply(seq, batch, "replay")

    async def catch_up(self) -> None:
        """After (re)connecting: replay what we missed; notice a publisher that started over."""
        start = self.next_seq
        frames, complete = await self.fetch_replay(start)
        if not frames and start > 0 and complete:
            # Nothing at or after what we expect: the publisher may have restarted at 0.
            frames, complete = await self.fetch_replay(0)
            if frames and frames[-1][0] < start:
                self._restart(frames)
        elif frames and start > 0 and frames[0][0] > start:
            self._restart(frames)  # our next batch is no longer buffered: history lost
        else:
            for seq, batch in frames:
                self._apply(seq, batch, "replay")
        # A complete replay tells us the next sequence number even when it was empty.
        self.synced = self.synced or complete

    async def replay_patiently(self, start_seq: int) -> tuple[list[tuple[int, Batch]], bool]:
        """`fetch_replay`, asked again with a doubled timeout while it times out: a worker (or
        this process) slow to answer is not history lost, and clearing a slot is costly."""
        timeout = self.replay_timeout
        for attempt in range(REPLAY_ATTEMPTS):
            frames, complete = await self.fetch_replay(start_seq, timeout)
            if complete or not self.replay_endpoint:
                return frames, complete
            log.info(
                "replay of worker %s rank %s from %d timed out after %g s (attempt %d of %d)",
                self.worker_id,
                self.dp_rank,
                start_seq,
                timeout,
                attempt + 1,
                REPLAY_ATTEMPTS,
            )
            timeout *= 2
        return frames, False

    async def fetch_replay(
        self, start_seq: int, wait_s: float | None = None
    ) -> tuple[list[tuple[int, Batch]], bool]:
        """Batches from `start_seq` on, as the worker's replay socket has them buffered, in an
        unbroken run, and whether the replay ended properly (False: timed out, no replay socket,
        or a hole it could not fill).

        An engine's replay ROUTER drops what exceeds its send queue (vLLM's: ZMQ's default of
        1,000 batches) while we read, so a long replay can arrive with holes: what follows a
        hole is asked again from the first missing batch, as long as that brings it."""
        frames, complete = await self._fetch_once(start_seq, wait_s)
        for _ in range(REPLAY_PIECES):
            hole = next(
                (i for i in range(1, len(frames)) if frames[i][0] != frames[i - 1][0] + 1), None
            )
            if hole is None:
                return frames, complete
            missing = frames[hole - 1][0] + 1
            log.info(
                "replay of worker %s rank %s from %d came with a hole at %d; asking again",
                self.worker_id,
                self.dp_rank,
                start_seq,
                missing,
            )
            more, complete = await self._fetch_once(missing, wait_s)
            if not more or more[0][0] != missing:
                return frames[:hole], False  # no longer buffered
            frames = frames[:hole] + more
        return frames, False

    async def _fetch_once(
        self, start_seq: int, wait_s: float | None
    ) -> tuple[list[tuple[int, Batch]], bool]:
        if not self.replay_endpoint:
            return [], False
        self.replays += 1
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)  # take a whole replay as it comes
        if self.curve is not None:
            self.curve.subscribe(dealer)
        dealer.connect(self.replay_endpoint)
        frames: list[tuple[int, Batch]] = []
        try:
            await dealer.send_multipart([b"", encode_seq(start_seq)])
            while True:
                wait = self.replay_timeout if wait_s is None else wait_s
                if not await dealer.poll(wait * 1000):
                    log.debug("replay from %s timed out", self.replay_endpoint)
                    return frames, False
                parts = await dealer.recv_multipart()
                # [b"", seq, payload]; newer vLLM puts its topic before the seq
                if len(parts) < 3 or parts[-2] == END_SEQ:
                    return frames, True
                seq = decode_seq(parts[-2])
                batch = self._decode(seq, parts[-1])
                if batch is not None:
                    frames.append((seq, batch))
        finally:
            dealer.close(linger=0)


class BoundEndpoint:
    """A SUB socket bound at one endpoint that engines connect their publishers to, feeding the
    subscriber (worker, rank) whose topic a frame carries; a subscriber with the empty topic
    takes the frames no other one claims."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, ticker: Ticker):
        self.endpoint = endpoint
        self.ticker = ticker
        self.subscribers: dict[bytes, RankSubscriber] = {}
        self.socket = context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError:
            self.socket.close(linger=0)  # else the context's term() would wait for it forever
            raise
        self._plain: zmq.Socket[bytes] = zmq.Socket.shadow(self.socket.underlying)
        ticker.add(self, self._plain)

    def add(self, subscriber: RankSubscriber) -> None:
        topic = subscriber.topic.encode()
        current = self.subscribers.get(topic)
        if current is not None and current.worker_id != subscriber.worker_id:
            raise ValueError(
                f"KV event topic {subscriber.topic!r} at {self.endpoint} is already worker "
                f"{current.worker_id}'s; give each worker its own topic (e.g. kv@{{host}}@model)"
            )
        self.subscribers[topic] = subscriber
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)

    def remove(self, subscriber: RankSubscriber) -> None:
        topic = subscriber.topic.encode()
        if self.subscribers.get(topic) is subscriber:
            del self.subscribers[topic]
            self.socket.setsockopt(zmq.UNSUBSCRIBE, topic)

    def read(self, limit: int) -> int:
        # one socket for every worker: while one replays, the frames behind it wait (in order)
        if any(s.task is not None for s in self.subscribers.values()):
            return 0
        return read_batches(self._plain, self._on_frames, self.endpoint, limit)

    def _on_frames(self, frames: list[bytes]) -> bool:
        subscriber = self.subscribers.get(frames[0]) or self.subscribers.get(b"")
        if subscriber is None:  # a topic only prefix-matching a subscription
            return True
        return subscriber.handle(decode_seq(frames[1]), frames[2])

    def close(self) -> None:
        self.ticker.remove(self)
        self.socket.close(linger=0)


class KvEventIngest:
    """Subscribers for every worker discovery reports; `add`/`remove` are discovery listeners,
    `read_queued` what a routing decision calls first."""

    def __init__(
        self,
        router: Router,
        metrics: IngestMetrics | None = None,
        *,
        replay_timeout: float = 1.0,
        on_disconnect: Callable[[int], None] | None = None,
        curve: CurveKeys | None = None,
        interval_s: float = INGEST_INTERVAL_S,
    ):
        self.router = router
        self.curve = curve
        self.metrics = metrics
        self.replay_timeout = replay_timeout
        self.on_disconnect = on_disconnect
        self.interval_s = interval_s
        self._ticker: Ticker | None = None  # made in the event loop, with the first worker
        self.context = zmq.asyncio.Context()
        self.subscribers: dict[int, list[RankSubscriber]] = {}
        self.bound: dict[str, BoundEndpoint] = {}  # endpoint → the SUB bound there
        self._stopping: set[asyncio.Task[None]] = set()  # removed workers' replays, cancelled

    def read_queued(self) -> None:
        """Apply what the sockets hold now (a share of it each): before a routing decision."""
        if self._ticker is not None:
            self._ticker.read()

    def add(self, record: WorkerRecord) -> None:
        events = record.config.kv_events
        if events is None:
            log.info("worker %s publishes no KV events; routing it on load only", record.name)
            return
        if events.bind and self.curve is not None:
            # our CURVE keys make the router a client; a bound SUB would have to be the server
            log.error(
                "worker %s: KV events on a bound endpoint cannot use CURVE; routing it on load "
                "only",
                record.name,
            )
            return
        self.remove(record)
        if self._ticker is None:
            self._ticker = Ticker(self.interval_s)
        subs = [
            RankSubscriber(
                self.context,
                self.router,
                record.instance_id,
                rank,
                endpoint_for_rank(events.endpoint, rank),
                endpoint_for_rank(events.replay_endpoint, rank) if events.replay_endpoint else None,
                events.topic,
                metrics=self.metrics,
                replay_timeout=self.replay_timeout,
                on_disconnect=self.on_disconnect,
                curve=self.curve,
                ticker=self._ticker,
            )
            for rank in range(record.config.data_parallel_size)
        ]
        self.subscribers[record.instance_id] = subs
        try:
            for sub in subs:
                if events.bind:
                    bound = self.bound.get(sub.endpoint)
                    if bound is None:
                        bound = BoundEndpoint(self.context, sub.endpoint, self._ticker)
                        self.bound[sub.endpoint] = bound
                    bound.add(sub)
                else:
                    sub.open()
        except (ValueError, zmq.ZMQError) as exc:  # a shared topic; a port in use; a bad address
            log.error("worker %s: %s; routing it on load only", record.name, exc)
            self.remove(record)

    def remove(self, record: WorkerRecord) -> None:
        for sub in self.subscribers.pop(record.instance_id, []):
            if (bound := self.bound.get(sub.endpoint)) is not None:
                bound.remove(sub)
            if (task := sub.close()) is not None:
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        tasks = [t for subs in self.subscribers.values() for s in subs if (t := s.close())]
        self.subscribers.clear()
        await cancel_all([*tasks, *self._stopping])
        for endpoint in self.bound.values():
            endpoint.close()
        self.bound.clear()
        if self._ticker is not None:
            await self._ticker.close()
            self._ticker = None
        self.context.term()
