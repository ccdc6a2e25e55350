"""The router core's hot loops, compiled with numba: hash-table probes, holder bitmasks, and the
three things the index does per message — store an event's blocks, remove them, and walk a
query's prefix (`find_matches`); the active requests' counts of booked prefix keys
(`count_up`, `count_down`, `held_prefix`, on a slot's `U64Table`); and the scheduler's
tie-break (`least_of`).

Everything here works on the flat numpy arrays that `table.U64Table`, `holders.Holders` and
`index.KvIndex` own; those classes allocate and grow the arrays (in Python, rarely) and make
room *before* calling a kernel, so a kernel never allocates index storage: it only reads and
writes cells and the small int64 counter arrays (`meta`) next to them.

Tables (`U64Table`): open addressing with linear probing over `keys` (uint64) and `vals`
(int32); `meta = [live, used, shift, limit]`. A key's home cell is the top bits of key · 2^64/φ
(Fibonacci hashing). Keys 0 and 1 are reserved (EMPTY, TOMB): callers' keys are clamped to ≥ 2.
A lookup stops at the first EMPTY cell; a deletion leaves a tombstone (counted in `used` until
the next rebuild).

Rows (`KvIndex`): a block (prefix key) is a row of the index, and its row number is its cell in
the key table (`gk`, `gv`): the key is gk[row], and gv[row] says which slots hold it — the one
slot column (≥ 0), NOBODY (-1), or, once two slots hold the row, -1 - s for bitmask row s ≥ 1
of the matrix `shared` (one bit per slot column; `Holders`, whose `hmeta[0]` counts the free
bitmask rows on the stack `sfree`). The slots' tables map engine hashes to rows; when the key
table is rebuilt its rows move, and the slots' tables are renumbered (`renumber`).

Prefix keys chain the per-block hashes: key_i = P · key_{i-1} + h_i (mod 2^64), key_{-1} = 0.

Each kernel is compiled for one signature (declared next to it) by `warm_up()`, which the
index's tables call before their first use; compiled code is cached on disk when numba can
write a cache (it runs uncached, silently, when it cannot).
"""

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
from numba.core.dispatcher import Dispatcher
from numba.cpython.unsafe.numbers import trailing_zeros
from numpy.typing import NDArray

from dynamograph.protocol import hashing, kv_events
from dynamograph.protocol.compiled import compile_ahead
from dynamograph.protocol.kv_events import (
    BLOCK_SIZE,
    HASH_END,
    HASH_START,
    KIND,
    LORA,
    LORA_NAME,
    LORA_VALUE,
    NONE,
    PARENT,
    PARENT_VALUE,
    REMOVED,
    TOKEN_END,
    TOKEN_START,
)
from dynamograph.protocol.kv_events import STORED as _STORED_ROW
from dynamograph.protocol.xxh3_kernel import block_hash

EMPTY = np.uint64(0)
TOMB = np.uint64(1)
MIN_KEY = np.uint64(2)
MISSING = -1
NOBODY = -1
LIVE, USED, SHIFT, LIMIT = 0, 1, 2, 3  # a table's meta: LIMIT = cells usable before a rebuild
STORED, NO_PARENT, NO_ROOM = 1, 0, -1  # store_blocks' results (NO_ROOM: count_up's too)
UNSUPPORTED = -2  # apply_rows: a row left to the caller
P = np.uint64(0xC2B2AE3D27D4EB4F)  # odd, so chaining is a bijection of the running key
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)
_LOW6 = np.uint64(63)

_KERNELS: list[tuple[Dispatcher, str]] = []
_META = np.array([0, 0, 61, 6], np.int64)  # an empty 8-cell table's, for the warm-up call
_warm = False
_warm_lock = threading.Lock()

_U8 = "u8[::1]"
_I4 = "i4[::1]"
_I8 = "i8[::1]"
_TABLE = f"{_U8}, {_I4}, {_I8}"
_HOLDERS = f"u8[:, ::1], {_I4}, {_I8}"


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _kernel(signature: str) -> Callable[[_Fn], _Fn]:
    """A compiled entry point for `signature` (compiled by `warm_up`, never for other types)."""

    def wrap(fn: _Fn) -> _Fn:
        disp = numba.njit(nogil=True)(fn)
        _KERNELS.append((disp, signature))
        return cast(_Fn, disp)  # the dispatcher is called as the function it compiles

    return wrap


_inline = numba.njit(nogil=True, inline="always")


def warm_up() -> None:
    """Compile (or load from numba's cache) every kernel for its signature, once per process;
    afterwards a call with other argument types fails instead of compiling again."""
    global _warm
    if _warm:
        return
    with _warm_lock:
        if _warm:
            return
        for disp, signature in _KERNELS:
            compile_ahead(disp, signature, "index")
        # the first call of any kernel sets numba's runtime up (~10 ms here): do it now
        table_get(np.full(1, MIN_KEY), np.zeros(8, np.uint64), np.zeros(8, np.int32), _META)
        # every process that routes also hashes prompts, and reads KV events when there are
        # any: the block-hash kernel and the event-batch parser come along
        hashing.warm_up()
        kv_events.warm_up()
        _warm = True


# -- hash tables ---------------------------------------------------------------------------
@_inline
def _home(key, meta):
    return np.intp((key * _GOLD) >> np.uint64(meta[SHIFT]))


@_inline
def _clamp(key):
    return key if key >= MIN_KEY else MIN_KEY


@_inline
def _cell(tk, meta, key):
    """The cell holding `key`, or MISSING."""
    mask = tk.size - 1
    i = _home(key, meta)
    while True:
        k = tk[i]
        if k == key:
            return i
        if k == EMPTY:
            return MISSING
        i = (i + 1) & mask


@_inline
def _find(tk, tv, meta, key):
    """The value of `key`, or MISSING."""
    cell = _cell(tk, meta, key)
    return tv[cell] if cell != MISSING else MISSING


@_inline
def _probe(tk, meta, key):
    """The cell holding `key`, or -1 - the cell where it would go (the first tombstone on its
    probe path, else the EMPTY cell that ended it)."""
    mask = tk.size - 1
    i = _home(key, meta)
    free = -1
    while True:
        k = tk[i]
        if k == key:
            return i
        if k == EMPTY:
            return -1 - (free if free >= 0 else i)
        if k == TOMB and free < 0:
            free = i
        i = (i + 1) & mask


@_inline
def _place(tk, tv, meta, cell, key, val):
    """Put an absent `key` in the cell `_probe` named (the table has room)."""
    if tk[cell] == EMPTY:
        meta[USED] += 1
    tk[cell] = key
    tv[cell] = val
    meta[LIVE] += 1


@_inline
def _upsert(tk, tv, meta, key, val):
    """Set `key` to `val` (the table has room); the previous value, or MISSING."""
    cell = _probe(tk, meta, key)
    if cell >= 0:
        old = tv[cell]
        tv[cell] = val
        return old
    _place(tk, tv, meta, -1 - cell, key, val)
    return MISSING


@_inline
def _room(meta, n):
    return meta[USED] + n <= meta[LIMIT]


@_inline
def _delete(tk, tv, meta, key):
    """Remove `key`; its value, or MISSING."""
    cell = _cell(tk, meta, key)
    if cell == MISSING:
        return MISSING
    tk[cell] = TOMB
    meta[LIVE] -= 1
    return tv[cell]


@_kernel(f"i4[::1]({_U8}, {_TABLE})")
def table_get(
    keys: NDArray[np.uint64], tk: NDArray[np.uint64], tv: NDArray[np.int32], meta: NDArray[np.int64]
) -> NDArray[np.int32]:
    out = np.empty(keys.size, np.int32)
    for j in range(keys.size):
        out[j] = _find(tk, tv, meta, keys[j])
    return out


@_kernel(f"i4[::1]({_U8}, {_I4}, {_TABLE})")
def table_put(
    keys: NDArray[np.uint64],
    vals: NDArray[np.int32],
    tk: NDArray[np.uint64],
    tv: NDArray[np.int32],
    meta: NDArray[np.int64],
) -> NDArray[np.int32]:
    out = np.empty(keys.size, np.int32)
    for j in range(keys.size):
        out[j] = _upsert(tk, tv, meta, keys[j], vals[j])
    return out


@_kernel(f"i4[::1]({_U8}, {_TABLE})")
def table_pop(
    keys: NDArray[np.uint64], tk: NDArray[np.uint64], tv: NDArray[np.int32], meta: NDArray[np.int64]
) -> NDArray[np.int32]:
    out = np.empty(keys.size, np.int32)
    for j in range(keys.size):
        out[j] = _delete(tk, tv, meta, keys[j])
    return out


@_kernel(f"void({_U8}, {_I4}, {_TABLE})")
def table_rehash(
    old_keys: NDArray[np.uint64],
    old_vals: NDArray[np.int32],
    tk: NDArray[np.uint64],
    tv: NDArray[np.int32],
    meta: NDArray[np.int64],
) -> None:
    """Insert the live cells among (old_keys, old_vals) into an empty table."""
    for j in range(old_keys.size):
        if old_keys[j] >= MIN_KEY:
            _upsert(tk, tv, meta, old_keys[j], old_vals[j])


@_kernel(f"void({_U8}, {_I4}, {_I4}, {_I4}, {_TABLE})")
def table_rehash_moving(
    old_keys: NDArray[np.uint64],
    old_vals: NDArray[np.int32],
    old_cells: NDArray[np.int32],
    moved: NDArray[np.int32],
    tk: NDArray[np.uint64],
    tv: NDArray[np.int32],
    meta: NDArray[np.int64],
) -> None:
    """`table_rehash` of cells that are row numbers: moved[old_cells[j]] = the new cell."""
    for j in range(old_keys.size):
        cell = -1 - _probe(tk, meta, old_keys[j])
        _place(tk, tv, meta, cell, old_keys[j], old_vals[j])
        moved[old_cells[j]] = cell


@_kernel(f"void({_U8}, {_I4}, {_I4})")
def renumber(tk: NDArray[np.uint64], tv: NDArray[np.int32], moved: NDArray[np.int32]) -> None:
    """A table whose values are rows of a rebuilt table: each value v becomes moved[v]."""
    for i in range(tk.size):
        if tk[i] >= MIN_KEY:
            tv[i] = moved[tv[i]]


# -- reference counts (active requests' shared prompt blocks) -------------------------------
@_kernel(f"i8({_U8}, {_TABLE})")
def count_up(
    keys: NDArray[np.uint64], tk: NDArray[np.uint64], tv: NDArray[np.int32], meta: NDArray[np.int64]
) -> int:
    """Add a reference to each key; returns how many were new (values are counts), or NO_ROOM,
    changing nothing, when the table might not hold them all (reserve, then call again)."""
    if not _room(meta, keys.size):
        return NO_ROOM
    new = 0
    for j in range(keys.size):
        key = _clamp(keys[j])
        cell = _probe(tk, meta, key)
        if cell >= 0:
            tv[cell] += 1
        else:
            _place(tk, tv, meta, -1 - cell, key, 1)
            new += 1
    return new


@_kernel(f"i8({_U8}, {_TABLE})")
def count_down(
    keys: NDArray[np.uint64], tk: NDArray[np.uint64], tv: NDArray[np.int32], meta: NDArray[np.int64]
) -> int:
    """Drop a reference to each key (absent keys are skipped); a key whose count reaches zero
    leaves the table. Returns how many left."""
    gone = 0
    for j in range(keys.size):
        cell = _cell(tk, meta, _clamp(keys[j]))
        if cell == MISSING:
            continue
        if tv[cell] > 1:
            tv[cell] -= 1
        else:
            tk[cell] = TOMB
            meta[LIVE] -= 1
            gone += 1
    return gone


@_kernel(f"i8({_U8}, {_TABLE})")
def held_prefix(
    keys: NDArray[np.uint64], tk: NDArray[np.uint64], tv: NDArray[np.int32], meta: NDArray[np.int64]
) -> int:
    """How many leading `keys` the table holds, by bisection: the keys are a chain's prefix
    keys, and whoever holds key i holds every key before it, so the held ones are a prefix."""
    if keys.size == 0 or _cell(tk, meta, _clamp(keys[0])) == MISSING:
        return 0
    lo, hi = 1, keys.size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _cell(tk, meta, _clamp(keys[mid - 1])) != MISSING:
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- the scheduler's tie-breaks -----------------------------------------------------------
@_kernel("i8(i8[::1], f8[::1], i8[:], i8[:], i8[::1])")
def least_of(
    at: NDArray[np.int64],
    k1: NDArray[np.float64],
    k2: NDArray[np.int64],
    k3: NDArray[np.int64],
    out: NDArray[np.int64],
) -> int:
    """The positions among `at` whose (k1, k2, k3) is smallest, compared like tuples, written
    to `out` in `at`'s order; returns how many (ties: more than one)."""
    n = 0
    for j in range(at.size):
        p = at[j]
        if n > 0:
            b = out[0]
            if k1[p] > k1[b] or (
                k1[p] == k1[b] and (k2[p] > k2[b] or (k2[p] == k2[b] and k3[p] > k3[b]))
            ):
                continue
            if k1[p] == k1[b] and k2[p] == k2[b] and k3[p] == k3[b]:
                out[n] = p
                n += 1
                continue
        out[0] = p
        n = 1
    return n


# -- holders -------------------------------------------------------------------------------
@_inline
def _bit(column):
    return _ONE << (np.uint64(column) & _LOW6)


@_inline
def _hold(row, column, holder, shared, sfree, hmeta):
    """Add `column` to the row's holders (a free bitmask row is there when one is needed)."""
    h = holder[row]
    if h == column:
        return
    if h == NOBODY:
        holder[row] = column
    elif h < 0:
        shared[-1 - h, column >> 6] |= _bit(column)
    else:
        hmeta[0] -= 1
        s = sfree[hmeta[0]]
        shared[s, h >> 6] |= _bit(h)
        shared[s, column >> 6] |= _bit(column)
        holder[row] = -1 - s


@_inline
def _unhold(row, column, holder, shared, sfree, hmeta):
    """Take `column` off the row's holders; True when nobody holds the row any more."""
    h = holder[row]
    if h == column:
        holder[row] = NOBODY
        return True
    if h >= NOBODY:
        return False
    s = -1 - h
    shared[s, column >> 6] &= ~_bit(column)
    for w in range(shared.shape[1]):
        if shared[s, w]:
            return False
    holder[row] = NOBODY
    sfree[hmeta[0]] = s
    hmeta[0] += 1
    return True


# -- the index -----------------------------------------------------------------------------
@_inline
def _drop(row, column, gk, gv, gm, shared, sfree, hm):
    """Take `column` off `row`; a row nobody holds leaves the key table (its cell becomes a
    tombstone: the row number is free for a later key)."""
    if _unhold(row, column, gv, shared, sfree, hm):
        gk[row] = TOMB
        gm[LIVE] -= 1


@_kernel(f"{_U8}(u8, {_U8})")
def prefix_keys(parent: int | np.uint64, hashes: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """Prefix keys of `hashes` continuing the prefix whose key is `parent` (0: none), clamped."""
    out = np.empty(hashes.size, np.uint64)
    key = parent
    for i in range(hashes.size):
        key = key * P + hashes[i]
        out[i] = _clamp(key)
    return out


@_inline
def _store(engine, local, keys, first, n, parent, has_parent, column, sk, sv, sm, gk, gv, gm,
           shared, sfree, hm):  # fmt: skip
    """`store_blocks` over entries first..first+n of `engine`, `local` and `keys` (`local[i]` is
    read before `keys[i]` is written: they may be one array)."""
    if not (_room(sm, n) and _room(gm, n) and hm[0] >= n):
        return NO_ROOM
    key = np.uint64(0)
    if has_parent:
        prow = _find(sk, sv, sm, _clamp(parent))
        if prow == MISSING:
            return NO_PARENT
        key = gk[prow]
    for i in range(first, first + n):
        key = key * P + local[i]
        k = _clamp(key)
        keys[i] = k
        row = _probe(gk, gm, k)
        if row < 0:  # a new key: its cell is its row
            row = -1 - row
            _place(gk, gv, gm, row, k, NOBODY)
        old = _upsert(sk, sv, sm, _clamp(engine[i]), row)
        if old != MISSING and old != row:  # an engine hash reused for other content
            _drop(old, column, gk, gv, gm, shared, sfree, hm)
        _hold(row, column, gv, shared, sfree, hm)
    return STORED


@_inline
def _remove(engine, first, n, column, sk, sv, sm, gk, gv, gm, shared, sfree, hm):
    """`remove_blocks` over entries first..first+n of `engine`."""
    removed = 0
    for i in range(first, first + n):
        row = _delete(sk, sv, sm, _clamp(engine[i]))
        if row != MISSING:
            removed += 1
            _drop(row, column, gk, gv, gm, shared, sfree, hm)
    return removed


@_kernel(f"i8({_U8}, {_U8}, u8, b1, i8, {_U8}, {_TABLE}, {_TABLE}, {_HOLDERS})")
def store_blocks(
    engine: NDArray[np.uint64],
    local: NDArray[np.uint64],
    parent: int | np.uint64,
    has_parent: bool,
    column: int,
    keys: NDArray[np.uint64],
    sk: NDArray[np.uint64],
    sv: NDArray[np.int32],
    sm: NDArray[np.int64],
    gk: NDArray[np.uint64],
    gv: NDArray[np.int32],
    gm: NDArray[np.int64],
    shared: NDArray[np.uint64],
    sfree: NDArray[np.int32],
    hm: NDArray[np.int64],
) -> int:
    """A BlockStored on the slot whose engine-hash table is (sk, sv, sm) and bit is `column`:
    block i has engine hash engine[i] and our hash local[i]; its parent is the slot's block
    with engine hash `parent` when `has_parent`. Each block's prefix key goes to `keys[i]` (what
    the prefills waiting on the slot look for). Returns STORED; NO_PARENT (nothing stored)
    when the slot does not hold the parent; NO_ROOM (nothing done) when a table or the free
    bitmask rows could run out: the caller makes room and calls again."""
    return _store(
        engine, local, keys, 0, engine.size, parent, has_parent, column, sk, sv, sm, gk, gv, gm,
        shared, sfree, hm,
    )  # fmt: skip


@_kernel(f"i8({_U8}, i8, {_TABLE}, {_TABLE}, {_HOLDERS})")
def remove_blocks(
    engine: NDArray[np.uint64],
    column: int,
    sk: NDArray[np.uint64],
    sv: NDArray[np.int32],
    sm: NDArray[np.int64],
    gk: NDArray[np.uint64],
    gv: NDArray[np.int32],
    gm: NDArray[np.int64],
    shared: NDArray[np.uint64],
    sfree: NDArray[np.int32],
    hm: NDArray[np.int64],
) -> int:
    """A BlockRemoved on the slot: each engine hash it holds goes; returns how many did."""
    return _remove(engine, 0, engine.size, column, sk, sv, sm, gk, gv, gm, shared, sfree, hm)


_ROW = "i8[:, ::1]"
_XXH3 = f"i8, {_I8}, {_U8}, {_U8}, u8"  # block size and `hashing.kernel_constants` of it


@_kernel(
    f"i8(i8, {_ROW}, {_U8}, u4[::1], {_XXH3}, i8, {_U8}, {_I8}, {_TABLE}, {_TABLE}, {_HOLDERS})"
)
def apply_rows(
    first: int,
    meta: NDArray[np.int64],
    engine: NDArray[np.uint64],
    tokens: NDArray[np.uint32],
    block_size: int,
    offsets: NDArray[np.int64],
    low: NDArray[np.uint64],
    high: NDArray[np.uint64],
    start: np.uint64,
    column: int,
    keys: NDArray[np.uint64],
    codes: NDArray[np.int64],
    sk: NDArray[np.uint64],
    sv: NDArray[np.int32],
    sm: NDArray[np.int64],
    gk: NDArray[np.uint64],
    gv: NDArray[np.int32],
    gm: NDArray[np.int64],
    shared: NDArray[np.uint64],
    sfree: NDArray[np.int32],
    hm: NDArray[np.int64],
) -> int:
    """The events of a batch as the compiled parser read them (`kv_events.ParsedBatch`: rows
    of `meta` over `engine` and `tokens`), applied in order from row `first` on the slot, each
    as `store_blocks` / `remove_blocks` would, the blocks hashed here (XXH3 with the constants
    of `block_size`). A stored row's prefix keys go to `keys` at its hashes' places and its
    result to `codes[row]` (STORED or NO_PARENT; 0 for the rest). Stops at the first row it
    leaves to the caller, marked in `codes`: NO_ROOM (nothing of it done: make room, call
    again from it), or UNSUPPORTED (an AllBlocksCleared; blocks of a LoRA adapter, of another
    block size, or whose count disagrees with the tokens: apply it the ordinary way, then go
    on from the next row). Returns that row, or the number of rows when all were applied."""
    for r in range(first, meta.shape[0]):
        codes[r] = 0
        kind = meta[r, KIND]
        at, n = meta[r, HASH_START], meta[r, HASH_END] - meta[r, HASH_START]
        if kind == REMOVED:
            _remove(engine, at, n, column, sk, sv, sm, gk, gv, gm, shared, sfree, hm)
            continue
        tokens_at = meta[r, TOKEN_START]
        if (
            kind != _STORED_ROW
            or meta[r, BLOCK_SIZE] != block_size
            or (meta[r, TOKEN_END] - tokens_at) // block_size != n
            or (meta[r, LORA] != NONE and meta[r, LORA_VALUE] != 0)
            or meta[r, LORA_NAME] != NONE
        ):
            codes[r] = UNSUPPORTED
            return r
        if n == 0:
            continue
        for i in range(n):
            keys[at + i] = block_hash(tokens, tokens_at + i * block_size, offsets, low, high, start)
        parent = np.uint64(meta[r, PARENT_VALUE])  # its 64 bits, signed or not
        code = _store(
            engine, keys, keys, at, n, parent, meta[r, PARENT] != NONE, column, sk, sv, sm, gk,
            gv, gm, shared, sfree, hm,
        )  # fmt: skip
        codes[r] = code
        if code == NO_ROOM:
            return r
    return meta.shape[0]


@_inline
def _emit(dropped, word, depth, out, nout):
    """Record (column, depth) for every bit of `dropped` (when depth > 0)."""
    if depth == 0:
        return nout
    while dropped:
        low = dropped & (~dropped + _ONE)
        # numba supplies an intrinsic's typing context itself: called with the operand only
        out[2 * nout] = word * 64 + np.int64(trailing_zeros(low))  # type: ignore[call-arg]
        out[2 * nout + 1] = depth
        nout += 1
        dropped ^= low
    return nout


@_kernel(f"Tuple((b1, u8, i8))({_U8}, i8, u8, b1, {_U8}, {_I8}, i8, {_TABLE}, u8[:, ::1])")
def match_prefix(
    hashes: NDArray[np.uint64],
    depth: int,
    key: int,
    last: bool,
    alive: NDArray[np.uint64],
    out: NDArray[np.int64],
    nout: int,
    gk: NDArray[np.uint64],
    gv: NDArray[np.int32],
    gm: NDArray[np.int64],
    shared: NDArray[np.uint64],
) -> tuple[bool, int, int]:
    """One stage of `find_matches`: hashes are the query's blocks from `depth` on, `key` the
    prefix key before them, `alive` the bitmask of slots holding every block so far (set to all
    ones at depth 0). Each slot's bit is ANDed with the holders of each block in turn; when
    it drops at depth d the slot held d blocks contiguously: (column, d) goes to `out` (pairs,
    `nout` of them). Stops at the first block nobody holds. Returns (done, key, nout); when not
    done (the stage ran out with slots alive and it was not the `last`), call again with the
    next stage."""
    words = alive.size
    if depth == 0:
        alive[:] = ~np.uint64(0)
    for i in range(hashes.size):
        key = key * P + hashes[i]
        row = _cell(gk, gm, _clamp(key))
        d = depth + i
        if row == MISSING:
            for w in range(words):
                nout = _emit(alive[w], w, d, out, nout)
            return True, key, nout
        h = gv[row]
        left = False
        for w in range(words):
            a = alive[w]
            if a == 0:
                continue
            if h >= 0:  # one holder
                m = _bit(h) if (h >> 6) == w else np.uint64(0)
            elif h == NOBODY:
                m = np.uint64(0)
            else:
                m = shared[-1 - h, w]
            nout = _emit(a & ~m, w, d, out, nout)
            a &= m
            alive[w] = a
            left = left or a != 0
        if not left:
            return True, key, nout
    if last:
        for w in range(words):
            nout = _emit(alive[w], w, depth + hashes.size, out, nout)
        return True, key, nout
    return False, key, nout
