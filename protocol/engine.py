"""What a worker says about itself at `GET /v1/engine`.

The seed's `EngineConfig` (from the LLMEngine trait) plus the fields a router needs: instance
id, role, data-parallel size, tokenizer identity, where the KV events are published and the
LoRA adapters served. Routers take the KV block size from here and nowhere else: a wrong block
size silently turns KV routing into load-only routing.

`served_models(configs)` is the one rule for what a request's `model` means (the worker, the
EPP and the frontend's kv mode all use it): a served model name is the base model, an adapter
name is that LoRA adapter, anything else is unknown (404, `lora_for_model`).
"""

from collections.abc import Iterable, Mapping
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from .openai import OpenAIError

ENGINE_PATH = "/v1/engine"


class Role(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class KvEventsEndpoint(BaseModel):
    """vLLM ZMQ publisher: PUB `endpoint` with `topic`, ROUTER `replay_endpoint` for missed batches."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="ZMQ address of the PUB socket, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: str | None = Field(
        default=None, description="ZMQ address of the ROUTER socket that replays buffered batches"
    )
    topic: str = ""


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The seed's EngineConfig.
    model: str
    served_model_name: str
    context_length: int = Field(gt=0)
    kv_cache_block_size: int = Field(gt=0)
    total_kv_blocks: int = Field(gt=0)
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    # What routers need on top.
    instance_id: int = Field(ge=0, lt=1 << 63)
    name: str = Field(description="pod name (or local process name) the instance id derives from")
    role: Role = Role.AGGREGATED
    data_parallel_size: int = Field(default=1, ge=1)
    tokenizer: str = Field(description="tokenizer identity; equal strings tokenize identically")
    kv_events: KvEventsEndpoint | None = None
    engine: str = Field(default="mock", description="engine implementation: mock or vllm")
    lora_adapters: dict[int, str] = Field(
        default_factory=dict,
        description="LoRA adapters served, vLLM's lora_int_id → adapter name (ids 1, 2, … in "
        "load order); KV events name an adapter by this id",
    )


def served_models(configs: Iterable[EngineConfig]) -> dict[str, str | None]:
    """The `model` names a set of engines answers: each maps to the LoRA adapter it selects,
    None for the base model. A base model name wins over an adapter of the same name (vLLM
    checks base models first)."""
    models: dict[str, str | None] = {}
    bases: set[str] = set()
    for config in configs:
        models.update({name: name for name in config.lora_adapters.values()})
        bases.add(config.served_model_name)
    models.update(dict.fromkeys(bases))
    return models


def lora_for_model(model: str, models: Mapping[str, str | None]) -> str | None:
    """The LoRA adapter `model` selects in a pool's `served_models` (None: the base model);
    404 naming what the pool serves when it is neither."""
    try:
        return models[model]
    except KeyError:
        served = ", ".join(sorted(models)) or "none (no workers yet)"
        raise OpenAIError(
            404, f"The model `{model}` does not exist here; served: {served}", param="model"
        ) from None
