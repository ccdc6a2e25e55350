"""RouterConfig: every knob of the router core, one pydantic model, loadable from YAML.

The EPP's `--config FILE` is this model as YAML; command-line flags override single fields
(`RouterConfig.load(path, **overrides)`). Defaults follow Dynamo's KV router.
"""

from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dynamograph.protocol.nvext import describe_validation_error


class Policy(StrEnum):
    """How the picker chooses among eligible workers."""

    KV = "kv"  # Dynamo's cost: overlap_weight · prefill_blocks + decode_blocks
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: Policy = Policy.KV
    overlap_weight: float = Field(
        default=1.0,
        ge=0,
        description="Dynamo's kv_overlap_score_weight: the weight of the KV-overlap scorer's "
        "prefill blocks against the load scorer's decode blocks",
    )
    temperature: float = Field(
        default=0.0,
        ge=0,
        description="0 = argmin cost; > 0 = softmax sampling over normalised costs",
    )
    use_kv_events: bool = Field(
        default=True,
        description="index KV events from workers; False = approximate mode (routed blocks count "
        "as cached for approx_ttl_s)",
    )
    approx_ttl_s: float = Field(default=120.0, gt=0)
    busy_threshold: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="a worker whose KV usage (max of scraped kv_usage and booked/total blocks) is "
        "at or above this fraction is busy; all busy → Overloaded (429)",
    )
    retry_after_s: float = Field(default=1.0, gt=0, description="Retry-After on 429")
    enforce_disagg: bool = Field(
        default=False,
        description="with prefill workers configured, never fall back to aggregated serving",
    )
    track_output_blocks: bool = Field(
        default=False,
        description="count expected output blocks (agent_hints.osl) in a worker's decode load, "
        "decaying as tokens are generated",
    )
    session_ttl_s: float = Field(
        default=300.0, gt=0, description="sticky-session timeout when the request names none"
    )
    max_sessions: int = Field(default=100_000, ge=1, description="sticky-session table bound")
    seed: int | None = Field(default=None, description="seed of the picker's random choices")

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
