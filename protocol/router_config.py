"""RouterConfig: every knob of the router core, one pydantic model, loadable from YAML.

The contract between whoever configures a router (the operator from a DynamoGraph, `dynamograph
up`, a user's `--config FILE`) and the router core. The EPP's and the frontend's `--config FILE`
is this model as YAML; command-line flags given explicitly override single fields
(`RouterConfig.load(path, **overrides)`). Defaults follow Dynamo's KV router, except the cost:
ours is the request's estimated TTFT (`ttft_scorers`), Dynamo's is `dynamo_scorers`.
"""

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynamograph.protocol.nvext import RouterConfigOverride, describe_validation_error


class PluginRef(BaseModel):
    """One plugin of the routing profile, by its registered name, with its own parameters.

    The router core checks `type` against its registry and `parameters` against the plugin's
    typed parameter model when it starts (`dynamograph.router.plugins`)."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(min_length=1, description="the plugin's registered name")
    parameters: dict[str, Any] = Field(
        default_factory=dict, description="the plugin's own settings, checked by the plugin"
    )


class ScorerRef(PluginRef):
    weight: float = Field(
        default=1.0, ge=0, description="the scorer's cost is multiplied by this in the sum"
    )


def dynamo_scorers(overlap_weight: float = 1.0) -> list[ScorerRef]:
    """Dynamo's KV routing cost as scorers: overlap_weight · prefill blocks + decode blocks."""
    return [
        ScorerRef(type="kv-overlap", weight=overlap_weight),
        ScorerRef(type="load", weight=1.0),
    ]


# What one active decode block costs a new request's TTFT, in blocks to prefill: attention
# reads its 16 tokens of K/V every engine step (16 × 39 ns ≈ 0.62 µs on the modelled H100,
# worker/cost.py) over the ~2 steps a short prefill waits (the step under way, its own),
# against 16 × 32 µs ≈ 512 µs to prefill a block: 2 × 0.62 / 512 ≈ 0.0024.
DECODE_BLOCK_WEIGHT = 0.0025


# What a block of prefill the fleet does weighs against a block of this request's wait
# (`prefill-work`). Measured, not derived: on the multi-turn workload (4 and 8 workers, 4–16
# requests/s) reuse captured was 81–92 % without the term, 92–96 %, 95–98 % and 98–99 % with
# weights 1, 3 and 8, and TTFT p50 was lower with 8 than without at every point below
# saturation (docs/benchmarks.md, "prefill-work").
PREFILL_WORK_WEIGHT = 8.0

# The kv picker's hysteresis in the default config: a request leaves the worker with the most
# of its prompt stored only for one its cost estimate puts over 25 % lower. In `bench route`
# (multi-turn, 4 and 8 workers, 4–16 requests/s, two runs) it kept 0.2–0.8 points more of the
# reusable prompt (moving 0–2.8 % of follow-ups instead of 1–6.5 %) for TTFT p50 within 13 ms,
# and at the saturated 32/s a lower p50 (docs/benchmarks.md, "home margin").
HOME_MARGIN = 0.25


def default_picker() -> PluginRef:
    """The kv picker (the lowest cost) with `HOME_MARGIN`."""
    return PluginRef(type="kv", parameters={"home_margin": HOME_MARGIN})


def ttft_scorers(
    overlap_weight: float = 1.0,
    decode_weight: float = DECODE_BLOCK_WEIGHT,
    work_weight: float = PREFILL_WORK_WEIGHT,
) -> list[ScorerRef]:
    """A worker's cost as this request's estimated TTFT there, in blocks to prefill: prefill
    work queued there plus this request's uncached blocks (kv-overlap), active decode blocks at
    what each costs a prefill (load, `DECODE_BLOCK_WEIGHT`), and blocks that do not fit in the
    worker's free KV (kv-overflow: held back or recomputed); plus what its prefill there costs
    the requests that will queue behind it (queue-delay: uncached blocks × requests waiting
    there for their first token) and the fleet (prefill-work: its uncached blocks, at
    `work_weight`; 0 leaves the term out)."""
    scorers = [
        ScorerRef(type="kv-overlap", weight=overlap_weight),
        ScorerRef(type="load", weight=decode_weight),
        ScorerRef(type="kv-overflow", weight=1.0),
        ScorerRef(type="queue-delay", weight=1.0),
    ]
    if work_weight and overlap_weight:
        # the overlap weight weighs prefill against decode blocks: the fleet's prefill too
        scorers.append(ScorerRef(type="prefill-work", weight=work_weight * overlap_weight))
    return scorers


def overlap_weighted(scorers: list[ScorerRef], weight: float) -> list[ScorerRef]:
    """`scorers` with Dynamo's overlap weight (what a block to prefill weighs against an
    active block) set to `weight`: kv-overlap's weight becomes `weight` and prefill-work's
    scales with it (at an overlap weight of 0 load alone decides, as in Dynamo)."""
    base = next(ref.weight for ref in scorers if ref.type == "kv-overlap")

    def weighted(ref: ScorerRef) -> ScorerRef:
        if ref.type == "kv-overlap":
            return ref.model_copy(update={"weight": weight})
        if ref.type == "prefill-work" and base:
            return ref.model_copy(update={"weight": ref.weight * weight / base})
        return ref

    return [weighted(ref) for ref in scorers]


class RouterConfig(BaseModel):
    """Every knob of the router core. A selection runs the request's hard constraints (role,
    readiness, LoRA adapter, the gateway's subset), then `filters`, then `scorers` (their
    weighted sum is a cost, lower is better), then the `picker`."""

    model_config = ConfigDict(extra="forbid")

    picker: PluginRef = Field(
        default_factory=default_picker,
        description="the picker, by registered name: kv (the lowest cost; softmax sampling when "
        "temperature > 0; parameters: {home_margin: m}, a request leaves the worker with "
        "the most of its prompt stored only for one whose cost is over m lower, 0 unless given: "
        "Dynamo's choice), round-robin, random, least-loaded (fewest booked requests)",
    )
    filters: list[PluginRef] = Field(
        default_factory=lambda: [PluginRef(type="stalled"), PluginRef(type="busy")],
        description="filters after the hard constraints, in order; each may only remove slots",
    )
    scorers: list[ScorerRef] = Field(
        default_factory=ttft_scorers,
        description="cost terms and their weights (1.0 unless given); the default prices a "
        "worker by the request's estimated TTFT there, in blocks to prefill: kv-overlap "
        "(uncached prompt blocks plus prefill blocks booked there; its weight is the EPP's "
        "--overlap-weight, a DynamoGraph's router.overlapWeight, which scales prefill-work "
        "with it) + 0.0025 · load (decode "
        "blocks booked: what one costs a prefill) + kv-overflow (blocks beyond the worker's "
        "free KV) + queue-delay (uncached blocks × requests waiting there for a first token: "
        "the delay this prefill adds to those that queue behind it) + 8 · prefill-work "
        "(uncached blocks: the prefill the fleet does for it, recomputing what another worker "
        "holds included). Dynamo's cost: [{type: kv-overlap}, {type: load}]",
    )
    max_prompt_chars: int = Field(
        default=256 * 1024,
        ge=1024,
        description="a prompt longer than this many characters is routed by this many: its "
        "blocks past them are not hashed and its length is estimated (4 characters a token), "
        "so a megabyte prompt costs the router no more than this to tokenize",
    )
    temperature: float = Field(
        default=0.0,
        ge=0,
        description="0: the lowest cost wins; > 0: softmax sampling over costs normalised to "
        "[0, 1]",
    )
    use_kv_events: bool = Field(
        default=True,
        description="index KV events from workers; False = approximate mode (routed blocks count "
        "as cached for approx_ttl_s)",
    )
    booked_prefix_hits: bool = Field(
        default=True,
        description="in a request's wait on a worker (kv-overlap, queue-delay), count the "
        "leading prompt blocks that live requests there already hold as computed, before its "
        "KV events say they are stored: requests over one new long context sent at once "
        "(a fan-out) follow its first prefill instead of each computing it elsewhere; the "
        "fleet's work (prefill-work) and a conversation's home count stored blocks only; "
        "false: stored blocks only everywhere (Dynamo's overlap)",
    )
    approx_ttl_s: float = Field(
        default=120.0,
        gt=0,
        description="approximate mode: how long a routed request's blocks count as cached on "
        "the worker it went to",
    )
    busy_threshold: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="Dynamo's active_decode_blocks_threshold: a worker rank whose decode blocks "
        "(the larger of scraped kv_usage and booked blocks) over its total exceed this fraction "
        "is busy; a worker is busy when all its ranks are; all busy → 503 with Retry-After",
    )
    busy_prefill_tokens_threshold: int | None = Field(
        default=None,
        ge=0,
        description="Dynamo's active_prefill_tokens_threshold: a worker rank with more prompt "
        "tokens booked and not yet prefilled than this is busy (with busy_threshold: either)",
    )
    retry_after_s: float = Field(
        default=1.0,
        gt=0,
        description="Retry-After when every worker is busy (503) or the EPP is saturated (429)",
    )
    queue_max_requests: int = Field(
        default=0,
        ge=0,
        description="when every worker is busy, up to this many requests wait for one: the "
        "highest agent_hints.strict_priority first, then by arrival time moved earlier by the "
        "request's priority jump (agent_hints.priority seconds, or nvext.priority_jump) (0: no "
        "queue, the 503 at once)",
    )
    queue_timeout_s: float = Field(
        default=30.0, gt=0, description="a queued request waiting longer gets the busy 503"
    )
    enforce_disagg: bool = Field(
        default=False,
        description="with prefill workers configured, never fall back to aggregated serving",
    )
    track_output_blocks: bool = Field(
        default=False,
        description="count generated output blocks in a worker's decode load (Dynamo's "
        "router_track_output_blocks); an expected output (agent_hints.osl) is booked either "
        "way, decaying as tokens are generated",
    )
    session_ttl_s: float = Field(
        default=300.0, gt=0, description="sticky-session timeout when the request names none"
    )
    max_sessions: int = Field(
        default=100_000,
        ge=1,
        description="bound of the sticky-session table (least recently used bindings go first)",
    )
    seed: int | None = Field(
        default=None, description="seed of the random choices (ties, sampling, random picker)"
    )

    def with_overlap_weight(self, weight: float) -> "RouterConfig":
        """A copy with Dynamo's kv_overlap_score_weight `weight` (`overlap_weighted`)."""
        if not any(ref.type == "kv-overlap" for ref in self.scorers):
            raise ValueError("router config: an overlap weight needs the kv-overlap scorer")
        scorers = overlap_weighted(self.scorers, weight)
        return self.model_validate(
            {**self.model_dump(), "scorers": [s.model_dump() for s in scorers]}
        )

    def overridden(self, override: RouterConfigOverride) -> "RouterConfig":
        """This config with a request's `nvext.router_config_override` applied; ValueError,
        naming the field, when this router's profile has nothing the override could change.
        Not re-validated: the override's fields carry RouterConfig's own bounds."""
        prefix = "nvext.router_config_override"
        update: dict[str, Any] = {}
        if override.router_temperature is not None:
            if self.picker.type != "kv":
                raise ValueError(
                    f"{prefix}.router_temperature: this router's picker is "
                    f"{self.picker.type!r}, which samples by no temperature"
                )
            update["temperature"] = override.router_temperature
        weight = override.overlap_score_weight
        if weight is not None:
            if not any(ref.type == "kv-overlap" for ref in self.scorers):
                raise ValueError(
                    f"{prefix}.overlap_score_weight: this router's scorers have no kv-overlap "
                    "term to weigh"
                )
            update["scorers"] = overlap_weighted(self.scorers, weight)
        return self.model_copy(update=update) if update else self

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "RouterConfig":
        """Read a YAML file (or nothing), then apply non-None overrides; ValueError on bad input."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                loaded = yaml.safe_load(Path(path).read_text())
            except (OSError, yaml.YAMLError) as exc:
                raise ValueError(f"router config {path}: {exc}") from None
            if loaded is not None and not isinstance(loaded, dict):
                raise ValueError(f"router config {path}: expected a mapping of fields")
            data = loaded or {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(describe_validation_error("router config", exc)) from None


def markdown_table() -> str:
    """RouterConfig's fields as the Markdown table docs/router.md shows, from the model itself
    (`python -m dynamograph.protocol.router_config` prints it)."""
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for name, field in RouterConfig.model_fields.items():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(exclude_defaults=True)
        elif isinstance(default, list):
            default = [d.model_dump(exclude_defaults=True) for d in default]
        shown = yaml.safe_dump(default, default_flow_style=True, width=1000).strip()
        shown = shown.removesuffix("\n...").strip()
        meaning = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{shown}` | {meaning} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
