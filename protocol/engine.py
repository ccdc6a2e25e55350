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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from .identity import instance_id as instance_id_of
from .openai import OpenAIError

ENGINE_PATH = "/v1/engine"


class Role(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"


class KvEventsEndpoint(BaseModel):
    """vLLM ZMQ publisher: PUB `endpoint` with `topic`, ROUTER `replay_endpoint` for missed batches.

    `bind`: the engine's PUB *connects* to `endpoint` and the router binds its SUB there (llm-d's
    layout, and llm-d-inference-sim's only one); every worker naming the same endpoint shares the
    router's one socket there and is told apart by its `topic` (llm-d: `kv@<pod IP>@<model>`)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: str = Field(description="ZMQ address of the PUB socket, e.g. tcp://10.0.0.5:5557")
    replay_endpoint: str | None = Field(
        default=None, description="ZMQ address of the ROUTER socket that replays buffered batches"
    )
    topic: str = ""
    bind: bool = Field(
        default=False, description="the router binds `endpoint` and the engine connects to it"
    )


# vLLM's default KV block size: the size an engine that does not say is assumed to use
DEFAULT_KV_BLOCK_SIZE = 16


# The bootstrap path of disaggregation (SGLang's, which Dynamo's prefill router drives): a
# prefill engine advertising `bootstrap_host`/`bootstrap_port` lets the decode leg start at once,
# pulling the prefill's KV from that address by a room number both legs carry in
# `kv_transfer_params`, under this request id, once the prefill has it.
BOOTSTRAP_ROOM = "bootstrap_room"


def bootstrap_request_id(room: int) -> str:
    """The id a prefill holds a bootstrap room's KV under, and the decode leg pulls it by."""
    return f"bootstrap-{room}"


class EngineConfig(BaseModel):
    """Only `model` is required, as in Dynamo's EngineConfig (its other fields are optional
    there). An engine that leaves the rest out is still discovered: `served_model_name` is the
    model; `name` is the pod (or `host:port`) discovery found it at (the validation context's
    `name`), else the served model name; `instance_id` derives from `name`; `tokenizer` is the
    model's (`tokenization.tokenizer_for_model`); the KV block size is vLLM's default 16
    (discovery logs that it guessed); the capacity fields stay unknown (None: the router then
    judges KV usage by the engine's scraped metric alone)."""

    model_config = ConfigDict(extra="forbid")

    # The seed's EngineConfig.
    model: str = Field(min_length=1)
    served_model_name: str
    context_length: int | None = Field(default=None, gt=0)
    kv_cache_block_size: int = Field(default=DEFAULT_KV_BLOCK_SIZE, gt=0)
    total_kv_blocks: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
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

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any, info: ValidationInfo) -> Any:
        """Fill what an engine may leave out (the class docstring)."""
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            return data  # field validation reports it
        data = dict(data)
        model: str = data["model"]
        if data.get("served_model_name") is None:
            data["served_model_name"] = model
        if data.get("name") is None:
            hint = (info.context or {}).get("name")
            data["name"] = hint or data["served_model_name"]
        if data.get("instance_id") is None and data["name"]:
            data["instance_id"] = instance_id_of(data["name"])
        if data.get("tokenizer") is None:
            from .tokenization import tokenizer_for_model  # heavy: only when needed

            data["tokenizer"] = tokenizer_for_model(model)
        return data


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
