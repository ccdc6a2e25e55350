"""Which slots hold each row of the KV index, stored for memory: one owner, or a shared bitmask.

Most cached blocks live on one slot only (a KV-aware router avoids computing a prefix twice), so
a row records its single holder as a column number (int16). Only rows held by two or more slots
get a bitmask row (one bit per slot column, 64 per uint64 word) in a separate, smaller matrix.
At 256 slots that is 2 bytes instead of 32 for the common row.

Rows are allocated by the caller (the index); row 0 is "nobody" and stays empty. Every operation
exists twice: for one row (Python ints through memoryviews, cheap for a few rows) and for many
rows at once (numpy). Both report rows that became empty so the caller can recycle them.
"""

import numpy as np

NOBODY = -1


class Holders:
    def __init__(self, rows: int = 1024) -> None:
        self._owner = np.full(rows, NOBODY, np.int16)
        self._shared_of = np.zeros(rows, np.int32)  # 0: not shared
        self._shared = np.zeros((64, 1), np.uint64)
        self._free_shared = list(range(63, 0, -1))
        self._views()
        self._bit_table()

    def _views(self) -> None:
        self.words = self._shared.shape[1]
        self._owner_mv = memoryview(self._owner)
        self._shared_of_mv = memoryview(self._shared_of)
        self._shared_mv = memoryview(self._shared.reshape(-1))
        self._shared_bytes = self._shared_mv.cast("B")

    @property
    def nbytes(self) -> int:
        return self._owner.nbytes + self._shared_of.nbytes + self._shared.nbytes

    def shared_rows(self) -> int:
        return self._shared.shape[0] - 1 - len(self._free_shared)

    def grow_rows(self, size: int) -> None:
        old = self._owner.size
        self._owner = np.concatenate([self._owner, np.full(size - old, NOBODY, np.int16)])
        self._shared_of = np.concatenate([self._shared_of, np.zeros(size - old, np.int32)])
        self._views()

    def ensure_columns(self, columns: int) -> None:
        if columns > 32767:
            raise ValueError("the KV index holds at most 32,767 (worker, dp_rank) slots")
        while columns > 64 * self.words:
            self._shared = np.hstack([self._shared, np.zeros_like(self._shared)])
            self._views()
            self._bit_table()

    def _bit_table(self) -> None:
        """Row c: the one-bit mask of column c; one more, empty, row for NOBODY (index -1)."""
        columns = 64 * self.words
        self._bits = np.zeros((columns + 1, self.words), np.uint64)
        col = np.arange(columns)
        self._bits[col, col >> 6] = np.left_shift(np.uint64(1), (col & 63).astype(np.uint64))

    def _new_shared(self, n: int) -> list[int]:
        if len(self._free_shared) < n:
            old = self._shared.shape[0]
            size = max(2 * old, old + n)
            grown = np.zeros((size, self.words), np.uint64)
            grown[:old] = self._shared
            self._shared = grown
            self._free_shared[:0] = range(size - 1, old - 1, -1)
            self._views()
        taken = self._free_shared[-n:]
        del self._free_shared[-n:]
        return taken

    # -- one row ---------------------------------------------------------------------------
    def add1(self, row: int, column: int) -> None:
        owner = self._owner_mv[row]
        if owner == column:
            return
        words = self.words
        shared = self._shared_of_mv[row]
        if shared:
            self._shared_mv[shared * words + (column >> 6)] |= 1 << (column & 63)
        elif owner == NOBODY:
            self._owner_mv[row] = column
        else:
            (shared,) = self._new_shared(1)
            mv = self._shared_mv
            mv[shared * words + (owner >> 6)] |= 1 << (owner & 63)
            mv[shared * words + (column >> 6)] |= 1 << (column & 63)
            self._shared_of_mv[row] = shared
            self._owner_mv[row] = NOBODY

    def drop1(self, row: int, column: int) -> bool:
        """Remove `column` from `row`; True when nobody holds the row any more."""
        if self._owner_mv[row] == column:
            self._owner_mv[row] = NOBODY
            return True
        shared = self._shared_of_mv[row]
        if not shared:
            return False
        words, mv = self.words, self._shared_mv
        base = shared * words
        mv[base + (column >> 6)] &= ~(1 << (column & 63))
        if any(mv[base : base + words]):
            return False
        self._shared_of_mv[row] = 0
        self._free_shared.append(shared)
        return True

    def bits1(self, row: int) -> int:
        """The row's holders as a Python int (bit = column)."""
        owner = self._owner_mv[row]
        if owner != NOBODY:
            return 1 << owner
        shared = self._shared_of_mv[row]
        if not shared:
            return 0
        width = 8 * self.words
        return int.from_bytes(self._shared_bytes[shared * width : (shared + 1) * width], "little")

    # -- many rows -------------------------------------------------------------------------
    def add(self, rows: np.ndarray, column: int) -> None:
        """Add `column` to distinct `rows`."""
        owner = self._owner[rows]
        shared = self._shared_of[rows]
        word, bit = column >> 6, np.uint64(1 << (column & 63))
        is_shared = shared > 0
        if is_shared.any():
            self._shared[shared[is_shared], word] |= bit
        fresh = (owner == NOBODY) & ~is_shared
        self._owner[rows[fresh]] = column
        promote = (owner != NOBODY) & (owner != column)
        if promote.any():
            prow, pown = rows[promote], owner[promote].astype(np.int64)
            new = np.array(self._new_shared(prow.size), np.int32)
            self._shared[new, pown >> 6] |= np.left_shift(
                np.uint64(1), (pown & 63).astype(np.uint64)
            )
            self._shared[new, word] |= bit
            self._shared_of[prow] = new
            self._owner[prow] = NOBODY

    def drop(self, rows: np.ndarray, column: int) -> np.ndarray:
        """Remove `column` from distinct `rows`; returns the rows nobody holds any more."""
        owner = self._owner[rows]
        mine = owner == column
        emptied = [rows[mine]]
        self._owner[rows[mine]] = NOBODY
        shared = self._shared_of[rows]
        is_shared = shared > 0
        if is_shared.any():
            srows, sidx = rows[is_shared], shared[is_shared]
            self._shared[sidx, column >> 6] &= ~np.uint64(1 << (column & 63))
            gone = ~self._shared[sidx].any(axis=1)
            if gone.any():
                self._shared_of[srows[gone]] = 0
                self._free_shared.extend(sidx[gone].tolist())
                emptied.append(srows[gone])
        return np.concatenate(emptied) if len(emptied) > 1 else emptied[0]

    def words_of(self, rows: np.ndarray) -> np.ndarray:
        """Holder bitmasks of `rows` as an (n, words) uint64 array: the owner's bit (from a
        table of one-bit masks whose last row, indexed by NOBODY = -1, is empty) or the shared
        bitmask (shared row 0 is never allocated, so it stays empty)."""
        return self._bits.take(self._owner.take(rows), axis=0) | self._shared.take(
            self._shared_of.take(rows), axis=0
        )
