"""Built-in filters. `role`, `ready`, `lora`, `subset` and `context` are the request's hard constraints,
applied to every selection before the configured filters; `stalled` leaves out slots whose
requests make no progress; `busy` sheds saturated workers."""

import time

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..errors import ContextTooLong, Overloaded, RoutingError
from ..fleet import NO_CONTEXT_LIMIT, Candidates
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
class ContextFilter(Filter):
    """A request goes only to workers whose context length (max model length) holds its prompt
    and the tokens it may generate (`max_tokens`; none given: one, as vLLM then fills the rest
    of the context). None fits: 400, without calling an engine that would refuse it the same
    way. Workers that do not say their context length always pass; so does a prompt whose
    token count is an estimate (cut for tokenizing, `max_prompt_chars`)."""

    name = "context"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        if ctx.prompt_tokens is None:
            return None
        need = ctx.prompt_tokens + ctx.max_tokens
        if need <= c.fleet.shortest_context:
            return None
        return c.fleet.context_length >= need

    def reason(self, ctx: Context) -> str:
        return f"no ready {ctx.phase.value} worker's maximum model length holds the request"

    def refusal(self, ctx: Context, c: Candidates) -> RoutingError:
        """vLLM's words for it, which clients look for (`maximum context length`), with the
        longest context a worker of the phase says it has."""
        assert ctx.prompt_tokens is not None  # the filter removes nothing otherwise
        fleet = c.fleet
        role = fleet.prefill_role if ctx.phase == Phase.PREFILL else fleet.serving_role
        lengths = fleet.context_length[role]
        known = lengths[lengths < NO_CONTEXT_LIMIT]  # empty: only the unready said none
        longest = f" is {int(known.max())} tokens" if len(known) else " is exceeded"
        return ContextTooLong(
            f"This model's maximum context length{longest}. However, you "
            f"requested {ctx.prompt_tokens + ctx.max_tokens} tokens ({ctx.prompt_tokens} in the "
            f"messages, {ctx.max_tokens} in the completion). Please reduce the length of the "
            f"messages or completion ({self.reason(ctx)})."
        )


class StalledParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="a slot with a request waiting for the engine and no sign of progress for "
        "this long is left out until it shows one",
    )


@register
class StalledFilter(Filter):
    """Leaves out slots whose requests stall: a request waiting for the engine (its prefill not
    ended: no first output, not all its prompt blocks stored) and no sign of progress from the
    slot (a first output byte, prefill progress, output tokens, a KV event;
    `ActiveRequests.progress`) for `timeout_s` since. A slot busy only with answers under way
    (a long stream) is not stalled, however quiet. A hung engine or sidecar — one whose /metrics
    still answers included — stops getting new requests within `timeout_s`, not after its
    requests time out or its scrapes fail; the slot is back as soon as it shows progress or its
    requests end. When every ready slot of the phase has stalled, none is left out (they may
    only be slow: the other filters and the picker decide)."""

    name = "stalled"
    Parameters = StalledParameters
    parameters: StalledParameters

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        deadline = time.monotonic() - self.parameters.timeout_s
        stalled = (c.unanswered > 0) & (c.progress_at < deadline)
        if not stalled.any():
            return None
        fleet = c.fleet
        role = fleet.prefill_role if ctx.phase == Phase.PREFILL else fleet.serving_role
        keep = ~stalled
        if not (keep & role & fleet.ready).any():
            return None
        return keep

    def reason(self, ctx: Context) -> str:
        return (
            f"every eligible {ctx.phase.value} worker has requests that made no progress for "
            f"{self.parameters.timeout_s:g} s"
        )

    def refusal(self, ctx: Context, c: Candidates) -> RoutingError:
        return Overloaded(self.reason(ctx), ctx.config.retry_after_s)


@register
class BusyFilter(Filter):
    """Dynamo's busy rule: a rank is busy when its decode blocks / total blocks exceed
    `busy_threshold` (Dynamo's active_decode_blocks_threshold; decode blocks: the larger of the
    scraped KV usage and the router's booked blocks) or its prefill tokens still to compute
    exceed `busy_prefill_tokens_threshold` (active_prefill_tokens_threshold); a worker is busy
    only when all its data-parallel ranks are. Busy workers are left out; all busy → 503
    (`Overloaded`, with Retry-After)."""

    name = "busy"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        config = ctx.config
        blocks, tokens = config.busy_threshold, config.busy_prefill_tokens_threshold
        if blocks is None and tokens is None:
            return None
        busy = np.zeros(len(c.fleet), bool)
        if blocks is not None:
            busy |= c.usage() > blocks
        if tokens is not None:
            busy |= c.booked_prefill * ctx.block_size > tokens
        # a worker is busy only when every one of its ranks is (ranks are contiguous)
        starts = np.fromiter(c.fleet.first.values(), np.intp, len(c.fleet.first))
        if len(starts) < len(busy):
            every = np.logical_and.reduceat(busy, starts)
            busy = np.repeat(every, np.diff(np.append(starts, len(busy))))
        return ~busy

    def reason(self, ctx: Context) -> str:
        config = ctx.config
        limits = []
        if config.busy_threshold is not None:
            limits.append(f"{config.busy_threshold:.0%} of KV blocks in use")
        if config.busy_prefill_tokens_threshold is not None:
            limits.append(f"{config.busy_prefill_tokens_threshold} prefill tokens pending")
        return f"every eligible {ctx.phase.value} worker is busy (over {' or '.join(limits)})"

    def refusal(self, ctx: Context, c: Candidates) -> RoutingError:
        return Overloaded(self.reason(ctx), ctx.config.retry_after_s)
