"""The router's workers as columns: one numpy array per attribute, one position per slot.

A selection looks at every (worker, dp_rank) slot of the fleet. Building a Python object per
slot per request cost more than all the scoring (~3–5 µs a slot: 0.3 ms at 64 workers), so the
router keeps the slots as a struct of arrays instead, in its worker order (registration order,
then rank): role, ready, LoRA adapters, KV capacity, context length, scraped usage and queue length, and where each slot's
column is in the KV index and in the active-request sums. Workers come and go rarely, so the
`Fleet` is rebuilt then (`Router` marks it stale); readiness and scraped load change in place.
Per request, `candidates` gathers the changing parts (booked load, cached overlap, prompt
blocks already held by live requests) with a few array operations into `Candidates`, the
columns every plugin of a selection works on. A prompt's `stored` blocks on a slot are those its
KV events reported; its `overlap` there, what it will find computed when it runs, is as much and,
with `RouterConfig.booked_prefix_hits`, at least the leading blocks the slot's live requests
hold (an engine serving in arrival order computes those first), so that a prefix's later
requests, sent while its first prefill runs, can follow it.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from dynamograph.protocol.engine import Role

from .active import DECODE, PREFILL, REQUESTS, UNANSWERED, ActiveRequests
from .index import KvIndex

Slot = tuple[int, int]
NO_CONTEXT_LIMIT = np.iinfo(np.int64).max  # an engine that does not say its context length


@dataclass(slots=True)
class WorkerState:
    """What the router knows about one worker (all of its DP ranks)."""

    worker_id: int
    role: Role
    dp_size: int
    block_size: int
    total_blocks: int
    lora_names: frozenset[str]
    ready: bool = True
    context_length: int | None = None  # the engine's max model length (None: not said)
    # per dp rank, from /metrics scrapes
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Candidates:
    """Every slot of the fleet, for one request, as columns (numpy arrays by fleet position).

    The fleet's columns (role, ready, adapters, capacity, scraped usage) plus this request's:
    the load booked on each slot, the prompt blocks each slot has cached, and how many leading
    prompt blocks live requests on each slot already hold. Scoring adds each scorer's column
    (`terms`, by scorer name) and their weighted sum (`cost`)."""

    fleet: "Fleet"
    booked_prefill: NDArray[np.int64]  # blocks booked slots still have to prefill
    booked_decode: NDArray[np.int64]  # blocks booked requests hold (shared prompt blocks once)
    requests: NDArray[np.int64]  # booked requests
    unanswered: NDArray[np.int64]  # booked requests whose prefill has not ended
    progress_at: NDArray[np.float64]  # when the slot last showed progress (ActiveRequests)
    stored: NDArray[np.int64]  # prompt blocks the slot's KV events reported stored (KV index)
    # prompt blocks the request finds computed there: `stored` or, with `booked_prefix_hits`,
    # the leading blocks live requests there hold, when they hold more (computed before it)
    overlap: NDArray[np.int64]
    held: NDArray[np.int64] | None  # leading prompt blocks live requests here hold (None: nowhere)
    terms: dict[str, np.ndarray] = field(default_factory=dict)
    cost: np.ndarray | None = None

    def usage(self) -> np.ndarray:
        """KV usage: the larger of the scraped fraction and our booked blocks' fraction."""
        return np.maximum(self.fleet.kv_usage, self.booked_decode / self.fleet.total_blocks)


class Fleet:
    """Every slot of the router's workers as columns (see the module docstring)."""

    def __init__(self, workers: Iterable[WorkerState], index: KvIndex, active: ActiveRequests):
        states = list(workers)
        self.slots: list[Slot] = [(w.worker_id, r) for w in states for r in range(w.dp_size)]
        self.worker_ids: list[int] = [slot[0] for slot in self.slots]
        self.first: dict[int, int] = {}  # worker id → position of its rank 0
        for pos, (wid, rank) in enumerate(self.slots):
            if rank == 0:
                self.first[wid] = pos
        self.lora_names = [w.lora_names for w in states for _ in range(w.dp_size)]
        self.prefill_role = np.array(
            [w.role == Role.PREFILL for w in states for _ in range(w.dp_size)], bool
        )
        self.ready = np.array([w.ready for w in states for _ in range(w.dp_size)], bool)
        self.total_blocks = np.array(
            [w.total_blocks for w in states for _ in range(w.dp_size)], np.int64
        )
        self.context_length = np.array(
            [w.context_length or NO_CONTEXT_LIMIT for w in states for _ in range(w.dp_size)],
            np.int64,
        )
        # a request needing no more than this fits every slot: the context filter's fast path
        self.shortest_context = int(self.context_length.min(initial=NO_CONTEXT_LIMIT))
        self.kv_usage = np.array([u for w in states for u in w.kv_usage], np.float64)
        self.waiting = np.array([n for w in states for n in w.waiting], np.int64)
        self.serving_role = ~self.prefill_role  # aggregated and decode workers
        self.has_prefill = bool(self.prefill_role.any())
        # where each slot's numbers live in the index and the active-request sums
        index_cols = [index.column(slot) for slot in self.slots]
        self.index_columns = index.column_count
        # index column → position; a column the router has no slot for (none, normally) maps
        # to one past the last position, a scratch cell that `candidates` drops
        self.index_pos = np.full(self.index_columns, len(self.slots), np.intp)
        self.index_pos[index_cols] = np.arange(len(self.slots))
        self.active_cols = np.array([active.column(slot) for slot in self.slots], np.intp)
        self.active_pos = {col: pos for pos, col in enumerate(self.active_cols.tolist())}
        # usually the slots' sum rows are 0..n-1 in fleet order: then a slice, not a gather
        self._sums_in_order = self.active_cols.tolist() == list(range(len(self.slots)))
        self._lora_masks: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.slots)

    def positions(self, worker_id: int, dp_size: int) -> range:
        first = self.first[worker_id]
        return range(first, first + dp_size)

    def set_ready(self, worker_id: int, dp_size: int, ready: bool) -> None:
        first = self.first[worker_id]
        self.ready[first : first + dp_size] = ready

    def set_kv_usage(self, worker_id: int, dp_rank: int, usage: float) -> None:
        self.kv_usage[self.first[worker_id] + dp_rank] = usage

    def set_waiting(self, worker_id: int, dp_rank: int, waiting: int) -> None:
        self.waiting[self.first[worker_id] + dp_rank] = waiting

    def any_prefill_ready(self) -> bool:
        return bool((self.prefill_role & self.ready).any())

    def serves(self, lora_name: str) -> np.ndarray:
        """Which slots serve the adapter (cached per name until the fleet changes)."""
        mask = self._lora_masks.get(lora_name)
        if mask is None:
            if len(self._lora_masks) > 1024:  # adapters named by requests, not only by workers
                self._lora_masks.clear()
            mask = np.array([lora_name in names for names in self.lora_names], bool)
            self._lora_masks[lora_name] = mask
        return mask

    def candidates(
        self,
        matches: np.ndarray,
        active: ActiveRequests,
        prompt_keys: np.ndarray,
        booked_prefix_hits: bool,
    ) -> Candidates:
        """The per-request columns: `matches` is `KvIndex.match_columns` of the prompt; with
        `booked_prefix_hits` a slot's overlap is at least what its live requests hold."""
        n = len(self.slots)
        # a view is enough: nothing books between gathering and deciding
        if self._sums_in_order:
            sums, progress = active.sums[:n], active.progress[:n]
        else:
            sums, progress = active.sums[self.active_cols], active.progress[self.active_cols]
        overlap = np.zeros(n + 1, np.int64)
        if len(matches):
            overlap[self.index_pos[matches[:, 0]]] = matches[:, 1]
        stored = overlap = overlap[:n]
        held = None
        for col, blocks in active.held_prefixes(prompt_keys):
            pos = self.active_pos.get(col)
            if pos is not None:
                if held is None:
                    held = np.zeros(n, np.int64)
                held[pos] = blocks
        if held is not None and booked_prefix_hits:
            overlap = np.maximum(overlap, held)
        return Candidates(
            fleet=self,
            booked_prefill=sums[:, PREFILL],
            booked_decode=sums[:, DECODE],
            requests=sums[:, REQUESTS],
            unanswered=sums[:, UNANSWERED],
            progress_at=progress,
            stored=stored,
            overlap=overlap,
            held=held,
        )
