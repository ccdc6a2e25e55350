"""The shared holder bitmasks of the KV index: which slots hold a row that two or more hold.

Most cached blocks live on one slot only (a KV-aware router avoids computing a prefix twice), so
a row records its single holder as a column number in one int32 (the key table's value for the
row: see `kernels.py`). Only rows held by two or more slots get a bitmask row (one bit per slot
column, 64 per uint64 word) in this separate, smaller matrix, and the row's int32 then names it:
-1 - s for bitmask row s. At 256 slots that is 4 bytes instead of 32 for the common row.

This class owns the matrix and its growth; the compiled kernels (`_hold`, `_unhold`) change it.
Bitmask row 0 is never used. Free bitmask rows sit on a stack (`free_shared`, `meta[0]` of
them), of which the caller keeps at least as many as an operation could take (`reserve`).
"""

import numpy as np

MAX_COLUMNS = 32767  # a bound on the bitmask matrix (4 KiB per shared row at most)


class Holders:
    def __init__(self) -> None:
        self.shared = np.zeros((64, 1), np.uint64)
        self.free_shared = np.zeros(64, np.int32)
        self.free_shared[:63] = np.arange(63, 0, -1)
        self.meta = np.array([63], np.int64)
        self._parts()

    def _parts(self) -> None:
        """The kernels' arguments, in order; renewed whenever an array is replaced."""
        self.parts = (self.shared, self.free_shared, self.meta)

    @property
    def words(self) -> int:
        return self.shared.shape[1]

    @property
    def nbytes(self) -> int:
        return self.shared.nbytes + self.free_shared.nbytes

    def shared_rows(self) -> int:
        return self.shared.shape[0] - 1 - int(self.meta[0])

    def ensure_columns(self, columns: int) -> bool:
        """Room for `columns` slot columns; True when the arrays were replaced."""
        if columns > MAX_COLUMNS:
            raise ValueError(f"the KV index holds at most {MAX_COLUMNS:,} (worker, dp_rank) slots")
        if columns <= 64 * self.words:
            return False
        words = -(-columns // 64)
        grown = np.zeros((self.shared.shape[0], words), np.uint64)
        grown[:, : self.words] = self.shared
        self.shared = grown
        self._parts()
        return True

    def reserve(self, n: int) -> bool:
        """At least `n` free bitmask rows; True when the arrays were replaced."""
        free = int(self.meta[0])
        if free >= n:
            return False
        old = self.shared.shape[0]
        size = max(2 * old, old + n)
        grown = np.zeros((size, self.words), np.uint64)
        grown[:old] = self.shared
        stack = np.empty(size, np.int32)
        stack[:free] = self.free_shared[:free]
        stack[free : free + size - old] = np.arange(size - 1, old - 1, -1)
        self.shared, self.free_shared = grown, stack
        self.meta[0] = free + size - old
        self._parts()
        return True
