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
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dynamograph.protocol.nvext import SessionAction, SessionControl

Slot = tuple[int, int]


@dataclass(slots=True)
class Binding:
    decode: Slot
    prefill: Slot | None
    ttl_s: float
    expires_at: float
    engine_backed: bool


class StickySessions:
    def __init__(self, default_ttl_s: float, max_sessions: int, clock: Callable[[], float]):
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
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

    def refresh(self, session_id: str, now: float) -> None:
        """A turn of a bound session: its timeout starts again (its own timeout)."""
        binding = self._bindings.get(session_id)
        if binding is not None:
            binding.expires_at = now + binding.ttl_s
            self._bindings.move_to_end(session_id)

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
        self._bindings[sid] = Binding(decode, prefill, ttl, now + ttl, engine_backed)
        self._bindings.move_to_end(sid)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)

    def unbind(self, session_id: str) -> None:
        self._bindings.pop(session_id, None)

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
