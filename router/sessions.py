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

With replica sync (`replicas.ReplicaSync`, the `observer`), every binding, refresh, move and
close made here is announced to the other EPP replicas, and theirs are `put` here (or closed):
a session opened through one replica is sticky in all of them. Expiry and the LRU bound stay
local: each replica drops a binding when its own clock passes the binding's expiry, and bounds
its own table (an eviction is not a close: the peers keep their copies). The closes that keep a
peer's older write from binding a closed session again are remembered by replica sync.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from dynamograph.protocol.nvext import SessionAction, SessionControl

Slot = tuple[int, int]


@dataclass(slots=True)
class Binding:
    decode: Slot
    prefill: Slot | None
    ttl_s: float
    expires_at: float
    engine_backed: bool
    # replica sync's order of writes, (Lamport clock, replica id): of two writes to one session
    # on different replicas, every replica keeps the one with the larger stamp
    stamp: tuple[int, int] = (0, 0)


class SessionObserver(Protocol):
    """Told of every change made to a session's binding (replica sync: `replicas.ReplicaSync`):
    `session_changed` with the binding made, refreshed or moved; `session_closed` on every close,
    a binding held here or not (a peer may hold one), with how long replica sync remembers it
    (`timeout`)."""

    def session_changed(self, session_id: str, binding: Binding) -> None: ...

    def session_closed(self, session_id: str, ttl_s: float) -> None: ...


class StickySessions:
    def __init__(self, default_ttl_s: float, max_sessions: int, clock: Callable[[], float]):
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self.observer: SessionObserver | None = None
        self._bindings: OrderedDict[str, Binding] = OrderedDict()

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

    def refresh(
        self,
        session_id: str,
        now: float,
        *,
        decode: Slot | None = None,
        prefill: Slot | None = None,
    ) -> None:
        """A turn of a bound session: its timeout starts again (its own timeout); `decode` /
        `prefill`, when given, move that phase's binding (its slot was replaced)."""
        binding = self._bindings.get(session_id)
        if binding is not None:
            binding.expires_at = now + binding.ttl_s
            if decode is not None:
                binding.decode = decode
            if prefill is not None:
                binding.prefill = prefill
            self._bindings.move_to_end(session_id)
            self._changed(session_id, binding)

    def bind(
        self,
        session: SessionControl,
        decode: Slot,
        prefill: Slot | None,
        now: float,
    ) -> None:
        ttl = self.ttl_of(session)
        engine_backed = session.action == SessionAction.OPEN
        self.put(session.session_id, Binding(decode, prefill, ttl, now + ttl, engine_backed))

    def put(self, session_id: str, binding: Binding) -> None:
        """Bind (or bind again) a session: the most recently used; the least recently used
        binding goes when the table is full."""
        self._bindings[session_id] = binding
        self._bindings.move_to_end(session_id)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)
        self._changed(session_id, binding)

    def unbind(self, session_id: str) -> None:
        """Close a session; told to the observer even when no binding is held here (the bind may
        not have reached this replica yet, or a peer's copy may outlive ours)."""
        ttl_s = self.timeout(session_id)
        self._bindings.pop(session_id, None)
        if self.observer is not None:
            self.observer.session_closed(session_id, ttl_s)

    def timeout(self, session_id: str) -> float:
        """The held binding's timeout, the default when none is held: no copy of the binding
        outlives that, so replica sync remembers a close of the session that long."""
        binding = self._bindings.get(session_id)
        return binding.ttl_s if binding is not None else self.default_ttl_s

    def get(self, session_id: str) -> Binding | None:
        """A session's binding as held, expired or not (replica sync compares stamps)."""
        return self._bindings.get(session_id)

    def live(self) -> Iterator[tuple[str, Binding]]:
        """The bindings not expired, least recently used first."""
        now = self.clock()
        return ((sid, b) for sid, b in self._bindings.items() if b.expires_at > now)

    def _changed(self, session_id: str, binding: Binding) -> None:
        if self.observer is not None:
            self.observer.session_changed(session_id, binding)

    def binding(self, session_id: str) -> Slot | None:
        """Where a session's decode phase is bound now (None when unbound or expired); does
        not drop."""
        binding = self._bindings.get(session_id)
        if binding is None or binding.expires_at <= self.clock():
            return None
        return binding.decode

    def prefill_binding(self, session_id: str) -> Slot | None:
        binding = self._bindings.get(session_id)
        if binding is None or binding.expires_at <= self.clock():
            return None
        return binding.prefill
