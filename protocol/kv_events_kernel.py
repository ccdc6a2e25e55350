"""The compiled reader behind `kv_events.parse_batch`: one vLLM KV-event batch read straight
into flat numpy arrays, instead of the Python lists and ints `msgpack.unpackb` builds (which the
index then turns back into arrays).

`read_batch(payload, hashes, tokens, meta)` walks `[ts, [event, ...], dp_rank, ...]` with the
events in either of vLLM's event layouts (`kv_events.ARRAY`, `kv_events.MAP`), even mixed: a
tagged array, `["BlockStored", block_hashes, parent, token_ids, block_size, lora_id?, medium?,
lora_name?, ...]`, `["BlockRemoved", block_hashes, medium?, ...]` or `["AllBlocksCleared",
...]`; or a map of the same fields by name, tagged by `type` (`{"type": "BlockStored",
"block_hashes": ...}`), its keys in any order, `lora_id`, `medium` and `lora_name` optional,
keys it does not know (what newer vLLMs add) skipped. One walker (`_event`) reads both: a
field is known by its key in a map, by its place after the tag in an array (`_ORDER`). It
appends every event's engine hashes to `hashes` (their 64-bit patterns), its token ids to
`tokens` (u32, as the block hasher reads them) and writes one row of `meta` per event (the
columns and codes are `kv_events`'s, which turns the rows into events); it returns (events,
ts kind, ts offset, dp_rank kind, dp_rank).

It reads only what it can turn into exactly the objects `msgpack.unpackb` + `decode_batch`
would give (see `kv_events.parse_batch`): ints of every width, nil, float32/64 (the timestamp),
arrays, maps keyed by strings, strings (tags, keys, medium, lora_name; ASCII only, so no UTF-8
to validate), and — in what the decoder ignores (an array event's trailing fields, a map event's
unknown keys, the batch's trailing fields) — also booleans, floats, bins, and arrays and maps of
those nested up to `SKIP_DEPTH` deep. Anything else (a map batch: `kv_events.MAP_BATCH`; bytes
hashes; ext types; a map event's key that is not an ASCII string or comes twice; token ids
outside u32; an event whose hashes mix negative ints with ints of 2^63 and more; malformed or
truncated data; bytes after the batch) returns `NOT_MINE`, and the caller decodes the payload
the ordinary way (which raises what it raises today). Imported only by `kv_events.warm_up()`
(it imports numba).
"""

import numba
import numpy as np
from numba import types

from .kv_events import (
    BLOCK_SIZE,
    CLEARED,
    HASH_END,
    HASH_START,
    INT,
    KIND,
    LORA,
    LORA_NAME,
    LORA_NAME_END,
    LORA_NAME_START,
    LORA_VALUE,
    MEDIUM,
    MEDIUM_ABSENT,
    MEDIUM_END,
    MEDIUM_IS_GPU,
    MEDIUM_NIL,
    MEDIUM_START,
    MEDIUM_TEXT,
    NONE,
    NOT_MINE,
    PARENT,
    PARENT_VALUE,
    REMOVED,
    SIGNED,
    STORED,
    TEXT,
    TOKEN_END,
    TOKEN_START,
    TS_F32,
    TS_F64,
    UNSIGNED,
)

SKIP_DEPTH = 16  # msgpack-python refuses nesting past 1,024; we leave anything deep to it

SIGNATURE = types.Tuple((types.int64,) * 5)(
    # the payload itself: numba types a bytes object ~1 µs faster than a read-only array of it
    types.Bytes(types.uint8, 1, "C", readonly=True),
    types.Array(types.uint64, 1, "C"),
    types.Array(types.uint32, 1, "C"),
    types.Array(types.int64, 2, "C"),
)

# what `_head` found
_UINT, _SINT, _NIL, _BOOL, _FLOAT32, _FLOAT64, _STR, _BIN, _ARRAY, _MAP, _OTHER = range(11)
_BAD = -1  # truncated
_TOP = np.uint64(1 << 63)
_U32_MAX = np.uint64(0xFFFFFFFF)
_TAG_STORED = np.frombuffer(b"BlockStored", np.uint8)
_TAG_REMOVED = np.frombuffer(b"BlockRemoved", np.uint8)
_TAG_CLEARED = np.frombuffer(b"AllBlocksCleared", np.uint8)
_GPU = np.frombuffer(b"GPU", np.uint8)

# An event's fields, by their key in a map event (`_NAMES`, indexed by field) or their place
# after the tag in an array event (`_ORDER`); bits of the masks below. _F_OTHER: what the
# decoder drops (unknown keys, trailing fields, fields the event's kind does not have).
_F_TYPE, _F_HASHES, _F_PARENT, _F_TOKENS, _F_SIZE, _F_LORA, _F_MEDIUM, _F_LORA_NAME = range(8)
_F_OTHER = 8
_NAMES = (
    b"type", b"block_hashes", b"parent_block_hash", b"token_ids", b"block_size", b"lora_id",
    b"medium", b"lora_name",
)  # fmt: skip
_KEYS = np.array([list(name.ljust(max(map(len, _NAMES)), b"\0")) for name in _NAMES], np.uint8)
_LENGTHS = np.array([len(name) for name in _NAMES], np.int64)
_UNKNOWN = 0  # no KIND: a tag the decoder does not know
_STORED_FIELDS = (_F_HASHES, _F_PARENT, _F_TOKENS, _F_SIZE, _F_LORA, _F_MEDIUM, _F_LORA_NAME)
_REMOVED_FIELDS = (_F_HASHES, _F_MEDIUM)
_ORDER = np.full((4, len(_STORED_FIELDS) + 1), _F_OTHER, np.int64)  # [KIND, place - 1]
_ORDER[STORED, : len(_STORED_FIELDS)] = _STORED_FIELDS
_ORDER[REMOVED, : len(_REMOVED_FIELDS)] = _REMOVED_FIELDS
_HAS = np.zeros(4, np.int64)  # [KIND]: the fields the decoder reads
_HAS[STORED] = sum(1 << f for f in _STORED_FIELDS)
_HAS[REMOVED] = sum(1 << f for f in _REMOVED_FIELDS)
_NEEDS = np.zeros(4, np.int64)  # [KIND]: the fields the decoder requires
_NEEDS[STORED] = sum(1 << f for f in (_F_HASHES, _F_PARENT, _F_TOKENS, _F_SIZE))
_NEEDS[REMOVED] = 1 << _F_HASHES

# Helpers are plain njit functions, called per event: numba-IR inlining all of them
# (`inline="always"`) made the first compile cost 87 s of CPU here. But a call passes the
# payload array, a reference count up and down each time, so what runs per int (`_int` and
# what it calls) is inlined: 2x faster, 13 s to compile the first time (0.3 s from the cache).
_helper = numba.njit(nogil=True)
_inline = numba.njit(nogil=True, inline="always")
_EIGHT = np.uint64(8)
# by size in bytes: what sign-extends a negative 1-, 2- or 4-byte int to 64 bits
_EXTEND = np.array([0, 2**64 - 2**8, 2**64 - 2**16, 0, 2**64 - 2**32], np.uint64)


@_inline
def _be(buf, pos, size):
    """The `size`-byte (1, 2, 4 or 8) big-endian unsigned int at `pos` (the caller checked the
    bounds). Unrolled: a loop over `size` bytes made reading token ids ~2x slower."""
    value = np.uint64(buf[pos])
    if size >= 2:
        value = (value << _EIGHT) | np.uint64(buf[pos + 1])
        if size >= 4:
            value = (value << _EIGHT) | np.uint64(buf[pos + 2])
            value = (value << _EIGHT) | np.uint64(buf[pos + 3])
            if size == 8:
                for i in range(4, 8):
                    value = (value << _EIGHT) | np.uint64(buf[pos + i])
    return value


@_inline
def _number(buf, pos, size, kind):
    """(kind, the int's bits, position after it) for a `size`-byte int at `pos`."""
    if pos + size > len(buf):
        return _BAD, np.uint64(0), pos
    value = _be(buf, pos, size)
    if kind == _SINT and size < 8 and value >> np.uint64(8 * size - 1):
        value |= _EXTEND[size]
    return kind, value, pos + size


@_inline
def _int(buf, pos):
    """`_head` of an int (_UINT or _SINT, its 64-bit pattern, the position after it); _OTHER
    (position unchanged) for anything else, _BAD past the end."""
    if pos >= len(buf):
        return _BAD, np.uint64(0), pos
    b = buf[pos]
    if b <= 0x7F:
        return _UINT, np.uint64(b), pos + 1
    if b >= 0xE0:
        return _SINT, np.uint64(b) | _EXTEND[1], pos + 1
    if 0xCC <= b <= 0xCF:
        return _number(buf, pos + 1, 1 << (b - 0xCC), _UINT)
    if 0xD0 <= b <= 0xD3:
        return _number(buf, pos + 1, 1 << (b - 0xD0), _SINT)
    return _OTHER, np.uint64(0), pos


@_helper
def _head(buf, pos):
    """(what, value, position after the header) of the msgpack object at `pos`. value: an int's
    64-bit pattern (the data read), a float's bits, the byte length of a str or bin (its bytes
    follow, unchecked), an array's element count, a map's pair count."""
    what, value, after = _int(buf, pos)
    if what != _OTHER:
        return what, value, after
    b = buf[pos]
    pos += 1
    if 0x90 <= b <= 0x9F:
        return _ARRAY, np.uint64(b & 0x0F), pos
    if 0xA0 <= b <= 0xBF:
        return _STR, np.uint64(b & 0x1F), pos
    if b == 0xC0:
        return _NIL, np.uint64(0), pos
    if b == 0xC2 or b == 0xC3:
        return _BOOL, np.uint64(b - 0xC2), pos
    if b == 0xCA:
        what, value, pos = _number(buf, pos, 4, _UINT)
        return (_FLOAT32 if what != _BAD else _BAD), value, pos
    if b == 0xCB:
        what, value, pos = _number(buf, pos, 8, _UINT)
        return (_FLOAT64 if what != _BAD else _BAD), value, pos
    if 0xD9 <= b <= 0xDB:
        what, value, pos = _number(buf, pos, 1 << (b - 0xD9), _UINT)
        return (_STR if what != _BAD else _BAD), value, pos
    if 0xC4 <= b <= 0xC6:
        what, value, pos = _number(buf, pos, 1 << (b - 0xC4), _UINT)
        return (_BIN if what != _BAD else _BAD), value, pos
    if b == 0xDC or b == 0xDD:
        what, value, pos = _number(buf, pos, 2 if b == 0xDC else 4, _UINT)
        return (_ARRAY if what != _BAD else _BAD), value, pos
    if 0x80 <= b <= 0x8F:
        return _MAP, np.uint64(b & 0x0F), pos
    if b == 0xDE or b == 0xDF:
        what, value, pos = _number(buf, pos, 2 if b == 0xDE else 4, _UINT)
        return (_MAP if what != _BAD else _BAD), value, pos
    return _OTHER, np.uint64(0), pos  # ext types, 0xc1 (never used)


@_helper
def _ascii(buf, start, length):
    """The `length` bytes at `start` are in the payload and ASCII (valid UTF-8 as they are)."""
    end = start + length
    if end > len(buf):
        return False
    while start < end and buf[start] < 0x80:
        start += 1
    return start == end


@_helper
def _equals(buf, start, length, text):
    if length != text.shape[0] or start + length > len(buf):
        return False
    i = 0
    while i < length and buf[start + i] == text[i]:
        i += 1
    return i == length


@_helper
def _small_int(what, value):
    """An int within int64 (which the caller keeps in an int64 cell)."""
    return what == _SINT or (what == _UINT and value < _TOP)


@numba.njit(nogil=True)
def _ints(buf, pos, out, start, top):
    """An array of ints at `pos` appended to `out` from `start`: (position after it, end in
    `out`, whether one was negative, whether one was ≥ 2^63); position -1 when it is not an
    array of ints, does not fit `out`, or holds an int above `top` or (top < 2^63) below 0."""
    what, count, pos = _head(buf, pos)
    end = start + np.int64(count)
    if what != _ARRAY or end > out.shape[0]:
        return -1, start, False, False
    negative = high = False
    size = len(buf)
    for i in range(start, end):
        # token ids and engine hashes are unsigned: read those here, the rest through `_int`
        # (the general reader made this loop ~2x slower per token)
        b = buf[pos] if pos < size else 0xC1
        if b <= 0x7F:
            value, pos = np.uint64(b), pos + 1
        elif 0xCC <= b <= 0xCF and pos + 1 + (1 << (b - 0xCC)) <= size:
            width = 1 << (b - 0xCC)
            value, pos = _be(buf, pos + 1, width), pos + 1 + width
        else:
            what, value, pos = _int(buf, pos)
            if what == _SINT and value >= _TOP:
                negative = True
                if top < _TOP:
                    return -1, start, False, False
                out[i] = value
                continue
            if what != _UINT and what != _SINT:
                return -1, start, False, False
        if value > top:
            return -1, start, False, False
        if value >= _TOP:
            high = True
        out[i] = value
    return pos, end, negative, high


@numba.njit(nogil=True)
def _skip(buf, pos, count):
    """Past `count` objects at `pos` that the decoder reads and drops: scalars, ASCII strings,
    bins, and arrays and maps of them up to `SKIP_DEPTH` deep, the maps keyed by scalars or
    strings (what a dict takes); -1 at anything else."""
    # per open array or map: objects still to skip (a map's keys and values), whether a map
    left = np.empty((SKIP_DEPTH + 1, 2), np.int64)
    depth = 0
    left[0, 0], left[0, 1] = count, False
    while True:
        while left[depth, 0] == 0:
            if depth == 0:
                return pos
            depth -= 1
        key = left[depth, 1] != 0 and left[depth, 0] % 2 == 0
        left[depth, 0] -= 1
        what, value, pos = _head(buf, pos)
        if what in (_ARRAY, _MAP):
            if key or depth == SKIP_DEPTH:  # an array or map key: unhashable for the decoder
                return -1
            depth += 1
            left[depth, 0] = np.int64(value) * (2 if what == _MAP else 1)
            left[depth, 1] = what == _MAP
        elif what in (_STR, _BIN):
            size = np.int64(value)
            if pos + size > len(buf) or (what == _STR and not _ascii(buf, pos, size)):
                return -1
            pos += size
        elif what < _UINT or what > _FLOAT64:  # not a scalar (ints, nil, bool, floats)
            return -1


@numba.njit(nogil=True)
def _medium(buf, pos, row):
    """The medium field at `pos` into meta `row`; the position after it, -1 if not nil/ASCII."""
    what, length, pos = _head(buf, pos)
    if what == _NIL:
        row[MEDIUM] = MEDIUM_NIL
        return pos
    size = np.int64(length)
    if what != _STR or not _ascii(buf, pos, size):
        return -1
    row[MEDIUM] = MEDIUM_IS_GPU if _equals(buf, pos, size, _GPU) else MEDIUM_TEXT
    row[MEDIUM_START], row[MEDIUM_END] = pos, pos + size
    return pos + size


@numba.njit(nogil=True)
def _lora_name(buf, pos, row):
    """The lora_name field at `pos` into meta `row`; the position after it, -1 for a string
    that is not ASCII (UTF-8 the decoder checks). What is not a string the decoder ignores."""
    what, length, end = _head(buf, pos)
    if what != _STR:
        row[LORA_NAME] = NONE
        return _skip(buf, pos, 1)
    size = np.int64(length)
    if not _ascii(buf, end, size):
        return -1
    row[LORA_NAME], row[LORA_NAME_START], row[LORA_NAME_END] = TEXT, end, end + size
    return end + size


@_helper
def _tag(buf, pos):
    """(the KIND the event tag at `pos` names, the position after it); _UNKNOWN if none."""
    what, value, pos = _head(buf, pos)
    size = np.int64(value)
    if what != _STR:
        return _UNKNOWN, pos
    if _equals(buf, pos, size, _TAG_STORED):
        return STORED, pos + size
    if _equals(buf, pos, size, _TAG_REMOVED):
        return REMOVED, pos + size
    if _equals(buf, pos, size, _TAG_CLEARED):
        return CLEARED, pos + size
    return _UNKNOWN, pos


@_helper
def _key(buf, pos):
    """(the field a map event's key at `pos` names, or _F_OTHER; the position after it);
    position -1 for a key that is not an ASCII string (UTF-8 to check, or a key to compare as
    Python would: vLLM sends neither)."""
    what, value, pos = _head(buf, pos)
    size = np.int64(value)
    if what != _STR or not _ascii(buf, pos, size):
        return _F_OTHER, -1
    for field in range(_LENGTHS.shape[0]):  # a length compare rules out all but one or two
        if _LENGTHS[field] == size and _equals(buf, pos, size, _KEYS[field, :size]):
            return field, pos + size
    return _F_OTHER, pos + size


@numba.njit(nogil=True)
def _field(buf, pos, field, row, hashes, nh, tokens, nt):
    """The value of an event's `field` (not _F_TYPE) at `pos` into `row`, its ints appended to
    `hashes` from `nh` or `tokens` from `nt`: (position after it, hashes and tokens used);
    position -1 when the decoder must read it."""
    if field == _F_OTHER:
        return _skip(buf, pos, 1), nh, nt
    if field == _F_MEDIUM:
        return _medium(buf, pos, row), nh, nt
    if field == _F_LORA_NAME:
        return _lora_name(buf, pos, row), nh, nt
    if field == _F_HASHES:
        pos, end, negative, high = _ints(buf, pos, hashes, nh, ~np.uint64(0))
        if pos < 0 or (negative and high):  # no one dtype holds both as the decoder's ints
            return -1, nh, nt
        row[HASH_START], row[HASH_END], row[SIGNED] = nh, end, negative
        return pos, end, nt
    if field == _F_TOKENS:
        pos, end, _, _ = _ints(buf, pos, tokens, nt, _U32_MAX)
        if pos < 0:
            return -1, nh, nt
        row[TOKEN_START], row[TOKEN_END] = nt, end
        return pos, nh, end
    what, value, pos = _head(buf, pos)  # parent, block size, lora id: ints (but the size) or nil
    if field == _F_PARENT:
        if what == _NIL:
            row[PARENT] = NONE
        elif what == _UINT:
            row[PARENT] = UNSIGNED
        elif what == _SINT:
            row[PARENT] = INT
        else:
            return -1, nh, nt
        row[PARENT_VALUE] = np.int64(value)
    elif field == _F_LORA and what == _NIL:
        row[LORA] = NONE
    elif not _small_int(what, value):
        return -1, nh, nt
    elif field == _F_LORA:
        row[LORA], row[LORA_VALUE] = INT, np.int64(value)
    else:
        row[BLOCK_SIZE] = np.int64(value)
    return pos, nh, nt


@numba.njit(nogil=True)
def _event(buf, pos, row, hashes, nh, tokens, nt):
    """The event at `pos`, a tagged array or a `type`-tagged map, into meta `row`: (position
    after it, hashes and tokens used); position -1 when the decoder must read it."""
    what, value, pos = _head(buf, pos)
    if what not in (_ARRAY, _MAP):
        return -1, nh, nt
    is_map = what == _MAP
    kind, seen = _UNKNOWN, 0
    row[LORA], row[MEDIUM], row[LORA_NAME] = NONE, MEDIUM_ABSENT, NONE  # omitted fields'
    for place in range(np.int64(value)):
        if is_map:
            field, pos = _key(buf, pos)
            if pos < 0:
                return -1, nh, nt
        elif place == 0:
            field = _F_TYPE
        else:
            field = _ORDER[kind, min(place - 1, _ORDER.shape[1] - 1)]
        if field != _F_OTHER:
            if seen >> field & 1:  # a map's key twice: the decoder keeps the last
                return -1, nh, nt
            seen |= 1 << field
        if field == _F_TYPE:
            kind, pos = _tag(buf, pos)
            if kind == _UNKNOWN:
                return -1, nh, nt
        else:
            if kind != _UNKNOWN and not _HAS[kind] >> field & 1:
                field = _F_OTHER  # a map key of another kind of event (an array has none)
            pos, nh, nt = _field(buf, pos, field, row, hashes, nh, tokens, nt)
            if pos < 0:
                return -1, nh, nt
    # a map may name its type after the fields: those of another kind were read, and are unused
    if kind == _UNKNOWN or seen & _NEEDS[kind] != _NEEDS[kind]:
        return -1, nh, nt
    row[KIND] = kind
    return pos, nh, nt


@numba.njit(nogil=True)
def read_batch(buf, hashes, tokens, meta):  # typed by SIGNATURE (kv_events: _ReadBatch)
    """See the module docstring: (events, ts kind, ts offset, dp kind, dp_rank) or NOT_MINE."""
    mine = (NOT_MINE, 0, 0, 0, 0)
    what, value, pos = _head(buf, 0)
    items = np.int64(value)
    if what != _ARRAY or items < 2:
        return mine
    what, _, after = _head(buf, pos)
    if what != _FLOAT64 and what != _FLOAT32:
        return mine
    ts_kind, ts_at = (TS_F64 if what == _FLOAT64 else TS_F32), pos + 1
    what, count, pos = _head(buf, after)
    events = np.int64(count)
    if what != _ARRAY or events > meta.shape[0]:
        return mine
    nh = nt = 0
    for e in range(events):
        pos, nh, nt = _event(buf, pos, meta[e], hashes, nh, tokens, nt)
        if pos < 0:
            return mine
    dp_kind, dp = NONE, np.int64(0)
    if items >= 3:
        what, value, pos = _head(buf, pos)
        if what != _NIL:
            if not _small_int(what, value):
                return mine
            dp_kind, dp = INT, np.int64(value)
        if items > 3:
            pos = _skip(buf, pos, items - 3)
    if pos != len(buf):  # bytes after the batch (unpackb: ExtraData), or -1
        return mine
    return events, ts_kind, ts_at, dp_kind, dp
