"""`nvext`: the NVIDIA request/response extensions to the OpenAI API.

Field names, defaults and "omit when None" serialisation follow Dynamo's `NvExt`. Unknown
fields are ignored, as Dynamo's serde structs (no `deny_unknown_fields`) ignore them, so a
request written for a newer Dynamo still routes here; the fields we know keep their types
checked (a bad value is a 400 naming it). docs/nvext.md says what each field does here.
"""

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

U64 = Annotated[int, Field(ge=0, le=(1 << 64) - 1)]
QUERY_INSTANCE_ID = "query_instance_id:"  # the annotation of a query-only request
U32 = Annotated[int, Field(ge=0, le=(1 << 32) - 1)]


class NvExtError(ValueError):
    """A malformed `nvext` object; the message names each bad field and its value."""


class _OmitNone(BaseModel):
    """Serialises without None fields by default, as the seed's `skip_serializing_if`; unknown
    fields are dropped on input, as serde drops them."""

    model_config = ConfigDict(extra="ignore")

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("exclude_none", True)
        return super().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        kwargs.setdefault("exclude_none", True)
        return super().model_dump_json(**kwargs)


class SessionAction(StrEnum):
    OPEN = "open"  # bind once the engine opened the session (engine-backed)
    BIND = "bind"  # router-only affinity: the engine is not told
    CLOSE = "close"  # unbind; the engine closes its side after the turn


class SessionControl(_OmitNone):
    """Sticky routing and session KV lifetime; `timeout` is seconds of inactivity, any u64
    (0 included), as Dynamo's."""

    session_id: str = Field(min_length=1)
    action: SessionAction | None = None
    timeout: U64 = 300


class AgentHints(_OmitNone):
    priority: int | None = None  # the router queue's jump in seconds (≥ 0), the engine's priority
    osl: U32 | None = None
    speculative_prefill: bool | None = None
    latency_sensitivity: float | None = None  # deprecated: the jump when `priority` is unset
    strict_priority: U32 | None = None  # the router queue's tier: a higher tier goes first

    def queue_order(self) -> tuple[int, float]:
        """(tier, jump in seconds) in the router queue, as Dynamo's newest lifts them: the tier
        is `strict_priority`; the jump is `priority` clamped at 0 (a low priority never goes
        behind first-come order), else the deprecated `latency_sensitivity`."""
        if self.priority is not None:
            jump = float(max(self.priority, 0))
        else:
            jump = self.latency_sensitivity or 0.0
        return self.strict_priority or 0, jump


class RouterConfigOverride(_OmitNone):
    """Per-request router settings (Dynamo's `RouterConfigOverride`); the router checks them
    against its own `RouterConfig` (`RouterConfig.overridden`). Dynamo's newer fields
    (`overlap_score_credit`, `prefill_load_scale`, ...) are ignored, as unknown keys."""

    overlap_score_weight: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    router_temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class NvExt(_OmitNone):
    greed_sampling: bool | None = None
    use_raw_prompt: bool | None = None
    annotations: list[str] | None = None
    backend_instance_id: U64 | None = None
    token_data: list[U32] | None = None
    max_thinking_tokens: U32 | None = None
    extra_fields: list[str] | None = None
    prefill_worker_id: U64 | None = None
    decode_worker_id: U64 | None = None
    dp_rank: U32 | None = None
    prefill_dp_rank: U32 | None = None
    agent_hints: AgentHints | None = None
    request_timestamp_ms: float | None = None
    session_control: SessionControl | None = None
    # Dynamo's router-request fields (its `RoutingHints`), taken from the body here: HTTP is
    # the only way into this router
    router_config_override: RouterConfigOverride | None = None
    priority_jump: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def queue_order(self) -> tuple[int, float]:
        """(tier, jump in seconds) in the router queue: `agent_hints.queue_order()`, with an
        explicit `priority_jump` winning over the jump the hints give."""
        tier, jump = self.agent_hints.queue_order() if self.agent_hints else (0, 0.0)
        return tier, self.priority_jump if self.priority_jump is not None else jump

    def has_query_instance_id_annotation(self) -> bool:
        """A `query_instance_id:<value>` annotation (GAIE's first stage, exact prefix as
        Dynamo's): decide the workers, answer their ids and the prompt's token ids, book
        nothing, generate nothing."""
        return self.annotations is not None and any(
            a.startswith(QUERY_INSTANCE_ID) for a in self.annotations
        )

    def wants(self, field: str) -> bool:
        """True when the client asked for `field` ("worker_id", "timing") in the response."""
        return self.extra_fields is not None and field in self.extra_fields


class WorkerIdInfo(_OmitNone):
    prefill_worker_id: U64 | None = None
    prefill_dp_rank: U32 | None = None
    decode_worker_id: U64 | None = None
    decode_dp_rank: U32 | None = None


class TimingInfo(_OmitNone):
    """Per-request timing, filled when the client asks for `extra_fields: ["timing"]`."""

    request_received_ms: float | None = None
    prefill_time_ms: float | None = None
    ttft_ms: float | None = None
    total_time_ms: float | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None


class NvExtResponse(_OmitNone):
    worker_id: WorkerIdInfo | None = None
    timing: TimingInfo | None = None
    token_ids: list[U32] | None = None


def parse_nvext(value: Any) -> NvExt | None:
    """Validate the `nvext` member of a request body; None stays None.

    Raises NvExtError naming every bad field (as `nvext.a.b`) and the value it got.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise NvExtError(f"nvext must be a JSON object, got {type(value).__name__}: {value!r:.80}")
    try:
        return NvExt.model_validate(value)
    except ValidationError as exc:
        raise NvExtError(describe_validation_error("nvext", exc)) from None


def describe_validation_error(prefix: str, exc: ValidationError) -> str:
    """One line per problem: `field: message (got value)`, for error bodies a person can act on."""
    parts = []
    for err in exc.errors():
        loc = ".".join([prefix, *(str(p) for p in err["loc"])])
        if err["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field (got {err['input']!r:.80})")
        else:
            parts.append(f"{loc}: {err['msg']} (got {err['input']!r:.80})")
    return "; ".join(parts)
