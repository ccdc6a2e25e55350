"""The compiled KV-event batch parser (`kv_events.parse_batch`, after `warm_up`) against the
pure-Python decoder (`decode_batch`): on any payload it either gives exactly the batch the
decoder gives (arrays where the decoder gives lists) or leaves the payload to the decoder; and
it does read vLLM's ordinary layouts itself: tagged array events (vLLM <= 0.23) and `type`-tagged
map events (vLLM >= 0.24)."""

import math
import struct
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.protocol import kv_events
from dynamograph.protocol.hashing import as_token_array, block_hash_array
from dynamograph.protocol.kv_events import (
    ARRAY,
    MAP,
    MAP_BATCH,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    decode_batch,
    decode_batch_arrays,
    encode_batch,
    parse_batch,
)

pytestmark = pytest.mark.unit

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
U64 = st.integers(0, (1 << 64) - 1)
ANY_INT = st.one_of(I64, U64, st.integers(-40, 300))  # small ones: fixints, 1-byte forms
HASH = st.one_of(ANY_INT, st.binary(min_size=1, max_size=9))  # newer vLLM: bytes hashes
TOKEN = st.one_of(st.integers(0, (1 << 32) - 1), st.integers(0, 200), ANY_INT)
SCALAR = st.one_of(
    st.none(), st.booleans(), ANY_INT, st.floats(allow_nan=False, width=32), st.text(max_size=6),
    st.binary(max_size=4),
)  # fmt: skip
# what a newer vLLM may append to an event or a batch: anything msgpack carries
EXTRA = st.recursive(
    SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=6,
)
MEDIUM = st.sampled_from(["GPU", "CPU", None])
ODD_MEDIUM = st.one_of(st.text(max_size=5), ANY_INT)
# a map event's keys for the fields, in the array layout's order
KEYS = {
    "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name"],
    "BlockRemoved": ["block_hashes", "medium"],
}  # fmt: skip
KNOWN_KEYS = ["type", *KEYS["BlockStored"]]
# what newer vLLMs add to a map event, and what a publisher may put there
NEWER_KEYS = st.sampled_from(["extra_keys", "group_idx", "kv_cache_spec_kind", "x"])
# an adapter's name, ASCII or not (the parser leaves UTF-8 to the decoder), or what else may be
# there (the decoder ignores it)
LORA_NAME = st.one_of(st.none(), st.text(max_size=8), st.sampled_from(["sql", "lora-7"]))
ODD_LORA_NAME = st.one_of(ANY_INT, st.binary(max_size=3), EXTRA)
ODD_KEYS = st.one_of(
    st.sampled_from(KNOWN_KEYS), st.text(max_size=4), ANY_INT, st.binary(max_size=2)
)


class Pairs(list):
    """A map as its (key, value) pairs, packed in this order and duplicates kept (`_packb`)."""


@st.composite
def mostly(draw, ordinary, odd):
    """Usually what vLLM sends, one time in eight something else the decoder takes or refuses:
    most batches keep to the ordinary layout but for one field."""
    return draw(odd if draw(st.integers(0, 7)) == 0 else ordinary)


@st.composite
def wire_event(draw):
    """An event in the array or the map layout, as lists or `Pairs`, with what a publisher may
    vary: every int form, bytes hashes, trailing fields (or optional keys) omitted or added, odd
    field types, unknown tags; map keys in any order, unknown keys with nested values, odd keys
    (required ones missing, a key twice, keys that are not strings)."""
    tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])
    kind = draw(mostly(tags, st.one_of(st.just("Bogus"), ANY_INT)))
    hashes = draw(mostly(st.lists(st.sampled_from([I64, U64, st.integers(-40, 300)]).flatmap(
        lambda ints: ints), max_size=5), st.lists(HASH, max_size=5)))  # fmt: skip
    if kind == "BlockStored":
        size = draw(st.integers(1, 4))
        tokens = st.lists(st.integers(0, (1 << 32) - 1), min_size=len(hashes) * size,
                          max_size=len(hashes) * size)  # fmt: skip
        fields = [
            hashes,
            draw(mostly(st.one_of(st.none(), ANY_INT), st.one_of(HASH, st.text(max_size=2)))),
            draw(mostly(tokens, st.lists(st.one_of(TOKEN, st.floats(width=32)), max_size=6))),
            draw(mostly(st.just(size), st.one_of(ANY_INT, st.booleans(), st.none()))),
            draw(mostly(st.one_of(st.none(), st.integers(0, 1 << 31)), st.one_of(U64, st.text()))),
            draw(mostly(MEDIUM, ODD_MEDIUM)),
            draw(mostly(LORA_NAME, ODD_LORA_NAME)),
        ]
        least = 4
    elif kind == "BlockRemoved":
        fields, least = [hashes, draw(mostly(MEDIUM, ODD_MEDIUM))], 1
    else:
        fields, least = [], 0
    if draw(st.booleans()):  # the array layout
        kept = draw(mostly(st.integers(least, len(fields)), st.integers(0, len(fields))))
        extras = draw(mostly(st.just([]), st.lists(EXTRA, max_size=2)))
        return [kind, *fields[:kept], *(extras if kept == len(fields) else [])]
    pairs = [
        (key, value)
        for i, (key, value) in enumerate(zip(KEYS.get(kind, []), fields, strict=False))
        if draw(mostly(st.just(True) if i < least else st.booleans(), st.booleans()))
    ]
    if draw(mostly(st.just(True), st.booleans())):
        pairs.append(("type", kind))
    pairs += draw(st.lists(st.tuples(mostly(NEWER_KEYS, ODD_KEYS), EXTRA), max_size=3))
    return Pairs(draw(st.permutations(pairs)))


@st.composite
def wire_batch(draw):
    ts = draw(mostly(st.floats(allow_nan=False, width=32), st.one_of(ANY_INT, st.none())))
    events = draw(st.lists(wire_event(), max_size=4))
    batch = [ts, events]
    if draw(st.booleans()):
        batch.append(draw(mostly(st.one_of(st.none(), st.integers(0, 64)),
                                 st.one_of(ANY_INT, st.text(max_size=2)))))  # fmt: skip
        batch += draw(mostly(st.just([]), st.lists(EXTRA, max_size=1)))
    return batch


@pytest.fixture(scope="module", autouse=True)
def compiled():
    kv_events.warm_up()
    assert kv_events._reader is not None


def _shape(batch: EventBatch) -> tuple:
    """Everything a batch says, arrays as lists, each value with its type: equal shapes are
    equal batches (1 == True == 1.0 would not tell a bool or float from an int)."""

    def value(v):
        if isinstance(v, np.ndarray):
            v = v.tolist()
        if isinstance(v, list):
            return ("list", [value(x) for x in v])
        if isinstance(v, float) and math.isnan(v):
            return ("float", "nan")
        return (type(v).__name__, v)

    events = [
        (type(e).__name__, *(value(getattr(e, f)) for f in e.__slots__)) for e in batch.events
    ]
    return value(batch.ts), events, value(batch.data_parallel_rank)


def _outcome(decode, payload):
    try:
        return _shape(decode(payload))
    except Exception as exc:  # the decoder's errors, whatever they are, are part of its behaviour
        return type(exc), str(exc)


def _same_as_decoder(payload: bytes) -> bool:
    """The parser's batch equals the decoder's, or it declined; and either way the sibling the
    EPP uses behaves exactly as the decoder. Returns whether the parser read it."""
    want = _outcome(decode_batch, payload)
    assert _outcome(decode_batch_arrays, payload) == want
    parsed = parse_batch(payload)
    if parsed is not None:
        assert _shape(parsed) == want
    return parsed is not None


def _packb(obj, single_float: bool = False) -> bytes:
    """`obj` packed as msgpack.packb would, `Pairs` as maps."""
    packer = msgpack.Packer(use_single_float=single_float, autoreset=False)

    def pack(value):
        if isinstance(value, Pairs):
            packer.pack_map_header(len(value))
            for pair in value:
                pack(pair[0])
                pack(pair[1])
        elif isinstance(value, list):
            packer.pack_array_header(len(value))
            for item in value:
                pack(item)
        else:
            packer.pack(value)

    pack(obj)
    return packer.bytes()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire_batch(), st.booleans())
def test_any_batch_decodes_as_the_decoder_decodes_it(batch, single_float):
    _same_as_decoder(_packb(batch, single_float))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(wire_batch(), st.data())
def test_damaged_payloads_decode_or_fail_as_the_decoder_does(batch, data):
    payload = bytearray(_packb(batch))
    action = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if action == "truncate":
        del payload[data.draw(st.integers(0, len(payload))) :]
    elif action == "flip" and payload:
        at = data.draw(st.integers(0, len(payload) - 1))
        payload[at] = data.draw(st.integers(0, 255))
    else:
        payload += data.draw(st.binary(min_size=1, max_size=3))
    _same_as_decoder(bytes(payload))


@st.composite
def vllm_batch(draw):
    """What vLLM's ZmqEventPublisher sends (msgspec, array_like, omit_defaults): int hashes
    (its u64 hashes, or Python's signed ones), u32 token ids, float timestamps."""
    events = []
    for _ in range(draw(st.integers(0, 4))):
        # one engine, one kind of hash: signed (Python's hash()) or u64 (vLLM's sha256 cut)
        hashes = draw(st.lists(I64 if draw(st.booleans()) else U64, max_size=8))
        if draw(st.booleans()):
            n, size = len(hashes), draw(st.integers(1, 32))
            tokens = draw(
                st.lists(st.integers(0, (1 << 32) - 1), min_size=n * size, max_size=n * size)
            )
            parent = draw(st.one_of(st.none(), I64, U64))
            lora = draw(st.one_of(st.none(), st.integers(0, 1 << 31)))
            medium = draw(st.sampled_from(["GPU", "CPU", None]))
            name = draw(st.none() if lora is None else st.sampled_from(["sql", "lora-7", None]))
            events.append(BlockStored(hashes, parent, tokens, size, lora, medium, name))
        else:
            events.append(BlockRemoved(hashes, draw(st.sampled_from(["GPU", "CPU", None]))))
    if draw(st.booleans()):
        events.append(AllBlocksCleared())
    ts = draw(st.floats(0, 2e9))
    return EventBatch(ts, events, draw(st.one_of(st.none(), st.integers(0, 1 << 20))))


ASCII = st.text(st.characters(max_codepoint=0x7F), max_size=8)
# the keys vLLM 0.24-0.33 add to its map events, with values of their types
NEWER_VLLM_KEYS = {
    "lora_name": st.one_of(st.none(), ASCII),
    "extra_keys": st.one_of(
        st.none(),
        st.lists(
            st.one_of(st.none(), st.lists(st.one_of(ASCII, st.integers(0, 1 << 40)), max_size=3)),
            max_size=3,
        ),
    ),
    "group_idx": st.integers(0, 8),
    "kv_cache_spec_kind": st.sampled_from(["full_attention", "sliding_window", "mamba"]),
}


@st.composite
def vllm_map_batch(draw):
    """What vLLM >= 0.24 sends: the batch an array, its events `type`-tagged maps, `lora_id` and
    `medium` left out at their defaults (msgspec's omit_defaults) or not, the keys newer vLLMs
    add present or not, all in any order (msgspec writes the tag first, then the fields in
    declaration order; a publisher need not)."""
    ts, events, dp_rank = msgpack.unpackb(encode_batch(draw(vllm_batch()), layout=MAP))
    maps = []
    for event in events:
        defaults = {"lora_id": None, "medium": "GPU", "lora_name": None}
        pairs = [
            (key, value)
            for key, value in event.items()
            if not (key in defaults and value == defaults[key] and draw(st.booleans()))
        ]
        if event["type"] != "AllBlocksCleared":
            for key, values in NEWER_VLLM_KEYS.items():
                if key not in event and draw(st.booleans()):
                    pairs.append((key, draw(values)))
        maps.append(Pairs(draw(st.permutations(pairs))))
    return [ts, maps, dp_rank]


def _read_as_arrays(payload: bytes) -> None:
    """The parser reads `payload` (no fallback to the decoder) into the decoder's batch, with
    u32 token ids and 64-bit engine hashes."""
    assert _same_as_decoder(payload), "the parser left an ordinary batch to the decoder"
    for event in parse_batch(payload).events:
        if isinstance(event, BlockStored):
            assert event.token_ids.dtype == np.uint32
        if not isinstance(event, AllBlocksCleared):
            assert event.block_hashes.dtype in (np.uint64, np.int64)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vllm_batch(), st.sampled_from([ARRAY, MAP]))
def test_vllm_ordinary_layouts_are_read_by_the_parser(batch, layout):
    _read_as_arrays(encode_batch(batch, layout=layout))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vllm_map_batch())
def test_vllm_map_events_in_any_key_order_with_newer_keys_are_read_by_the_parser(batch):
    _read_as_arrays(_packb(batch))


def test_what_the_parser_reads_and_what_it_leaves():
    tokens = list(range(32))
    stored = ["BlockStored", [1, 2], None, tokens, 16]
    stored_map = {
        "type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None,
        "token_ids": tokens, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
    }  # fmt: skip
    removed_map = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU"}
    type_twice = Pairs([
        ("type", "BlockRemoved"), ("token_ids", [b"x"]), ("block_hashes", [1]),
        ("parent_block_hash", None), ("block_size", 16), ("type", "BlockStored"),
    ])  # fmt: skip
    read = {
        "omitted defaults": [1.0, [stored], None],
        "all fields": [1.0, [[*stored, 7, "CPU"]], 3],
        "newer vLLM's trailing fields": [1.0, [[*stored, None, "GPU", "lora-a", [[1, "x"]]]], 0],
        "negative hashes": [1.0, [["BlockStored", [-1, -(1 << 63)], -5, tokens, 16]], None],
        "hashes from 2^63": [1.0, [["BlockRemoved", [(1 << 64) - 1, 1 << 63]]], None],
        "no dp_rank": [1.0, [["AllBlocksCleared"]]],
        "extra batch field": [1.0, [], None, [1, 2.5, True]],
        "a map in a trailing field": [1.0, [[*stored, None, "GPU", {"k": 1, 2: [b"x"]}]], None],
        "map events (vLLM >= 0.24)": [
            1.0,
            [stored_map, removed_map, {"type": "AllBlocksCleared"}],
            0,
        ],
        "map keys in any order, defaults omitted": [
            1.0,
            [
                {
                    "token_ids": tokens,
                    "block_size": 16,
                    "type": "BlockStored",
                    "lora_id": 3,
                    "parent_block_hash": (1 << 64) - 1,
                    "block_hashes": [1, 2],
                }
            ],
            None,
        ],
        "newer vLLM's keys": [
            1.0,
            [
                stored_map
                | {
                    "extra_keys": [None, [["mm", 3]]],
                    "group_idx": 0,
                    "kv_cache_spec_kind": "full",
                    "future": {"k": [1.5, b"x", True, None], 7: {}},
                }
            ],
            1,
        ],
        "a key another kind of event has": [1.0, [removed_map | {"token_ids": [b"x"]}], None],
        "an adapter's name": [1.0, [stored_map | {"lora_id": 1, "lora_name": "sql"}], 0],
        "an adapter's name, array": [1.0, [[*stored, 1, "GPU", "sql"]], 0],
        "a lora_name not a string": [1.0, [stored_map | {"lora_name": [5, b"x"]}], 0],
        "array and map events in one batch": [1.0, [stored, removed_map], None],
    }
    left = {
        "a map batch": encode_batch(EventBatch(1.0, [AllBlocksCleared()], 0), layout=MAP_BATCH),
        "bytes hashes": _packb([1.0, [["BlockRemoved", [b"\x01"]]], None]),
        "bytes hashes in a map": _packb([1.0, [removed_map | {"block_hashes": [b"\x01"]}], 0]),
        "negative and >= 2^63 in one event": _packb([1.0, [["BlockRemoved", [-1, 1 << 63]]], None]),
        "token id above u32": _packb([1.0, [["BlockStored", [1], None, [1 << 32], 1]], None]),
        "a map's key twice": _packb([1.0, [Pairs([*removed_map.items(), ("medium", "CPU")])], 0]),
        # the decoder keeps the last type: a BlockStored whose token ids the first type skipped
        "a map's type twice": _packb([1.0, [type_twice], 0]),
        "a map key not a string": _packb([1.0, [removed_map | {7: 1}], None]),
        "a map key not ASCII": _packb([1.0, [removed_map | {"grüße": 1}], None]),
        "a lora_name not ASCII": _packb([1.0, [stored_map | {"lora_name": "grüße"}], None]),
        "an array as a nested key": _packb(
            [1.0, [Pairs([("type", "AllBlocksCleared"), ("x", Pairs([([1], 2)]))])], None]
        ),
        "a map without a type": _packb([1.0, [{"block_hashes": [1]}], None]),
        "a map lacking a field": _packb(
            [1.0, [{k: v for k, v in stored_map.items() if k != "parent_block_hash"}], None]
        ),
        "int timestamp": _packb([1, [], None]),
        "truncated": _packb([1.0, [stored], None])[:-3],
        "trailing bytes": _packb([1.0, [], None]) + b"\x00",
        "unknown tag": _packb([1.0, [["Bogus"]], None]),
        "too few fields": _packb([1.0, [["BlockStored", [1]]], None]),
    }
    for name, batch in read.items():
        assert _same_as_decoder(_packb(batch)), name
    assert _same_as_decoder(_packb(read["all fields"], single_float=True))  # float32 ts
    for name, payload in left.items():
        assert not _same_as_decoder(payload), name
    assert _same_as_decoder(encode_batch(EventBatch(1.0, [BlockRemoved([1])], 0), layout=MAP))
    for name in ("an adapter's name", "an adapter's name, array"):
        (event,) = parse_batch(_packb(read[name])).events
        assert (event.lora_id, event.lora_name) == (1, "sql"), name
    assert parse_batch(_packb(read["a lora_name not a string"])).events[0].lora_name is None
    assert decode_batch_arrays(left["a lora_name not ASCII"]).events[0].lora_name == "grüße"
    with pytest.raises(KvEventDecodeError, match="unknown KV event tag"):
        decode_batch_arrays(left["unknown tag"])
    with pytest.raises(KvEventDecodeError, match="lacks parent_block_hash"):
        decode_batch_arrays(left["a map lacking a field"])
    with pytest.raises(TypeError, match="unhashable"):  # msgpack's own error, as before
        decode_batch_arrays(left["an array as a nested key"])


def test_arrays_go_to_hashing_and_the_index_without_a_copy():
    tokens = np.arange(64, dtype=np.uint32) * 7919
    batch = EventBatch(
        2.0, [BlockStored([5, 6, 7, 8], 4, tokens.tolist(), 16), BlockRemoved([1, 2])], 0
    )
    stored, removed = parse_batch(encode_batch(batch)).events
    assert as_token_array(stored.token_ids) is stored.token_ids
    assert block_hash_array(stored.token_ids, 16).tolist() == block_hash_array(tokens, 16).tolist()
    assert stored.block_hashes.dtype == np.uint64 and stored.block_hashes.base is not None
    assert stored.block_hashes.base is removed.block_hashes.base  # one buffer for the batch
    # a parsed batch encodes back to the same payload
    assert encode_batch(parse_batch(encode_batch(batch))) == encode_batch(batch)


def test_float32_timestamp_is_the_decoders_float():
    payload = _packb([1.1, [], None], single_float=True)
    assert payload[1] == 0xCA
    assert (
        parse_batch(payload).ts == struct.unpack(">f", payload[2:6])[0] == decode_batch(payload).ts
    )


def test_importing_kv_events_does_not_load_numba():
    code = (
        "import sys\n"
        "import dynamograph.protocol.kv_events as k\n"
        "assert k.parse_batch(k.encode_batch(k.EventBatch(0.0, []))) is None\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
