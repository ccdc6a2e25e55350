"""vLLM's KV cache events on ZMQ: the wire format the mock engine publishes and the EPP reads.

Matches vLLM's `ZmqEventPublisher`:
- PUB socket, multipart `[topic, seq (8-byte big-endian), payload]`;
- payload = msgpack `EventBatch` as an array `[ts, [event, ...], dp_rank | nil]`;
- events are tagged arrays: `["BlockStored", block_hashes, parent_block_hash | nil, token_ids,
  block_size, lora_id | nil, medium]`, `["BlockRemoved", block_hashes, medium]`,
  `["AllBlocksCleared"]`; trailing default fields may be omitted (msgspec `omit_defaults`);
  engine hashes may be ints or bytes; vLLM >= 0.28 sends the same events as maps tagged by a
  `type` field (`{"type": "BlockStored", "block_hashes": ...}`): `decode_batch` reads both,
  `encode_batch` writes the array layout unless asked for maps;
- replay: a DEALER sends `[b"", start_seq]` to the ROUTER socket, which answers one
  `[b"", seq, payload]` per buffered batch from `start_seq` on and ends with `[b"", -1, b""]`;
- with data parallelism every rank publishes on its own port: base port + rank.
"""

from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = ""
MEDIUM_GPU = "GPU"

EngineHash = int | bytes


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[EngineHash]
    medium: str | None = MEDIUM_GPU


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[KvEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM EventBatch; the message says what was wrong."""


def _event_to_wire(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def _event_to_map(event: KvEvent) -> dict[str, Any]:
    """vLLM >= 0.28's layout: the event's fields by name, tagged by `type`."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored", "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
            "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
            "lora_name": None,
        }  # fmt: skip
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch, *, map_layout: bool = False) -> bytes:
    """vLLM's array layout by default; `map_layout` writes vLLM >= 0.28's maps."""
    to_wire = _event_to_map if map_layout else _event_to_wire
    data: bytes = msgpack.packb(
        [batch.ts, [to_wire(e) for e in batch.events], batch.data_parallel_rank]
    )
    return data


_MAP_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event_from_map(raw: dict[str, Any]) -> KvEvent:
    """vLLM >= 0.28 drops `array_like`: an event is a map tagged by its `type` field."""
    tag = raw.get("type")
    if tag not in _MAP_FIELDS:
        raise KvEventDecodeError(f"unknown KV event type {tag!r}")
    missing = [k for k in _MAP_FIELDS[tag] if k not in raw]
    if missing:
        raise KvEventDecodeError(f"{tag} event lacks {', '.join(missing)}")
    if tag == "BlockStored":
        return BlockStored(
            raw["block_hashes"], raw["parent_block_hash"], raw["token_ids"], raw["block_size"],
            raw.get("lora_id"), raw.get("medium", MEDIUM_GPU),
        )  # fmt: skip
    if tag == "BlockRemoved":
        return BlockRemoved(raw["block_hashes"], raw.get("medium", MEDIUM_GPU))
    return AllBlocksCleared()


def _event_from_wire(raw: object) -> KvEvent:
    if isinstance(raw, dict):
        return _event_from_map(raw)
    if not isinstance(raw, list | tuple) or not raw:
        raise KvEventDecodeError(f"event must be a tagged array, got {raw!r:.80}")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        if len(fields) < 4:
            raise KvEventDecodeError(f"BlockStored needs at least 4 fields, got {len(fields)}")
        return BlockStored(*fields[:6])
    if tag == "BlockRemoved":
        if not fields:
            raise KvEventDecodeError("BlockRemoved needs block_hashes")
        return BlockRemoved(*fields[:2])
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventDecodeError(f"unknown KV event tag {tag!r}")


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, strict_map_key=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise KvEventDecodeError(f"EventBatch must be [ts, events, dp_rank], got {raw!r:.80}")
    dp_rank = raw[2] if len(raw) > 2 else None
    return EventBatch(
        ts=raw[0], events=[_event_from_wire(e) for e in raw[1]], data_parallel_rank=dp_rank
    )


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def decode_seq(raw: bytes) -> int:
    """Sequence number of a frame; -1 is the end-of-replay marker."""
    return int.from_bytes(raw, "big", signed=True)


def engine_hash_key(value: EngineHash) -> int:
    """Engine block hashes arrive as ints or bytes; fold both to a non-negative int key."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(value, "big")
    return value & ((1 << 64) - 1) if value < 0 else value


def endpoint_for_rank(endpoint: str, dp_rank: int) -> str:
    """vLLM's per-rank endpoint: tcp port + rank, or an `_dp<rank>` suffix for inproc/ipc."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + dp_rank}"
    return f"{endpoint}_dp{dp_rank}"
