"""Built-in filters. `role`, `ready`, `lora` and `subset` are the request's hard constraints,
applied to every selection before the configured filters; `busy` sheds saturated workers."""

import numpy as np

from ..errors import Overloaded, RoutingError
from ..fleet import Candidates
from .base import Context, Filter, Phase, register


@register
class RoleFilter(Filter):
    """Prefill selections take prefill workers; the others take aggregated and decode workers."""

    name = "role"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray:
        fleet = c.fleet
        return fleet.prefill_role if ctx.phase == Phase.PREFILL else fleet.serving_role

    def reason(self, ctx: Context) -> str:
        if ctx.phase == Phase.PREFILL:
            return "no prefill worker is registered"
        return "no aggregated or decode worker is registered"


@register
class ReadyFilter(Filter):
    name = "ready"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray:
        return c.fleet.ready

    def reason(self, ctx: Context) -> str:
        return f"no {ctx.phase.value} worker is ready"


@register
class LoraFilter(Filter):
    """A request for a LoRA adapter goes only to workers that serve it."""

    name = "lora"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        return c.fleet.serves(ctx.lora_name) if ctx.lora_name else None

    def reason(self, ctx: Context) -> str:
        return f"no ready {ctx.phase.value} worker serves LoRA adapter {ctx.lora_name!r}"


@register
class SubsetFilter(Filter):
    """The caller's subset (e.g. GAIE's destination-endpoint-subset hint, as instance ids).

    Applies to the serving (aggregated/decode) side: prefill workers have no serving endpoint.
    """

    name = "subset"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        allowed = ctx.allowed_ids
        if allowed is None or ctx.phase == Phase.PREFILL:
            return None
        ids = c.fleet.worker_ids
        return np.fromiter((w in allowed for w in ids), bool, len(ids))

    def reason(self, ctx: Context) -> str:
        return "no eligible worker is in the requested endpoint subset"


@register
class BusyFilter(Filter):
    """Sheds workers whose KV usage reached `busy_threshold`; all busy → 429 (Overloaded)."""

    name = "busy"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        threshold = ctx.config.busy_threshold
        return None if threshold is None else c.usage() < threshold

    def reason(self, ctx: Context) -> str:
        return (
            f"every eligible {ctx.phase.value} worker is at or above the busy threshold "
            f"({ctx.config.busy_threshold:.0%} KV usage)"
        )

    def refusal(self, ctx: Context) -> RoutingError:
        return Overloaded(self.reason(ctx), ctx.config.retry_after_s)
