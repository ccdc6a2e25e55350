"""vLLM's KV cache events on ZMQ: the wire format the mock engine publishes and the EPP reads.

Matches vLLM's `ZmqEventPublisher` (vllm/distributed/kv_events.py):
- PUB socket, multipart `[topic, seq (8-byte big-endian), payload]`;
- payload = msgpack `EventBatch` of `ts`, `events` and `data_parallel_rank` (vLLM >= 0.10),
  the events `BlockStored` (block_hashes, parent_block_hash | nil, token_ids, block_size,
  lora_id | nil, medium, lora_name | nil, then what newer vLLMs add: extra_keys, group_idx, ...),
  `BlockRemoved` (block_hashes, medium, ...) and `AllBlocksCleared`; trailing fields with
  defaults may be omitted (msgspec `omit_defaults`); engine hashes may be ints or bytes;
- three `LAYOUTS` of those msgspec Structs, which `decode_batch` all reads: `ARRAY`, vLLM
  0.9.0 to 0.23.0 (batch and events `array_like`): `[ts, [event, ...], dp_rank]` with tagged
  arrays `["BlockStored", block_hashes, ...]`; `MAP`, vLLM 0.24.0 to 0.33.0 (the events dropped
  `array_like`, vLLM PR #42892; the batch kept it): the same outer array, each event a map
  tagged by its `type` field (`{"type": "BlockStored", "block_hashes": ...}`); `MAP_BATCH`,
  the batch a map too (`{"ts", "events", "data_parallel_rank"}`), as vLLM's source has it at
  commit 0181ea31 (no release up to 0.33.0 ships it);
- replay: a DEALER sends `[b"", start_seq]` to the ROUTER socket, which answers one
  `[b"", seq, payload]` per buffered batch from `start_seq` on and ends with `[b"", -1, b""]`
  (vLLM >= 0.26 puts its topic frame before the seq);
- with data parallelism every rank publishes on its own port: base port + rank.

Two decoders, one meaning. `decode_batch` builds Python lists (msgpack.unpackb) and reads every
layout. `parse_batch`, after `warm_up()` (the routers' index warm-up calls it), reads the
`ARRAY` and `MAP` layouts with a compiled parser (`kv_events_kernel`) into numpy arrays: a
BlockStored's `token_ids` a u32 array (what the block hasher takes as is), its and a
BlockRemoved's `block_hashes` views of one uint64 buffer (int64 when the engine sent negative
ints, so the values are the engine's); everything else equal to `decode_batch`'s, and `None`
for any payload it leaves to `decode_batch` (a map batch, bytes hashes, ext types, malformed
data...).
Its batch is a `ParsedBatch`: the events as rows of an int64 matrix over the flat hash and
token arrays, which the router's index applies in one compiled call (no object per event), and
as the same `events` (built on first use). `decode_batch_arrays` is the two together: what the
EPP's subscribers decode with.
"""

import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
from numpy.typing import NDArray

from .compiled import compile_ahead

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_TOPIC = ""
MEDIUM_GPU = "GPU"

EngineHash = int | bytes


@dataclass(slots=True)
class BlockStored:
    # lists from `decode_batch`; numpy arrays from `parse_batch` (module docstring)
    block_hashes: Sequence[EngineHash] | np.ndarray
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int] | np.ndarray
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    # the LoRA adapter's name (vLLM sends it with `lora_id` since its events carry names); the
    # router hashes the blocks under it, with no need to know vLLM's ids for the adapters
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: Sequence[EngineHash] | np.ndarray
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


class ParsedBatch:
    """A batch as the compiled parser read it: one row of `meta` per event (the columns above)
    over the flat `hashes` (their 64-bit patterns) and `tokens` arrays, for the index to apply
    without an object per event; `events` are the objects `decode_batch` gives, with arrays
    for the lists (views of `hashes` and `tokens`), built on first use."""

    __slots__ = ("_events", "data_parallel_rank", "hashes", "meta", "payload", "tokens", "ts")

    def __init__(
        self,
        payload: bytes,
        hashes: NDArray[np.uint64],
        tokens: NDArray[np.uint32],
        meta: NDArray[np.int64],
        ts: float,
        data_parallel_rank: int | None,
    ):
        self.payload, self.hashes, self.tokens, self.meta = payload, hashes, tokens, meta
        self.ts, self.data_parallel_rank = ts, data_parallel_rank
        self._events: list[KvEvent] | None = None

    @property
    def events(self) -> list[KvEvent]:
        if self._events is None:
            self._events = [self._event(row) for row in self.meta.tolist()]
        return self._events

    def event(self, index: int) -> KvEvent:
        """The event of row `index`."""
        if self._events is not None:
            return self._events[index]
        return self._event(self.meta[index].tolist())

    def _event(self, row: list[int]) -> KvEvent:
        kind = row[KIND]
        if kind == CLEARED:
            return AllBlocksCleared()
        block_hashes: NDArray[Any] = self.hashes[row[HASH_START] : row[HASH_END]]
        if row[SIGNED]:
            block_hashes = block_hashes.view(np.int64)
        medium = _medium(self.payload, row)
        if kind == REMOVED:
            return BlockRemoved(block_hashes, medium)
        parent: int | None = row[PARENT_VALUE]
        if row[PARENT] == NONE:
            parent = None
        elif row[PARENT] == UNSIGNED:
            parent = row[PARENT_VALUE] & _U64
        lora = row[LORA_VALUE] if row[LORA] == INT else None
        name = None
        if row[LORA_NAME] == TEXT:
            name = self.payload[row[LORA_NAME_START] : row[LORA_NAME_END]].decode("ascii")
        token_ids = self.tokens[row[TOKEN_START] : row[TOKEN_END]]
        return BlockStored(block_hashes, parent, token_ids, row[BLOCK_SIZE], lora, medium, name)


Batch = EventBatch | ParsedBatch  # what the decoders give: the same attributes


class KvEventDecodeError(ValueError):
    """A payload that is not a vLLM EventBatch; the message says what was wrong."""


def _plain(values: Sequence[Any] | np.ndarray) -> Sequence[Any]:
    """What msgpack packs: a list for `parse_batch`'s arrays."""
    return values.tolist() if isinstance(values, np.ndarray) else values


def _event_to_wire(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        fields = [
            "BlockStored",
            _plain(event.block_hashes),
            event.parent_block_hash,
            _plain(event.token_ids),
            event.block_size,
            event.lora_id,
            event.medium,
        ]
        # msgspec's omit_defaults: a trailing field at its default is not sent
        return fields if event.lora_name is None else [*fields, event.lora_name]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", _plain(event.block_hashes), event.medium]
    return ["AllBlocksCleared"]


def _event_to_map(event: KvEvent) -> dict[str, Any]:
    """An event as vLLM >= 0.24 encodes it: its fields by name, tagged by `type` (`lora_name`
    has no default there, so it is always sent)."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored", "block_hashes": _plain(event.block_hashes),
            "parent_block_hash": event.parent_block_hash, "token_ids": _plain(event.token_ids),
            "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
            "lora_name": event.lora_name,
        }  # fmt: skip
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved", "block_hashes": _plain(event.block_hashes),
            "medium": event.medium,
        }  # fmt: skip
    return {"type": "AllBlocksCleared"}


ARRAY, MAP, MAP_BATCH = "array", "map", "map-batch"  # the layouts (module docstring)
LAYOUTS = (ARRAY, MAP, MAP_BATCH)


def encode_batch(batch: Batch, *, layout: str = ARRAY) -> bytes:
    """`batch` in one of vLLM's `LAYOUTS` (module docstring)."""
    if layout not in LAYOUTS:
        raise ValueError(f"KV event layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    to_wire = _event_to_wire if layout == ARRAY else _event_to_map
    events = [to_wire(e) for e in batch.events]
    raw: Any = [batch.ts, events, batch.data_parallel_rank]
    if layout == MAP_BATCH:
        raw = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:  # msgspec's omit_defaults
            raw["data_parallel_rank"] = batch.data_parallel_rank
    data: bytes = msgpack.packb(raw)
    return data


_MAP_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event_from_map(raw: dict[str, Any]) -> KvEvent:
    """vLLM >= 0.24 drops the events' `array_like`: an event is a map tagged by `type`."""
    tag = raw.get("type")
    if tag not in _MAP_FIELDS:
        raise KvEventDecodeError(f"unknown KV event type {tag!r}")
    missing = [k for k in _MAP_FIELDS[tag] if k not in raw]
    if missing:
        raise KvEventDecodeError(f"{tag} event lacks {', '.join(missing)}")
    if tag == "BlockStored":
        return BlockStored(
            raw["block_hashes"], raw["parent_block_hash"], raw["token_ids"], raw["block_size"],
            raw.get("lora_id"), raw.get("medium", MEDIUM_GPU), _lora_name(raw.get("lora_name")),
        )  # fmt: skip
    if tag == "BlockRemoved":
        return BlockRemoved(raw["block_hashes"], raw.get("medium", MEDIUM_GPU))
    return AllBlocksCleared()


def _lora_name(value: object) -> str | None:
    """An event's `lora_name`: a string, else none (what else a publisher puts there is
    ignored, as fields the decoder does not know are)."""
    return value if isinstance(value, str) else None


def _event_from_wire(raw: object) -> KvEvent:
    if isinstance(raw, dict):
        return _event_from_map(raw)
    if not isinstance(raw, list | tuple) or not raw:
        raise KvEventDecodeError(f"event must be a tagged array, got {raw!r:.80}")
    tag, fields = raw[0], list(raw[1:])
    if tag == "BlockStored":
        if len(fields) < 4:
            raise KvEventDecodeError(f"BlockStored needs at least 4 fields, got {len(fields)}")
        stored = BlockStored(*fields[:6])
        stored.lora_name = _lora_name(fields[6] if len(fields) > 6 else None)
        return stored
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
    if isinstance(raw, dict) and "ts" in raw and "events" in raw:  # MAP_BATCH
        ts, events, dp_rank = raw["ts"], raw["events"], raw.get("data_parallel_rank")
    elif isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, dp_rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError(
            f"EventBatch must be [ts, events, dp_rank] or a map of them, got {raw!r:.80}"
        )
    if not isinstance(events, list | tuple):
        raise KvEventDecodeError(f"EventBatch events must be an array, got {events!r:.80}")
    return EventBatch(
        ts=ts, events=[_event_from_wire(e) for e in events], data_parallel_rank=dp_rank
    )


# -- the compiled parser (kv_events_kernel): its output, one int64 row of `meta` per event ----
NOT_MINE = -1  # read_batch's event count for a payload it leaves to `decode_batch`
KIND, HASH_START, HASH_END, TOKEN_START, TOKEN_END = 0, 1, 2, 3, 4  # meta columns
PARENT, PARENT_VALUE, BLOCK_SIZE, LORA, LORA_VALUE = 5, 6, 7, 8, 9
MEDIUM, MEDIUM_START, MEDIUM_END, SIGNED = 10, 11, 12, 13  # SIGNED: the hashes had a negative
LORA_NAME, LORA_NAME_START, LORA_NAME_END = 14, 15, 16
META_FIELDS = 17
STORED, REMOVED, CLEARED = 1, 2, 3  # KIND
# PARENT, LORA, LORA_NAME and the dp_rank: nil or absent (or, LORA_NAME, anything but a string);
# an int (the value, within int64); an int sent in an unsigned format (PARENT only: the value's
# 64 bits, which may stand for 2^63 or more); text (LORA_NAME: its bytes, ASCII)
NONE, INT, UNSIGNED, TEXT = 0, 1, 2, 3
MEDIUM_ABSENT, MEDIUM_NIL, MEDIUM_IS_GPU, MEDIUM_TEXT = 0, 1, 2, 3  # MEDIUM; TEXT: its bytes
TS_F64, TS_F32 = 1, 2
MIN_EVENT_BYTES = 15  # `["BlockRemoved", []]`, the shortest event: bounds the rows needed

_ReadBatch = Callable[[bytes, np.ndarray, np.ndarray, np.ndarray], tuple[int, int, int, int, int]]
_reader: _ReadBatch | None = None  # set by warm_up()
_reader_lock = threading.Lock()
_TS = {TS_F64: struct.Struct(">d").unpack_from, TS_F32: struct.Struct(">f").unpack_from}
_U64 = (1 << 64) - 1


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) the batch parser and let `parse_batch` use
    it from now on in this process. Imports numba: for processes that already run it."""
    global _reader
    if _reader is None:
        with _reader_lock:
            if _reader is None:
                from . import kv_events_kernel

                reader: _ReadBatch = compile_ahead(
                    kv_events_kernel.read_batch, kv_events_kernel.SIGNATURE, "KV-event batch"
                )
                # the first call sets numba's runtime up (~10 ms): here, not on a live batch
                _read(reader, encode_batch(EventBatch(0.0, [AllBlocksCleared()])))
                _reader = reader


def _read(reader: _ReadBatch, payload: bytes) -> ParsedBatch | None:
    """The parser's rows over fresh arrays (events keep views of them: an int takes at least a
    byte of the payload, so `size` cells always suffice)."""
    size = len(payload)
    hashes = np.empty(size, np.uint64)
    tokens = np.empty(size, np.uint32)
    meta = np.empty((size // MIN_EVENT_BYTES + 1, META_FIELDS), np.int64)
    count, ts_kind, ts_at, dp_kind, dp = reader(payload, hashes, tokens, meta)
    if count == NOT_MINE:
        return None
    ts: float = _TS[ts_kind](payload, ts_at)[0]
    return ParsedBatch(payload, hashes, tokens, meta[:count], ts, dp if dp_kind == INT else None)


def _medium(payload: bytes, row: list[int]) -> str | None:
    kind = row[MEDIUM]
    if kind in (MEDIUM_ABSENT, MEDIUM_IS_GPU):
        return MEDIUM_GPU
    if kind == MEDIUM_NIL:
        return None
    return payload[row[MEDIUM_START] : row[MEDIUM_END]].decode("ascii")


def parse_batch(payload: bytes) -> ParsedBatch | None:
    """`decode_batch(payload)` with numpy arrays for the hash and token lists, read by the
    compiled parser (module docstring); None when it is not warmed up or leaves this payload
    to `decode_batch` (which then decodes it, or raises, as ever)."""
    reader = _reader
    if reader is None or type(payload) is not bytes:
        return None
    return _read(reader, payload)


def decode_batch_arrays(payload: bytes) -> Batch:
    """`parse_batch` where it reads the payload, else `decode_batch`: the same events (arrays
    where the parser read them), the same errors. What the EPP's subscribers decode with."""
    batch = parse_batch(payload)
    return decode_batch(payload) if batch is None else batch


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
