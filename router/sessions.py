"""Sticky sessions: `session_control.session_id` → the slots it is bound to, per phase.

Dynamo's session affinity (its sticky-session router and session coordinator), in process:
- `action: open` binds the session to the slots the request was routed to once the engine
  accepted the turn (`Decision.confirm_session`, called by whoever sees the engine's answer):
  an engine-backed session;
- `action: bind` binds at once, router-only (the engine is not told);
- `action: close` routes to the bound slots and then drops the binding (the engine closes its
  side after the turn, since it gets the request's `session_control`);
- no action only refreshes an existing binding (a sliding timeout of the binding's own
  `timeout`); it never creates one.

A binding holds the decode (or aggregated) slot and, when the request was disaggregated, the
prefill slot: each phase is sticky on its own. `timeout` is any u64 of seconds, 0 included (a
binding that has expired by the next request). The table is bounded (least recently used
bindings go first).

Shared between active-active replicas (`replicas.ReplicaSync`): the table tells its `listener`
the session id of every local change (bind, refresh, move, close) and takes the peers' through
`apply`/`apply_close`, which tell nobody. Every bind, move and close carries a stamp, a Lamport
counter with this table's random origin id as tie-break: last writer wins, "last" in that
order, so replicas that bound one session concurrently (both saw no binding) converge on the
same slots whatever order the messages arrive in. A close leaves a tombstone (bounded like the
table, kept until the closed binding would have expired) so an older binding still on its way
(a crossing message, a peer's snapshot) does not bring the session back.
"""

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from dynamograph.protocol.nvext import SessionAction, SessionControl

Slot = tuple[int, int]
Stamp = tuple[int, int]  # (Lamport counter, origin): bindings and closes are ordered by it


@dataclass(slots=True)
class Binding:
    decode: Slot
    prefill: Slot | None
    ttl_s: float
    expires_at: float
    engine_backed: bool
    stamp: Stamp = (0, 0)  # the bind or move that set the slots


@dataclass(slots=True)
class Tombstone:
    stamp: Stamp
    expires_at: float


class SessionListener(Protocol):
    """Told of every local change of a session's binding (replica sync: `ReplicaSync`); it
    reads the binding's state itself (`entry`, `tombstone`), so changes within one turn can be
    sent as one."""

    def session_changed(self, session_id: str) -> None: ...


class StickySessions:
    def __init__(self, default_ttl_s: float, max_sessions: int, clock: Callable[[], float]):
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._bindings: OrderedDict[str, Binding] = OrderedDict()
        self._closed: OrderedDict[str, Tombstone] = OrderedDict()
        self.listener: SessionListener | None = None
        self.origin = int.from_bytes(os.urandom(8), "little") >> 1
        self._counter = 0

    def now(self) -> float:
        return self._clock()

    def ttl_of(self, session: SessionControl) -> float:
        """The request's timeout; the router's default when the request named none."""
        return (
            float(session.timeout)
            if "timeout" in session.model_fields_set
            else (self.default_ttl_s)
        )

    def bound(self, session_id: str, now: float) -> Binding | None:
        """The live binding of a session (an expired one is dropped)."""
        binding = self._bindings.get(session_id)
        if binding is None:
            return None
        if binding.expires_at <= now:
            del self._bindings[session_id]
            return None
        return binding

    def refresh(self, session_id: str, now: float) -> None:
        """A turn of a bound session: its timeout starts again (its own timeout)."""
        binding = self._bindings.get(session_id)
        if binding is not None:
            binding.expires_at = now + binding.ttl_s
            self._bindings.move_to_end(session_id)
            self._changed(session_id)

    def bind(
        self,
        session: SessionControl,
        decode: Slot,
        prefill: Slot | None,
        now: float,
    ) -> None:
        sid = session.session_id
        ttl = self.ttl_of(session)
        engine_backed = session.action == SessionAction.OPEN
        self._store(sid, Binding(decode, prefill, ttl, now + ttl, engine_backed, self._stamp()))
        self._changed(sid)

    def move(self, session_id: str, decode: Slot, prefill: Slot | None) -> None:
        """A phase's bound slot is gone: the session is bound where this turn went."""
        binding = self._bindings.get(session_id)
        if binding is not None:
            binding.decode, binding.prefill = decode, prefill
            binding.stamp = self._stamp()
            self._changed(session_id)

    def unbind(self, session_id: str) -> None:
        binding = self._bindings.pop(session_id, None)
        # a peer may still hold the binding (or one on its way) even when this table does not
        expires_at = self._clock() + self.default_ttl_s if binding is None else binding.expires_at
        self._bury(session_id, Tombstone(self._stamp(), expires_at))
        self._changed(session_id)

    def binding(self, session_id: str) -> Slot | None:
        """Where a session's decode phase is bound now (None when unbound or expired); does
        not drop."""
        binding = self._bindings.get(session_id)
        if binding is None or binding.expires_at <= self._clock():
            return None
        return binding.decode

    def prefill_binding(self, session_id: str) -> Slot | None:
        binding = self._bindings.get(session_id)
        if binding is None or binding.expires_at <= self._clock():
            return None
        return binding.prefill

    # -- sharing with peers (replica sync) -----------------------------------------------
    def entry(self, session_id: str) -> Binding | None:
        """The live binding, as it is now (not dropped when expired, not refreshed)."""
        binding = self._bindings.get(session_id)
        return binding if binding is not None and binding.expires_at > self._clock() else None

    def tombstone(self, session_id: str) -> Tombstone | None:
        tomb = self._closed.get(session_id)
        return tomb if tomb is not None and tomb.expires_at > self._clock() else None

    def live(self) -> Iterator[tuple[str, Binding]]:
        now = self._clock()
        return ((s, b) for s, b in self._bindings.items() if b.expires_at > now)

    def tombstones(self) -> Iterator[tuple[str, Tombstone]]:
        now = self._clock()
        return ((s, t) for s, t in self._closed.items() if t.expires_at > now)

    def apply(
        self,
        session_id: str,
        decode: Slot,
        prefill: Slot | None,
        ttl_s: float,
        remaining_s: float,
        engine_backed: bool,
        stamp: Stamp,
    ) -> None:
        """A peer's binding (a bind, a move or a refresh) unless this table holds a later one
        or a later close; it expires `remaining_s` from now on this table's clock."""
        self._see(stamp)
        now = self._clock()
        tomb = self.tombstone(session_id)
        if tomb is not None and tomb.stamp >= stamp:
            return
        current = self._bindings.get(session_id)
        if current is not None and current.stamp > stamp:
            return
        if current is not None and current.stamp == stamp:  # the same binding: a refresh
            current.expires_at = max(current.expires_at, now + remaining_s)
            self._bindings.move_to_end(session_id)
            return
        expires_at = now + remaining_s
        self._store(session_id, Binding(decode, prefill, ttl_s, expires_at, engine_backed, stamp))

    def apply_close(self, session_id: str, stamp: Stamp, remaining_s: float) -> None:
        """A peer's close, unless this table bound the session again after it."""
        self._see(stamp)
        current = self._bindings.get(session_id)
        if current is not None and current.stamp > stamp:
            return
        self._bindings.pop(session_id, None)
        self._bury(session_id, Tombstone(stamp, self._clock() + remaining_s))

    def _store(self, session_id: str, binding: Binding) -> None:
        self._closed.pop(session_id, None)
        self._bindings[session_id] = binding
        self._bindings.move_to_end(session_id)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)

    def _bury(self, session_id: str, tomb: Tombstone) -> None:
        self._closed[session_id] = tomb
        self._closed.move_to_end(session_id)
        while len(self._closed) > self.max_sessions:
            self._closed.popitem(last=False)

    def _stamp(self) -> Stamp:
        self._counter += 1
        return (self._counter, self.origin)

    def _see(self, stamp: Stamp) -> None:
        """Lamport: what this table does after seeing a peer's change is ordered after it."""
        self._counter = max(self._counter, stamp[0])

    def _changed(self, session_id: str) -> None:
        if self.listener is not None:
            self.listener.session_changed(session_id)
