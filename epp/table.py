"""A flat uint64 → int32 hash table on numpy arrays: whole-batch (vectorized) operations for many
keys, and scalar ones (through memoryviews of the same arrays) for one key at a time.

Why not a dict: the KV index holds tens of millions of entries (256 workers × 100k blocks); a
Python dict spends ~100 bytes per int → int entry, these arrays ~20. Lookups of a whole request
(hundreds of keys) run as a few numpy operations instead of a Python loop, while a single key
costs no more than a dict lookup (a numpy call costs a microsecond before doing anything).

Layout: `nb` buckets (a power of two) of `B` = 8 keys each (one 64-byte cache line), linear
probing from bucket to bucket. A key's home bucket comes from Fibonacci hashing of the key. Key
values 0 and 1 are reserved (EMPTY, TOMBSTONE): callers pass keys ≥ 2. A lookup stops at the
first bucket that still has an EMPTY cell; deletions leave tombstones (so probe chains stay
intact) and the table is rebuilt when live + dead cells pass `max_load` of the capacity.
Inserts always take the first free cell of a bucket, so within a bucket no key follows an EMPTY
cell: a scalar scan may stop at the first EMPTY it meets.

Batch operations look at every key's home bucket in one gather (at the tables' loads most keys
are found, or can be placed, there) and finish the few others one by one or in further rounds.
"""

import numpy as np

EMPTY = np.uint64(0)
TOMB = np.uint64(1)
MIN_KEY = 2
B = 8
_GOLD = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_GOLD)
_U64 = (1 << 64) - 1
MISSING = -1
_REBUILD_SLICE = 1 << 16
# A bucket's 8 cell comparisons read as one little-endian uint64 have byte k set when cell k
# matches (1 << 8k); times this constant, its top byte is k.
_COL_MAGIC = np.uint64(0x0001020304050607)
_TOP_BYTE = np.uint64(56)
_LOG_B = np.uint64(3)
_NONE = np.empty(0, np.intp)
# Inserts of up to this many keys first try the common case in one pass (distinct home buckets,
# each with a free cell); rebuilds, whose keys share buckets, go straight to the general rounds.
_FAST_INSERT = 4096
# Keys probing past a full home bucket are few (a few per thousand at the index's load): up to
# this many go one by one (a vectorized probe round costs more than a dozen scalar lookups).
_SPILL_SCALAR = 16


class U64Table:
    __slots__ = (
        "_cells",
        "_keys",
        "_kflat",
        "_kmv",
        "_live",
        "_mask",
        "_max_load",
        "_shift",
        "_shift_i",
        "_used",
        "_vals",
        "_vflat",
        "_vmv",
    )

    def __init__(self, capacity: int = 64, max_load: float = 0.8) -> None:
        self._max_load = max_load
        self._alloc(max(1, int(np.ceil(capacity / (B * max_load)))))

    def __len__(self) -> int:
        return self._live

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _alloc(self, buckets: int) -> None:
        nb = 1 << max(0, int(buckets - 1).bit_length())
        self._keys = np.zeros((nb, B), np.uint64)
        self._vals = np.full((nb, B), MISSING, np.int32)
        self._mask = nb - 1
        self._cells = nb * B
        self._shift_i = 64 - max(1, nb.bit_length() - 1) if nb > 1 else 63
        self._shift = np.uint64(self._shift_i)
        self._live = 0
        self._used = 0
        self._kmv = memoryview(self._keys.reshape(-1))
        self._kflat = self._keys.reshape(-1)
        self._vflat = self._vals.reshape(-1)
        self._vmv = memoryview(self._vflat)

    # -- one key at a time (Python ints) ---------------------------------------------------
    def get1(self, key: int) -> int:
        kmv, cells = self._kmv, self._cells - 1
        i = (((key * _GOLD) & _U64) >> self._shift_i & self._mask) * B
        while True:
            k = kmv[i]
            if k == key:
                return self._vmv[i]
            if k == 0:
                return MISSING
            i = (i + 1) & cells

    def put1(self, key: int, val: int) -> int:
        """Insert or overwrite one key; returns the previous value (-1 when new)."""
        kmv, cells, free = self._kmv, self._cells - 1, -1
        i = (((key * _GOLD) & _U64) >> self._shift_i & self._mask) * B
        while True:
            k = kmv[i]
            if k == key:
                old = self._vmv[i]
                self._vmv[i] = val
                return old
            if k < MIN_KEY:
                if free < 0:
                    free = i
                if k == 0:
                    break
            i = (i + 1) & cells
        if kmv[free] == 0:
            if self._used + 1 > self._max_load * self._cells:
                self._rebuild(self._live + 1)
                return self.put1(key, val)
            self._used += 1
        kmv[free] = key
        self._vmv[free] = val
        self._live += 1
        return MISSING

    def pop1(self, key: int) -> int:
        kmv, cells = self._kmv, self._cells - 1
        i = (((key * _GOLD) & _U64) >> self._shift_i & self._mask) * B
        while True:
            k = kmv[i]
            if k == key:
                val = self._vmv[i]
                kmv[i] = 1
                self._vmv[i] = MISSING
                self._live -= 1
                return val
            if k == 0:
                return MISSING
            i = (i + 1) & cells

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys * _GOLDEN) >> self._shift).astype(np.intp) & self._mask

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(bucket, column) of every key; column -1 where the key is absent. The home buckets
        answer in one gather (as in `get`); keys not found in a full home bucket probe on."""
        n = keys.size
        bucket = self._home(keys)
        rows = self._keys.take(bucket, axis=0)
        eq = (rows == keys[:, None]).view(np.uint64).reshape(n)
        hit = eq != 0
        col = np.where(hit, ((eq * _COL_MAGIC) >> _TOP_BYTE).astype(np.intp), -1)
        full = rows[:, B - 1] != EMPTY
        if not full.any():
            return bucket, col
        pend = np.flatnonzero(full > hit)
        if pend.size <= _SPILL_SCALAR:  # a few: probe on one by one
            kmv, cells = self._kmv, self._cells - 1
            for j in pend.tolist():
                key, i = keys.item(j), (((bucket.item(j) + 1) & self._mask) * B)
                while True:
                    k = kmv[i]
                    if k == key:
                        bucket[j], col[j] = divmod(i, B)
                        break
                    if k == 0:
                        break
                    i = (i + 1) & cells
            return bucket, col
        while pend.size:
            b = (bucket[pend] + 1) & self._mask
            bucket[pend] = b
            rows = self._keys[b]
            eq = rows == keys[pend, None]
            hit = eq.any(axis=1)
            if hit.any():
                col[pend[hit]] = eq[hit].argmax(axis=1)
            pend = pend[~hit & ~(rows == EMPTY).any(axis=1)]
        return bucket, col

    def get(self, keys: np.ndarray, default: int = MISSING) -> np.ndarray:
        """Values of `keys` (uint64 array), `default` where absent.

        Most keys sit in their home bucket, so one gather of the home buckets answers them:
        the 8 cells' comparisons, as bytes, form one uint64 per key whose set byte names the
        column. Keys whose home bucket is full without them probe on (one by one when few)."""
        n = keys.size
        if n == 0:
            return np.empty(0, np.int32)
        bucket = (keys * _GOLDEN) >> self._shift
        if not self._mask:
            bucket &= np.uint64(0)
        cand = self._keys.take(bucket, axis=0)
        eq = (cand == keys[:, None]).view(np.uint64).reshape(n)
        out = self._vflat.take((bucket << _LOG_B) | ((eq * _COL_MAGIC) >> _TOP_BYTE))
        hit = eq != 0
        out = np.where(hit, out, np.int32(default))
        full = cand[:, B - 1] != EMPTY  # rare: then a key may sit past its home bucket
        spill = np.flatnonzero(full > hit) if full.any() else _NONE
        if spill.size > _SPILL_SCALAR:
            far, fcol = self._locate(keys[spill])
            found = fcol >= 0
            out[spill[found]] = self._vals[far[found], fcol[found]]
        elif spill.size:
            for i in spill.tolist():
                val = self.get1(keys.item(i))
                if val != MISSING:
                    out[i] = val
        return out

    def put(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Insert or overwrite distinct `keys`; returns the previous values (-1 where new)."""
        if keys.size == 0:
            return np.empty(0, np.int32)
        vals = np.asarray(vals, np.int32)
        bucket, col = self._locate(keys)
        found = col >= 0
        old = np.full(keys.size, MISSING, np.int32)
        if found.any():
            fb, fc = bucket[found], col[found]
            old[found] = self._vals[fb, fc]
            self._vals[fb, fc] = vals[found]
            if found.all():
                return old
        new = ~found
        self._insert(keys[new], vals[new], bucket[new])
        return old

    def add(self, keys: np.ndarray, make_vals) -> tuple[np.ndarray, np.ndarray | None]:
        """Values of distinct `keys`, inserting `make_vals(count)` for the absent ones; also
        which keys were new (None when none was)."""
        bucket, col = self._locate(keys)
        found = col >= 0
        out = np.empty(keys.size, np.int32)
        out[found] = self._vals[bucket[found], col[found]]
        if found.all():
            return out, None
        new = ~found
        vals = np.asarray(make_vals(int(new.sum())), np.int32)
        out[new] = vals
        self._insert(keys[new], vals, bucket[new])
        return out, new

    def pop(self, keys: np.ndarray) -> np.ndarray:
        """Delete `keys`; returns their values (-1 where absent), one per distinct key."""
        if keys.size == 0:
            return np.empty(0, np.int32)
        if keys.size > 1:
            distinct = np.unique(keys)
            if distinct.size != keys.size:
                keys = distinct
        bucket, col = self._locate(keys)
        found = col >= 0
        out = np.full(keys.size, MISSING, np.int32)
        if found.any():
            fb, fc = bucket[found], col[found]
            out[found] = self._vals[fb, fc]
            self._keys[fb, fc] = TOMB
            self._vals[fb, fc] = MISSING
            self._live -= int(found.sum())
        return out

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self._keys >= MIN_KEY
        return self._keys[live], self._vals[live]

    def values(self) -> np.ndarray:
        return self._vals[self._keys >= MIN_KEY]

    def _insert(self, keys: np.ndarray, vals: np.ndarray, start: np.ndarray) -> None:
        """Place distinct keys known to be absent, probing from bucket `start`."""
        n = keys.size
        if (self._used + n) > self._max_load * self._keys.size:
            self._rebuild(self._live + n)
            start = self._home(keys)
        self._live += n
        self._used += n
        if n <= _FAST_INSERT:
            # Usually every key has its own bucket with a free cell: take the first one.
            rows = self._keys.take(start, axis=0)
            free = (rows < MIN_KEY).view(np.uint64).reshape(n)
            if free.all():
                ordered = np.sort(start)
                if not (ordered[1:] == ordered[:-1]).any():
                    cell = start * B + ((free & -free) * _COL_MAGIC >> _TOP_BYTE).astype(np.intp)
                    # a tombstone reused is no new used cell
                    self._used -= int(np.count_nonzero(self._kflat.take(cell) == TOMB))
                    self._kflat[cell] = keys
                    self._vflat[cell] = vals
                    return
        b = start
        while True:
            # Several keys may want the same bucket: the k-th of them takes its k-th free cell.
            order = np.argsort(b, kind="stable")
            keys, vals, b = keys[order], vals[order], b[order]
            first = np.searchsorted(b, b, side="left")
            rank = np.arange(b.size) - first
            rows = self._keys[b]
            free = rows < MIN_KEY
            used_tomb = rows == TOMB
            target = free & (free.cumsum(axis=1) == (rank + 1)[:, None])
            ok = target.any(axis=1)
            cols = target.argmax(axis=1)
            ob, oc = b[ok], cols[ok]
            # a tombstone reused is no new used cell
            self._used -= int(used_tomb[ok, oc].sum())
            self._keys[ob, oc] = keys[ok]
            self._vals[ob, oc] = vals[ok]
            if ok.all():
                return
            rest = ~ok
            keys, vals, b = keys[rest], vals[rest], (b[rest] + 1) & self._mask
            if keys.size <= _SPILL_SCALAR:  # a few left: the first free cell on, one by one
                kmv, vmv, cells = self._kmv, self._vmv, self._cells - 1
                for key, val, i in zip(keys.tolist(), vals.tolist(), (b * B).tolist(), strict=True):
                    while kmv[i] >= MIN_KEY:
                        i = (i + 1) & cells
                    if kmv[i] == TOMB:
                        self._used -= 1
                    kmv[i] = key
                    vmv[i] = val
                return

    def _rebuild(self, live: int) -> None:
        """Re-insert the live keys into the smallest power-of-two table that holds `live` keys
        within `max_load` (so growth doubles, and a table full of tombstones does not grow)."""
        keys, vals = self.items()
        self._alloc(max(1, int(np.ceil(max(live, 1) / (B * self._max_load)))))
        # in slices: an insert gathers a whole bucket (64 bytes) per key
        for i in range(0, keys.size, _REBUILD_SLICE):
            part = keys[i : i + _REBUILD_SLICE]
            self._insert(part, vals[i : i + _REBUILD_SLICE], self._home(part))
