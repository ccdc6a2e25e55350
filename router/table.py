"""A flat uint64 → int32 hash table on numpy arrays, probed by the compiled kernels.

Why not a dict: the KV index holds tens of millions of entries (256 workers × 100k blocks); a
Python dict spends ~100 bytes per int → int entry, these arrays 12 per cell. The index's
kernels (`kernels.py`) read and write the cells directly; this class owns the arrays: it sizes
them (a power of two of cells, at most `max_load` of them used, tombstones included) and
rebuilds them when an insert of `n` keys could pass that (`reserve`), which is the caller's
job before any kernel inserts. A rebuild leaves at least `REBUILD_ROOM` of the usable cells
free, so a table whose keys come and go (an engine's cache, full, storing as it evicts) is
rebuilt once per that many inserts, not after every few. The batch methods here are for
callers outside the kernels.

Layout and probing are described in `kernels.py`. Keys 0 and 1 are reserved (EMPTY, TOMB):
callers pass keys ≥ 2 (`MIN_KEY`).
"""

import math

import numpy as np
from numpy.typing import ArrayLike

from . import kernels
from .kernels import LIMIT, LIVE, MIN_KEY, MISSING, USED

__all__ = ["MIN_KEY", "MISSING", "U64Table"]

_MIN_CELLS = 8
# Rebuilt to the smallest size that fits, a table whose live keys sit just under its limit
# (where a power of two happens to fall) would be full again after a few inserts, and every
# rebuild copies all its cells: in the KV index that was one rebuild per ~12 event batches.
REBUILD_ROOM = 0.25


def _cells_for(keys: int, max_load: float) -> int:
    """The smallest power-of-two number of cells holding `keys` within `max_load`."""
    need = max(_MIN_CELLS, math.ceil(max(keys, 1) / max_load))
    return 1 << (need - 1).bit_length()


class U64Table:
    __slots__ = ("_max_load", "keys", "meta", "parts", "vals")

    def __init__(self, capacity: int = 64, max_load: float = 0.8) -> None:
        kernels.warm_up()
        self._max_load = max_load
        self._alloc(_cells_for(capacity, max_load))

    def _alloc(self, cells: int) -> None:
        self.keys = np.zeros(cells, np.uint64)
        self.vals = np.empty(cells, np.int32)  # a value counts only where its key is live
        shift, limit = 64 - (cells.bit_length() - 1), int(self._max_load * cells)
        self.meta = np.array([0, 0, shift, limit], np.int64)
        self.parts = (self.keys, self.vals, self.meta)  # the kernels' arguments, in order

    def __len__(self) -> int:
        return int(self.meta[LIVE])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes

    def reserve(self, n: int) -> bool:
        """Make room for `n` more keys; True when the arrays were replaced (rebuilt into the
        smallest table holding the live keys plus `n` with `REBUILD_ROOM` to spare: growth
        doubles, and a table full of tombstones does not grow)."""
        if self.meta[USED] + n <= self.meta[LIMIT]:
            return False
        old_keys, old_vals = self._compact(n)
        kernels.table_rehash(old_keys, old_vals, *self.parts)
        return True

    def reserve_moving(self, n: int) -> np.ndarray | None:
        """`reserve` for a table whose cells are row numbers: None when nothing moved, else the
        new cell of every old cell (indexed by old cell; -1 for cells that held no key)."""
        if self.meta[USED] + n <= self.meta[LIMIT]:
            return None
        moved = np.full(self.keys.size, MISSING, np.int32)
        old_cells = np.flatnonzero(self.keys >= MIN_KEY).astype(np.int32)
        old_keys, old_vals = self._compact(n, old_cells)
        kernels.table_rehash_moving(old_keys, old_vals, old_cells, moved, *self.parts)
        return moved

    def _compact(self, n: int, cells: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Copy out the live cells (or `cells`), then replace the arrays with empty ones big
        enough for them plus `n` keys and `REBUILD_ROOM` more: the old arrays (at 50% load, twice the copy) are freed
        before the new ones fill, which at 25 M keys is ~400 MB less at the peak."""
        if cells is None:
            cells = self.keys >= MIN_KEY
        old_keys, old_vals = self.keys[cells], self.vals[cells]
        del self.keys, self.vals, self.parts
        self._alloc(_cells_for(old_keys.size + n, self._max_load * (1 - REBUILD_ROOM)))
        return old_keys, old_vals

    def clear(self) -> None:
        """Empty the table, keeping its arrays."""
        self.keys.fill(0)
        self.meta[LIVE] = self.meta[USED] = 0

    def copy(self) -> "U64Table":
        other = U64Table.__new__(U64Table)
        other._max_load = self._max_load
        other.keys, other.vals, other.meta = self.keys.copy(), self.vals.copy(), self.meta.copy()
        other.parts = (other.keys, other.vals, other.meta)
        return other

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Values of `keys` (uint64), MISSING where absent."""
        return kernels.table_get(_as_keys(keys), *self.parts)

    def put(self, keys: np.ndarray, vals: np.ndarray) -> np.ndarray:
        """Set keys to values in order (a repeated key ends with its last value); returns each
        key's value just before its write (MISSING where new)."""
        keys = _as_keys(keys)
        self.reserve(keys.size)
        return kernels.table_put(keys, np.ascontiguousarray(vals, np.int32), *self.parts)

    def pop(self, keys: np.ndarray) -> np.ndarray:
        """Delete keys in order; returns each one's value (MISSING where absent by then)."""
        return kernels.table_pop(_as_keys(keys), *self.parts)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        live = self.keys >= MIN_KEY
        return self.keys[live], self.vals[live]

    def live_keys(self) -> np.ndarray:
        return self.keys[self.keys >= MIN_KEY]


def _as_keys(keys: ArrayLike) -> np.ndarray:
    keys = np.ascontiguousarray(keys, np.uint64)
    if keys.size and keys.min() < MIN_KEY:
        raise ValueError("table keys 0 and 1 are reserved")
    return keys
