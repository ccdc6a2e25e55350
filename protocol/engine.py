"""What a worker says about itself at `GET /v1/engine` (DESIGN §3.2).

The seed's `EngineConfig` (from the LLMEngine trait) plus the fields a router needs: instance
id, role, data-parallel size, tokenizer identity and where the KV events are published. Routers
take the KV block size from here and nowhere else: a wrong block size silently turns KV routing
into load-only routing.
"""

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

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
