"""Sticky sessions: `session_control.session_id` → the (worker, dp_rank) slot it is bound to.

A binding lasts the request's `timeout` (or `RouterConfig.session_ttl_s`), is refreshed by each
request of the session and dropped by `action: close`; the table is bounded (least recently
used bindings go first).
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dynamograph.protocol.nvext import SessionAction, SessionControl

Slot = tuple[int, int]


@dataclass(slots=True)
class _Binding:
    slot: Slot
    expires_at: float


class StickySessions:
    def __init__(self, default_ttl_s: float, max_sessions: int, clock: Callable[[], float]):
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._bindings: OrderedDict[str, _Binding] = OrderedDict()

    def bound(self, session_id: str, now: float) -> Slot | None:
        """The live binding of a session (an expired one is dropped)."""
        binding = self._bindings.get(session_id)
        if binding is None:
            return None
        if binding.expires_at <= now:
            del self._bindings[session_id]
            return None
        return binding.slot

    def bind(self, session: SessionControl, slot: Slot, now: float) -> None:
        sid = session.session_id
        if session.action == SessionAction.CLOSE:
            self._bindings.pop(sid, None)
            return
        ttl = session.timeout if "timeout" in session.model_fields_set else self.default_ttl_s
        self._bindings[sid] = _Binding(slot, now + ttl)
        self._bindings.move_to_end(sid)
        while len(self._bindings) > self.max_sessions:
            self._bindings.popitem(last=False)

    def binding(self, session_id: str) -> Slot | None:
        """Where a session is bound now (None when unbound or expired); does not drop."""
        binding = self._bindings.get(session_id)
        if binding is None or binding.expires_at <= self._clock():
            return None
        return binding.slot
