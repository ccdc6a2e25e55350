"""What a worker says about itself at `GET /v1/engine`.

The seed's `EngineConfig` (from the LLMEngine trait) plus the fields a router needs: instance
id, role, data-parallel size, tokenizer identity, where the KV events are published and the
LoRA adapters served. Routers take the KV block size from here and nowhere else: a wrong block
size silently turns KV routing into load-only routing.

`served_models(configs)` is the one rule for what a request's `model` means (the worker, the
EPP and the frontend's kv mode all use it): a served model name is the base model, an adapter
name is that LoRA adapter, anything else is unknown (404, `lora_for_model`).

`EngineTemplate` is the document of engines that serve none (unmodified vLLM,
llm-d-inference-sim): EngineConfig fields shared by those workers, from the EPP's or frontend's
`--engine-config FILE` or a graph's `spec.engineConfig`; `EngineTemplateFields` is that
document's schema (every field optional), which the graph's CRD schema is generated from.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, model_validator
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo

from .identity import instance_id as instance_id_of
from .openai import OpenAIError

ENGINE_PATH = "/v1/engine"
# An engine's admin page of the requests it served (docs/worker.md); benchmarks read it too.
DEBUG_REQUESTS_PATH = "/debug/requests"


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


# ---- the engine document of workers that serve none ------------------------------------------

# Per-worker fields a shared engine document must not fix (each worker's come from its name).
PER_WORKER_FIELDS = ("name", "instance_id")
PER_WORKER_MESSAGE = (
    "would be the same for every worker; leave them out (each worker is named by its pod, "
    "or host:port)"
)
# KvEventsEndpoint fields that are templates of the worker's address.
_TEMPLATED_FIELDS = ("endpoint", "replay_endpoint", "topic")


@dataclass(frozen=True, slots=True)
class EngineTemplate:
    """The engine document of workers that serve none (`--engine-config FILE`, a graph's
    `spec.engineConfig`): EngineConfig fields (model, kv_cache_block_size, tokenizer, kv_events,
    ...) shared by those workers, where `kv_events.endpoint`, `replay_endpoint` and `topic` may
    name the worker's `{host}` and `{port}` (of its engine URL), e.g. `tcp://{host}:5557`, or for
    llm-d-inference-sim `endpoint: tcp://*:5557, bind: true, topic: kv@{host}@MODEL`. Each worker
    is named as an engine that does not name itself is (pod name, or host:port), so `name` and
    `instance_id` may not be given."""

    fields: dict[str, Any]
    source: str = "--engine-config"

    @classmethod
    def load(cls, path: str | Path) -> "EngineTemplate":
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"--engine-config {path}: {exc}") from None
        return cls.checked(raw, source=str(path))

    @classmethod
    def checked(cls, raw: Any, source: str = "--engine-config") -> "EngineTemplate":
        """`from_fields`, then the document made for a worker: say what is wrong now, not when
        the first worker is found (ValueError; pydantic's ValidationError is one)."""
        template = cls.from_fields(raw, source)
        template.config_for("http://127.0.0.1:1", "check")
        return template

    @classmethod
    def from_fields(cls, raw: Any, source: str = "--engine-config") -> "EngineTemplate":
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a mapping of EngineConfig fields")
        fixed = [f for f in PER_WORKER_FIELDS if f in raw]
        if fixed:
            raise ValueError(f"{source}: {', '.join(fixed)} {PER_WORKER_MESSAGE}")
        return cls(dict(raw), source)

    def config_for(self, engine_url: str, name: str) -> EngineConfig:
        data = dict(self.fields)
        events = data.get("kv_events")
        if isinstance(events, dict):
            where = urlsplit(engine_url)
            host = where.netloc.rpartition(":")[0] if where.port else where.netloc
            values = {"host": host, "port": where.port or ""}
            try:
                data["kv_events"] = {
                    k: v.format_map(values) if k in _TEMPLATED_FIELDS and isinstance(v, str) else v
                    for k, v in events.items()
                }
            except (KeyError, ValueError, IndexError) as exc:
                raise ValueError(
                    f"{self.source}: kv_events templates may name {{host}} and {{port}} only "
                    f"({exc!r})"
                ) from None
        return EngineConfig.model_validate(data, context={"name": name})


def _template_fields_model() -> type[BaseModel]:
    """EngineConfig's fields, every one optional, as a model: the schema of an engine document
    in a DynamoGraph (`spec.engineConfig`, whose CRD schema is generated from it), so the
    apiserver checks the document's types and bounds as EngineConfig does. The per-worker
    fields are kept (a string or an integer) only so that a CEL rule can refuse them by name."""
    fields: dict[str, Any] = {}
    for name, info in EngineConfig.model_fields.items():
        if name in PER_WORKER_FIELDS:
            loose: JsonDict = {"x-kubernetes-int-or-string": True}  # a name, an instance id
            fields[name] = (Any, Field(default=None, json_schema_extra=loose))
            continue
        optional = FieldInfo.merge_field_infos(info, default=None, default_factory=None)
        fields[name] = (info.annotation | None, optional)  # type: ignore[operator]
    rule: JsonDict = {
        "rule": " && ".join(f"!has(self.{name})" for name in PER_WORKER_FIELDS),
        "message": f"{', '.join(PER_WORKER_FIELDS)} {PER_WORKER_MESSAGE}",
    }
    config = ConfigDict(extra="forbid", json_schema_extra={"x-kubernetes-validations": [rule]})
    return create_model("EngineTemplateFields", __config__=config, **fields)


# The fields of an engine document (EngineTemplate's `fields`), every one optional.
EngineTemplateFields = _template_fields_model()
