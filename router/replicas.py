"""Replica sync: active-active EPPs share their in-flight bookings over ZMQ.

Every EPP process (a replica) routes on its own and ingests KV events itself; what it cannot
see on its own is the load the *other* replicas booked on each worker. `ReplicaSync` closes
that gap (Dynamo's router replica sync, with what it lacks: snapshots for late joiners and a
timeout for lost peers):

- each replica publishes its bookings' lifecycle on an XPUB socket: booked (slot, prompt
  blocks, prefix keys, prefill still to compute, expected output, generated tokens), changed
  (prefill progress, output tokens), freed. Changes are coalesced per event-loop turn, so a
  request booked and freed in one turn is never sent, and a streamed answer's many output
  updates cost one message a turn;
- it SUBscribes to its peers; a peer's bookings enter `ActiveRequests` as ordinary bookings
  (so `load()`, the scheduler's cost and the booked-requests gauge count them) and leave on
  the peer's free;
- a snapshot of the live bookings goes out whenever a subscription reaches the XPUB (a peer
  started, restarted or reconnected, or asked again after a gap in the sequence numbers, by
  subscribing again): the receiver replaces that peer's bookings with it, so a late joiner
  converges;
- a heartbeat every `heartbeat_s`; a peer silent for `timeout_s` has its bookings freed (the
  `dropped` counter): a lost replica's requests stop counting, the survivor's own bookings
  are untouched. A peer that restarts under the same name replaces its old self at once.

Given the router's `StickySessions` (`sessions`), the sticky-session bindings travel the same
stream: every binding made, refreshed, moved or closed here (a close whether or not this replica
holds the binding: a peer may, its bind not heard here yet), coalesced per turn like the
bookings (a session's turn costs one entry in the message its booking goes in), and every live
binding in the snapshot. A binding carries its expiry as the seconds it had left when sent, so
the replicas' clocks never meet; the receiver `put`s it (most recently used, its own LRU bound)
or, for a close, unbinds. Each write is stamped (Lamport clock, replica id) and a replica keeps
the write with the larger stamp, so two replicas that write one session at once end up holding
the same binding, and a write applied from a peer is neither re-published nor re-applied.
Bindings outlive the replica that made them (a lost peer's sessions stay bound). A close (made
here or by a peer) is remembered, with its stamp, for the closed binding's timeout (no copy of
the binding outlives that; the sessions' default when none was held) and within the sessions'
bound (least recently closed forgotten first): a peer's write of that session with a smaller
stamp is ignored, so a bind that arrives after its close (from another replica, or in a
snapshot from a replica that missed the close) does not bind the session again. The
remembered closes follow every snapshot too, so a close lost in a gap is repaired by it like
everything else.

Wire format, one msgpack frame: `[sender id, name, seq, kind, body]` with kind `e` (events:
`["b", bid, worker, rank, prompt_blocks, prefill, keys (uint64 LE bytes), osl, generated]`,
`["p", bid, prefill, generated]`, `["f", bid]`, `["sb", session id, worker, rank, [prefill
worker, rank] | None, ttl_s, seconds left, engine_backed, clock, replica id]`, `["sc", session
id, seconds the close is remembered, clock, replica id]`), `s` (snapshot: a list of `b` and `sb`
entries, followed at once by an `e` of the remembered closes' `sc` entries) or `h` (heartbeat).
The router core stays single-threaded: everything runs on the event loop the router's requests
run on.

Rolling upgrades: a replica before 1351fb4 sends `["sc", session id, clock, replica id]`
(remembered here for the held binding's timeout, or the sessions' default) and reads every
snapshot entry but `sb` as a booking (hence the closes outside the snapshot); it applies an
`sc` event by its last two fields, the stamp, so the seconds pass it by. A replica of 1351fb4
sent the closes as snapshot entries: still applied.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .active import ActiveRequests, Booking
from .discovery import KubernetesSource, WorkerTarget, pod_key
from .sessions import Binding, StickySessions
from .tasks import cancel_all

log = logging.getLogger(__name__)

RECEIVE_QUEUE = 100_000  # messages a socket holds for a busy replica before dropping (→ a gap)


@dataclass
class ReplicaSettings:
    bind: str  # this replica's XPUB address, e.g. tcp://0.0.0.0:9004 or ipc:///tmp/epp-0
    peers: list[str] = field(default_factory=list)  # the other replicas' addresses
    heartbeat_s: float = 1.0
    timeout_s: float = 5.0  # a peer silent this long has its bookings dropped
    name: str = ""  # stable across restarts of the same replica (default: host + bind)
    # Kubernetes: every pod matching this selector (the EPP Deployment's) but our own is a
    # peer, one replica per process at ports pod_port .. pod_port + pod_processes - 1
    pod_selector: str = ""
    namespace: str = "default"
    pod_port: int = 9004
    pod_processes: int = 1
    pod_api: Any = None  # a kubernetes_asyncio Configuration (None: in-cluster or KUBECONFIG)


def add_replica_arguments(
    parser: argparse.ArgumentParser, *, who: str, env_prefix: str, port: int
) -> argparse._ArgumentGroup:
    """The replica-sync flags of a router process (`who`: the EPP, a kv-mode frontend), their
    environment variables `<env_prefix>_REPLICA_*`; returns their group, for flags of its own."""
    group = parser.add_argument_group(
        f"active-active: {who} replicas sharing their in-flight bookings (docs/epp.md)"
    )
    group.add_argument(
        "--replica-port",
        type=int,
        default=int(os.environ.get(f"{env_prefix}_REPLICA_PORT", port)),
        help=f"replica sync: process i publishes its bookings on this port + i (default {port})",
    )
    group.add_argument(
        "--replica-peers",
        default=os.environ.get(f"{env_prefix}_REPLICA_PEERS", ""),
        metavar="HOST:PORT,...",
        help=f"other {who} replicas' sync addresses (their --replica-port + process index)",
    )
    group.add_argument(
        "--replica-selector",
        default=os.environ.get(f"{env_prefix}_REPLICA_SELECTOR", ""),
        help=f"Kubernetes: label selector of the {who}'s own pods; each other pod is a peer "
        "(its processes at --replica-port..) in --namespace",
    )
    group.add_argument(
        "--replica-heartbeat",
        type=float,
        default=float(os.environ.get(f"{env_prefix}_REPLICA_HEARTBEAT", 1.0)),
        help="seconds between a replica's heartbeats (default 1)",
    )
    group.add_argument(
        "--replica-timeout",
        type=float,
        default=float(os.environ.get(f"{env_prefix}_REPLICA_TIMEOUT", 5.0)),
        help="a peer silent this many seconds has its bookings dropped (default 5)",
    )
    return group


def replica_settings(
    args: argparse.Namespace, *, processes: int = 1, index: int = 0
) -> ReplicaSettings | None:
    """Replica sync from `add_replica_arguments`' flags when there is anyone to sync with:
    sibling processes (`processes` on this host, this one `index`), static peers or the
    process's own pods; else None."""
    static = [f"tcp://{p.strip()}" for p in args.replica_peers.split(",") if p.strip()]
    if processes == 1 and not static and not args.replica_selector:
        return None
    # siblings over loopback (a wildcard host binds it too)
    local = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    siblings = [f"tcp://{local}:{args.replica_port + i}" for i in range(processes) if i != index]
    return ReplicaSettings(
        bind=f"tcp://{args.host}:{args.replica_port + index}",
        peers=siblings + static,
        heartbeat_s=args.replica_heartbeat,
        timeout_s=args.replica_timeout,
        pod_selector=args.replica_selector,
        namespace=args.namespace,
        pod_port=args.replica_port,
        pod_processes=processes,
    )


@dataclass(slots=True)
class _Close:
    stamp: tuple[int, int]  # the close's write stamp
    until: float  # on the sessions' clock: forgotten then


@dataclass
class _Peer:
    name: str
    last_seen: float
    seq: int = -1
    synced: bool = False  # a snapshot was applied: events can be applied in order
    bookings: dict[int, Booking] = field(default_factory=dict)


class ReplicaSync:
    """Shares `active`'s local bookings (and `sessions`' bindings) with peers and applies
    theirs here (module doc)."""

    def __init__(
        self,
        active: ActiveRequests,
        settings: ReplicaSettings,
        *,
        sessions: StickySessions | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.active = active
        self.sessions = sessions
        self.settings = settings
        self.id = int.from_bytes(os.urandom(8), "little") >> 1
        self.name = settings.name  # set at start (the default names the bound address)
        self._clock = clock
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._seq = 0
        self._next_bid = 0
        self._local: dict[int, tuple[int, Booking]] = {}  # id(booking) → (bid, booking)
        self._touched: dict[int, tuple[int, Booking, bool]] = {}  # id → (bid, booking, new)
        self._writes = 0  # Lamport clock of session writes: above every stamp seen
        self._touched_sessions: dict[str, None] = {}  # session ids written this turn, in order
        self._closed: OrderedDict[str, _Close] = OrderedDict()  # least recently closed first
        self._flush_scheduled = False
        self._peers: dict[int, _Peer] = {}
        self._addresses: set[str] = set()
        self._static = list(settings.peers)
        self._pods: dict[str, str] = {}  # pod key → IP, from the pod watch
        self._applying = False  # applying a peer's booking or binding: not ours to publish
        self._last_resubscribe = -1e9
        self._tasks: list[asyncio.Task[None]] = []
        self.address = settings.bind  # the bound address (a tcp port 0 resolved)
        # counters, exported by the EPP's /metrics
        self.dropped = 0  # peers' bookings dropped because the peer went silent
        self.peers_lost = 0
        self.snapshots_sent = 0
        self.snapshots_applied = 0
        self.gaps = 0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        pub = self._context.socket(zmq.XPUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, RECEIVE_QUEUE)
        pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also repeated ones
        pub.bind(self.settings.bind)
        self.address = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.name = self.settings.name or f"{socket.gethostname()}/{self.address}"
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._pub, self._sub = pub, sub
        self._update_peers()
        self.active.observer = self
        if self.sessions is not None:
            self.sessions.observer = self
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._receive()),
            loop.create_task(self._subscriptions()),
            loop.create_task(self._heartbeat()),
        ]
        if self.settings.pod_selector:
            s = self.settings
            source = KubernetesSource(
                s.namespace, s.pod_selector, s.pod_api, target=peer_pod_target
            )
            self._tasks.append(loop.create_task(source.run(self)))
        log.info("replica sync on %s, %d peer(s)", self.address, len(self._addresses))

    async def close(self) -> None:
        if self.active.observer is self:
            self.active.observer = None
        if self.sessions is not None and self.sessions.observer is self:
            self.sessions.observer = None
        await cancel_all(self._tasks)
        self._tasks = []
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._sub = None
        self._context.term()

    def set_peers(self, addresses: Iterable[str]) -> None:
        """The static peers (besides those of the pod watch)."""
        self._static = list(addresses)
        self._update_peers()

    def _update_peers(self) -> None:
        """Connect to the peers, disconnect from the ones gone (their bookings go on timeout)."""
        s = self.settings
        pods = [
            f"tcp://{ip}:{s.pod_port + i}"
            for ip in self._pods.values()
            for i in range(s.pod_processes)
        ]
        wanted = {a for a in [*self._static, *pods] if a and a != self.address}
        if self._sub is None:
            return
        for address in wanted - self._addresses:
            self._sub.connect(address)
        for address in self._addresses - wanted:
            self._sub.disconnect(address)
        self._addresses = wanted

    # -- the pod watch's TargetSink (`discovery.KubernetesSource` with `peer_pod_target`) --
    def sync(self, targets: Iterable[WorkerTarget]) -> None:
        self._pods = {t.key: t.engine_url for t in targets}
        self._update_peers()

    def upsert(self, target: WorkerTarget) -> None:
        self._pods[target.key] = target.engine_url
        self._update_peers()

    def remove(self, key: str) -> None:
        if self._pods.pop(key, None) is not None:
            self._update_peers()

    def remote_requests(self) -> int:
        return sum(len(p.bookings) for p in self._peers.values())

    def live_peers(self) -> int:
        return len(self._peers)

    # -- BookingObserver: local bookings out ---------------------------------------------
    def booked(self, booking: Booking) -> None:
        if self._applying:
            return
        bid = self._next_bid
        self._next_bid += 1
        self._local[id(booking)] = (bid, booking)
        self._touch(bid, booking, new=True)

    def changed(self, booking: Booking) -> None:
        entry = self._local.get(id(booking)) if not self._applying else None
        if entry is not None:
            self._touch(entry[0], booking, new=False)

    def freed(self, booking: Booking) -> None:
        entry = self._local.pop(id(booking), None) if not self._applying else None
        if entry is not None:
            self._touch(entry[0], booking, new=False)

    def _touch(self, bid: int, booking: Booking, *, new: bool) -> None:
        key = id(booking)
        previous = self._touched.get(key)
        self._touched[key] = (bid, booking, new or (previous is not None and previous[2]))
        self._flush_soon()

    # -- SessionObserver: local session bindings out -------------------------------------
    def session_changed(self, session_id: str, binding: Binding) -> None:
        if not self._applying:
            binding.stamp = self._write(session_id)

    def session_closed(self, session_id: str, ttl_s: float) -> None:
        # held here or not: a peer may hold the binding (its bind not heard here yet, or never)
        if not self._applying:
            self._remember_close(session_id, self._write(session_id), ttl_s)

    def _write(self, session_id: str) -> tuple[int, int]:
        """A local write of a session: its stamp; the session goes out at the end of the turn."""
        self._writes += 1
        self._touched_sessions[session_id] = None
        self._flush_soon()
        return (self._writes, self.id)

    def _flush_soon(self) -> None:
        if not self._flush_scheduled and self._pub is not None:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        """One message with the turn's changes, each booking and binding in its state now."""
        self._flush_scheduled = False
        touched, self._touched = self._touched, {}
        events: list[list[Any]] = []
        for bid, booking, new in touched.values():
            if not booking.live:
                if not new:  # booked and freed within one turn: the peers never knew it
                    events.append(["f", bid])
            elif new:
                events.append(_entry(bid, booking))
            else:
                events.append(["p", bid, booking.prefill, booking.generated_tokens])
        touched_sessions, self._touched_sessions = self._touched_sessions, {}
        if self.sessions is not None:
            for sid in touched_sessions:
                binding = self.sessions.get(sid)
                if binding is not None:
                    events.append(self._session_entry(sid, binding))
                elif sid in self._closed:
                    # closed (held here or not, or bound and closed within the turn: peers may
                    # hold an older one); gone without a close, it was evicted by the LRU bound
                    # (stays local)
                    events.append(self._close_entry(sid, self._closed[sid]))
        if events:
            self._send("e", events)

    def _send(self, kind: str, body: Any) -> None:
        if self._pub is None:
            return
        self._seq += 1
        message = msgpack.packb([self.id, self.name, self._seq, kind, body])
        # XPUB drops for a peer past its queue (that peer then sees a gap), never blocks
        with contextlib.suppress(zmq.Again):
            self._pub.send(message, zmq.NOBLOCK)

    def _send_snapshot(self) -> None:
        self._flush()  # what changed this turn is in the snapshot anyway
        entries = [_entry(bid, b) for bid, b in self._local.values() if b.live]
        closes = []
        if self.sessions is not None:
            entries += [self._session_entry(sid, b) for sid, b in self.sessions.live()]
            now = self.sessions.clock()
            closes = [self._close_entry(s, c) for s, c in self._closed.items() if c.until > now]
        self._send("s", entries)
        if closes:
            # events, next in sequence, not snapshot entries: a replica before 1351fb4 reads
            # every snapshot entry but `sb` as a booking, and drops the snapshot on an `sc`
            self._send("e", closes)
        self.snapshots_sent += 1

    def _session_entry(self, session_id: str, binding: Binding) -> list[Any]:
        assert self.sessions is not None
        left = binding.expires_at - self.sessions.clock()  # this clock's; the peer adds its own
        prefill = list(binding.prefill) if binding.prefill is not None else None
        decode_worker, decode_rank = binding.decode
        return [
            "sb",
            session_id,
            decode_worker,
            decode_rank,
            prefill,
            binding.ttl_s,
            left,
            binding.engine_backed,
            *binding.stamp,
        ]

    def _close_entry(self, session_id: str, closed: _Close) -> list[Any]:
        assert self.sessions is not None
        return ["sc", session_id, closed.until - self.sessions.clock(), *closed.stamp]

    def _remember_close(self, session_id: str, stamp: tuple[int, int], seconds: float) -> None:
        """Remember a session's close for `seconds` (the closed binding's timeout), unless a
        later one is remembered; the sessions' bound holds here too."""
        assert self.sessions is not None
        if self._closed_stamp(session_id) > stamp:
            return
        self._closed[session_id] = _Close(stamp, self.sessions.clock() + seconds)
        self._closed.move_to_end(session_id)
        while len(self._closed) > self.sessions.max_sessions:
            self._closed.popitem(last=False)

    def _closed_stamp(self, session_id: str) -> tuple[int, int]:
        """The stamp of the session's remembered close ((0, 0): none, or past its time)."""
        assert self.sessions is not None
        closed = self._closed.get(session_id)
        if closed is None:
            return (0, 0)
        if closed.until <= self.sessions.clock():
            del self._closed[session_id]
            return (0, 0)
        return closed.stamp

    # -- tasks ---------------------------------------------------------------------------
    async def _subscriptions(self) -> None:
        """A (re)subscribing peer gets a snapshot (to everyone: applying one is idempotent)."""
        assert self._pub is not None
        while True:
            frame = await self._pub.recv()
            if frame[:1] == b"\x01":
                self._send_snapshot()

    async def _heartbeat(self) -> None:
        while True:
            self._send("h", None)
            self._expire()
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _receive(self) -> None:
        assert self._sub is not None
        while True:
            frame = await self._sub.recv()
            try:
                sender, name, seq, kind, body = msgpack.unpackb(frame)
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                log.warning("replica sync: undecodable message dropped: %s", exc)
                continue
            if sender == self.id:
                continue
            try:
                self._apply(sender, name, seq, kind, body)
            except (ValueError, TypeError, IndexError, KeyError) as exc:
                log.warning("replica sync: bad message from %s dropped: %s", name, exc)

    # -- peers' bookings in --------------------------------------------------------------
    def _apply(self, sender: int, name: str, seq: int, kind: str, body: Any) -> None:
        now = self._clock()
        peer = self._peers.get(sender)
        if peer is None:
            for other_id, other in list(self._peers.items()):
                if other.name == name:  # the same replica, restarted: its old self is gone
                    log.info("replica %s restarted; dropping its old bookings", name)
                    self._drop(other_id)
            peer = self._peers[sender] = _Peer(name, now)
            log.info("replica %s joined", name)
        peer.last_seen = now
        if kind == "s":
            self._apply_snapshot(peer, body)
            peer.seq, peer.synced = seq, True
            self.snapshots_applied += 1
            return
        if seq <= peer.seq:
            return  # seen already
        if not peer.synced or seq != peer.seq + 1:
            if peer.synced:
                self.gaps += 1
                log.warning("replica %s: messages %d..%d lost", name, peer.seq + 1, seq - 1)
            peer.synced = False
            self._ask_snapshot(now)
            return
        peer.seq = seq
        if kind == "e":
            self._apply_events(peer, body)

    def _ask_snapshot(self, now: float) -> None:
        """Subscribe again: every peer's XPUB sees it and answers with a snapshot."""
        if self._sub is None or now - self._last_resubscribe < self.settings.heartbeat_s:
            return
        self._last_resubscribe = now
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")

    def _apply_events(self, peer: _Peer, events: list[list[Any]]) -> None:
        for event in events:
            tag = event[0]
            if tag == "b":
                self._book(peer, event)
            elif tag == "p":
                booking = peer.bookings.get(event[1])
                if booking is not None:
                    self._progress(booking, event[2], event[3])
            elif tag == "f":
                booking = peer.bookings.pop(event[1], None)
                if booking is not None:
                    self._free(booking)
            elif tag in ("sb", "sc"):
                self._apply_session(event)

    def _apply_snapshot(self, peer: _Peer, entries: list[list[Any]]) -> None:
        seen = set()
        for entry in entries:
            if entry[0] in ("sb", "sc"):  # `sc`: replicas of 1351fb4 sent closes in snapshots
                self._apply_session(entry)
                continue
            bid = entry[1]
            seen.add(bid)
            booking = peer.bookings.get(bid)
            if booking is None:
                self._book(peer, entry)
            else:
                self._progress(booking, entry[5], entry[8])
        for bid in [b for b in peer.bookings if b not in seen]:
            self._free(peer.bookings.pop(bid))

    def _apply_session(self, entry: list[Any]) -> None:
        """A peer's write to a session's binding, kept when its stamp is larger than the held
        binding's and the session's remembered close's."""
        if self.sessions is None:
            return
        sid = entry[1]
        stamp = (int(entry[-2]), int(entry[-1]))
        self._writes = max(self._writes, stamp[0])
        current = self.sessions.get(sid)
        held = current.stamp if current is not None else (0, 0)
        if entry[0] == "sc":
            # a replica before 1351fb4 sends ["sc", session id, clock, replica id]: no seconds
            seconds = float(entry[2]) if len(entry) == 5 else self.sessions.timeout(sid)
            self._remember_close(sid, stamp, seconds)
            if held < stamp:
                with self._as_peer():
                    self.sessions.unbind(sid)
            return
        if max(held, self._closed_stamp(sid)) >= stamp:
            return  # ours is newer (or the same write), or the session was closed after it
        _, _, worker, rank, prefill, ttl_s, left, engine_backed, _, _ = entry
        binding = Binding(
            decode=(int(worker), int(rank)),
            prefill=(int(prefill[0]), int(prefill[1])) if prefill is not None else None,
            ttl_s=float(ttl_s),
            expires_at=self.sessions.clock() + float(left),
            engine_backed=bool(engine_backed),
            stamp=stamp,
        )
        with self._as_peer():
            self.sessions.put(sid, binding)

    @contextlib.contextmanager
    def _as_peer(self) -> Iterator[None]:
        """Changes made on a peer's behalf: the observers' calls are not ours to publish."""
        self._applying = True
        try:
            yield
        finally:
            self._applying = False

    def _book(self, peer: _Peer, entry: list[Any]) -> None:
        _, bid, worker, rank, prompt_blocks, prefill, keys, osl, generated = entry
        old = peer.bookings.pop(bid, None)
        if old is not None:
            self._free(old)
        with self._as_peer():
            booking = self.active.book(
                (worker, rank),
                prompt_blocks=prompt_blocks,
                prefill_blocks=prefill,
                prompt_keys=np.frombuffer(keys, "<u8").astype(np.uint64),  # writable
                expected_output_tokens=osl,
            )
            if generated:
                self.active.add_output_tokens(booking, generated)
        peer.bookings[bid] = booking

    def _progress(self, booking: Booking, prefill: int, generated: int) -> None:
        with self._as_peer():
            self.active.prefill_progress(booking, prefill)
            if generated > booking.generated_tokens:
                self.active.add_output_tokens(booking, generated - booking.generated_tokens)

    def _free(self, booking: Booking) -> None:
        with self._as_peer():
            self.active.free(booking)

    def _expire(self) -> None:
        deadline = self._clock() - self.settings.timeout_s
        for sender, peer in list(self._peers.items()):
            if peer.last_seen < deadline:
                log.warning(
                    "replica %s silent for %.1f s; dropping its %d booking(s)",
                    peer.name,
                    self.settings.timeout_s,
                    len(peer.bookings),
                )
                self._drop(sender)

    def _drop(self, sender: int) -> None:
        peer = self._peers.pop(sender)
        self.peers_lost += 1
        self.dropped += len(peer.bookings)
        for booking in peer.bookings.values():
            self._free(booking)


def _entry(bid: int, booking: Booking) -> list[Any]:
    worker, rank = booking.slot
    return [
        "b",
        bid,
        worker,
        rank,
        len(booking.keys) + booking.unshared_prompt,
        booking.prefill,
        booking.keys.astype("<u8", copy=False).tobytes(),
        booking.expected_output_tokens,
        booking.generated_tokens,
    ]


def peer_pod_target(pod: dict[str, Any]) -> WorkerTarget | None:
    """A peer EPP pod, by IP (`engine_url` holds it): any pod with an IP but our own. Readiness
    does not matter (a draining pod still has requests in flight, booked on the workers)."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip or (pod.get("metadata") or {}).get("name") == socket.gethostname():
        return None
    return WorkerTarget(key=pod_key(pod), engine_url=f"[{ip}]" if ":" in ip else ip)


class ReplicaCollector(Collector):
    """Replica sync as Prometheus metrics (`prefix`: the EPP's `dynamograph_epp_replica`)."""

    def __init__(self, sync: ReplicaSync, prefix: str) -> None:
        self.sync = sync
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        s = self.sync
        yield GaugeMetricFamily(
            f"{self.prefix}_peers",
            "Peer replicas heard from within the timeout",
            value=s.live_peers(),
        )
        yield GaugeMetricFamily(
            f"{self.prefix}_remote_requests",
            "In-flight requests booked by peer replicas, counted in this replica's load",
            value=s.remote_requests(),
        )
        counters = {
            "dropped_bookings": ("Peers' bookings dropped because the peer went silent", s.dropped),
            "lost_peers": (
                "Peers dropped after the timeout or replaced by a restart",
                s.peers_lost,
            ),
            "gaps": ("Sequence gaps in a peer's messages (each answered by a snapshot)", s.gaps),
            "snapshots_sent": ("Snapshots of the live bookings sent to peers", s.snapshots_sent),
            "snapshots_applied": ("Peers' snapshots applied", s.snapshots_applied),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{self.prefix}_{name}", doc, value=value)
