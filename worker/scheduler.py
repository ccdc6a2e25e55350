"""Continuous-batching scheduler: which sequences run in the next step, and how many tokens each.

Pure logic over a `KvCache`, modelled on vLLM V1's scheduler:
- a step has a token budget (`max_num_batched_tokens`) and at most `max_num_seqs` sequences;
- running sequences are served first (one token per decode, the rest of the prompt for a
  partially prefilled one), then waiting ones in arrival order;
- chunked prefill: a prompt longer than the remaining budget is computed over several steps;
- prefix caching: a new sequence starts after its longest cached prefix (capped one token short
  of the prompt, which must be computed to sample from);
- preemption by recompute: when a running sequence cannot get a block, the most recently
  admitted running sequence releases all of its blocks and goes back to the head of the queue;
- remote prefill (disaggregated decode): a sequence whose KV is pulled from a prefill engine
  holds its blocks in `loading` until the simulated transfer completes, then runs;
- LoRA (`max_loras`): at most that many distinct adapters in the batch; a waiting sequence of
  another adapter is skipped (keeping its place) until one drains, as vLLM's scheduler does;
- priority (`priority_policy`, vLLM's `--scheduling-policy priority`): the waiting queue is
  ordered by (request priority, arrival), lower first, and preemption takes the running
  sequence last in that order, as vLLM's priority policy does.
"""

import bisect
import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dynamograph.protocol.hashing import block_hashes

from .kv_cache import KvCache, chain_hash, chained_hashes


class Status(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: np.ndarray
    max_tokens: int
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None  # vLLM's id of the adapter, named in this sequence's KV events
    remote_tokens: int = 0  # prompt tokens whose KV a prefill engine computed (hand-off)
    handle: Any = None  # the engine's per-request state
    status: Status = Status.WAITING
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_committed: int = 0  # full blocks stored in the prefix cache
    num_cached_tokens: int = -1  # prefix hit at first admission (-1: not admitted yet)
    num_remote_loaded: int = 0
    ready_at: float = 0.0
    priority: int = 0  # vLLM's request priority: lower runs first under the priority policy
    arrival: int = -1  # arrival order at this scheduler (-1: not added yet)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt)
        self.buf = np.zeros(self.prompt_len + self.max_tokens, dtype="<u4")
        self.buf[: self.prompt_len] = self.prompt
        self.num_tokens = self.prompt_len
        self.hashes = chained_hashes(self.prompt, self.block_size, self.lora_name)

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len

    def append(self, token: int) -> None:
        self.buf[self.num_tokens] = token
        self.num_tokens += 1
        full = self.num_tokens // self.block_size
        bs = self.block_size
        while len(self.hashes) < full:
            i = len(self.hashes)
            content = block_hashes(self.buf[i * bs : (i + 1) * bs], bs, self.lora_name)[0]
            self.hashes.append(chain_hash(self.hashes[-1] if self.hashes else None, content))


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    computed_before: int


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    loaded: list[Sequence] = field(default_factory=list)  # finished loading remote KV

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def cost_inputs(self) -> tuple[int, int, list[tuple[int, int]]]:
        """(scheduled tokens, decode context tokens, prefill chunks) for the cost model."""
        decode_ctx = 0
        chunks = []
        for s in self.scheduled:
            if s.computed_before >= s.seq.prompt_len:
                decode_ctx += s.computed_before + s.num_tokens
            else:
                chunks.append((s.computed_before, s.num_tokens))
        return self.num_tokens, decode_ctx, chunks


@dataclass(slots=True)
class PrefixStats:
    queries: int = 0
    hits: int = 0
    preemptions: int = 0


class Scheduler:
    def __init__(
        self,
        cache: KvCache,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        transfer_time=lambda tokens: 0.0,
        max_loras: int | None = None,
        priority_policy: bool = False,
    ):
        self.cache = cache
        self.priority_policy = priority_policy
        self._arrivals = itertools.count()
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.transfer_time = transfer_time
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []
        self.stats = PrefixStats()

    # -- queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)
        if self.priority_policy:
            self._insert(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _order(seq: Sequence) -> tuple[int, int]:
        return seq.priority, seq.arrival

    def _insert(self, seq: Sequence) -> None:
        """Into the waiting queue at its place by (priority, arrival)."""
        self.waiting.insert(bisect.bisect(self.waiting, self._order(seq), key=self._order), seq)

    def remove(self, seq: Sequence) -> list[int]:
        """Take a sequence out of every queue; returns the blocks it still references."""
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        elif seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.LOADING:
            self.loading.remove(seq)
        seq.status = Status.FINISHED
        blocks, seq.blocks = seq.blocks, []
        return blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def next_ready(self) -> float | None:
        """Earliest simulated time a loading sequence becomes runnable."""
        return min((s.ready_at for s in self.loading), default=None)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        self._finish_loading(now, plan)
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            need = self.cache.blocks_needed(len(seq.blocks), seq.num_computed + n)
            while not self.cache.can_allocate(need):
                if self.priority_policy:  # the least important, latest arrival goes
                    victim = max(self.running, key=self._order)
                    at = self.running.index(victim)
                    del self.running[at]
                    i -= at < i  # one scheduled before it left: `seq` moved down
                else:
                    victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break
            seq.blocks += self.cache.allocate(need)
            plan.scheduled.append(ScheduledSeq(seq, n, seq.num_computed))
            budget -= n
            i += 1
        if not plan.preempted:
            self._admit(now, budget, plan)
        return plan

    def active_loras(self) -> set[str]:
        return {s.lora_name for s in (*self.running, *self.loading) if s.lora_name}

    def _admit(self, now: float, budget: int, plan: StepPlan) -> None:
        loras = self.active_loras() if self.max_loras else set()
        skipped: list[Sequence] = []
        try:
            self._admit_in_order(now, budget, plan, loras, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))  # skipped sequences keep their places

    def _admit_in_order(
        self, now: float, budget: int, plan: StepPlan, loras: set[str], skipped: list[Sequence]
    ) -> None:
        bs = self.cache.block_size
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if self.max_loras and seq.lora_name and seq.lora_name not in loras:
                if len(loras) >= self.max_loras:
                    skipped.append(self.waiting.popleft())
                    continue
                loras.add(seq.lora_name)
            hits = self.cache.cached_prefix(seq.hashes[: (seq.num_tokens - 1) // bs])
            computed = len(hits) * bs
            if seq.remote_tokens > computed and seq.num_remote_loaded == 0:
                # Disaggregated decode: allocate for the remote part and wait for the transfer.
                need = self.cache.blocks_needed(len(hits), seq.remote_tokens)
                if not self.cache.can_allocate(need, hits):
                    break
                self._take(seq, hits, need, computed)
                self.waiting.popleft()
                seq.status = Status.LOADING
                seq.ready_at = now + self.transfer_time(seq.remote_tokens - computed)
                seq.num_remote_loaded = seq.remote_tokens - computed
                self.loading.append(seq)
                continue
            n = min(seq.num_tokens - computed, budget)
            need = self.cache.blocks_needed(len(hits), computed + n)
            if not self.cache.can_allocate(need, hits):
                break
            self.waiting.popleft()
            self._take(seq, hits, need, computed)
            seq.status = Status.RUNNING
            self.running.append(seq)
            plan.scheduled.append(ScheduledSeq(seq, n, computed))
            budget -= n

    def _take(self, seq: Sequence, hits: list[int], need: int, computed: int) -> None:
        self.cache.touch(hits)
        seq.blocks = hits + self.cache.allocate(need)
        seq.num_computed = computed
        seq.num_committed = len(hits)
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = computed
        self.stats.queries += seq.num_tokens
        self.stats.hits += computed

    def _finish_loading(self, now: float, plan: StepPlan) -> None:
        for seq in [s for s in self.loading if s.ready_at <= now]:
            self.loading.remove(seq)
            seq.status = Status.RUNNING
            seq.num_computed = seq.remote_tokens
            self._commit(seq)
            self.running.append(seq)
            plan.loaded.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.cache.release(seq.blocks)
        seq.blocks = []
        seq.num_computed = 0
        seq.num_committed = 0
        seq.status = Status.WAITING
        self.stats.preemptions += 1
        if self.priority_policy:
            self._insert(seq)
        else:
            self.waiting.appendleft(seq)

    def complete(self, plan: StepPlan) -> list[Sequence]:
        """Account a finished step; returns the sequences that now sample a token."""
        produced = []
        for s in plan.scheduled:
            seq = s.seq
            if seq.status is not Status.RUNNING:  # aborted or preempted during the step
                continue
            seq.num_computed += s.num_tokens
            self._commit(seq)
            if seq.num_computed == seq.num_tokens:
                produced.append(seq)
        return produced

    def _commit(self, seq: Sequence) -> None:
        full = min(seq.num_computed // self.cache.block_size, len(seq.hashes))
        if full > seq.num_committed:
            parent = seq.hashes[seq.num_committed - 1] if seq.num_committed else None
            self.cache.commit(
                seq.blocks, seq.hashes[:full], seq.buf, seq.num_committed, parent, seq.lora_id,
                seq.lora_name,
            )  # fmt: skip
            seq.num_committed = full
