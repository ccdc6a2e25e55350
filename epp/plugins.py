"""The scheduler's plugins: filters, scorers and pickers, each small and named.

One selection (a phase: aggregated, prefill or decode) runs
    candidates (one per ready-or-not (worker, dp_rank) slot)
      → filters, in order (each may only remove candidates; the first to remove the last one
        names the reason for the 503, the busy filter turns it into a 429)
      → scorers (fill in the cost terms of each candidate)
      → picker (chooses one).
Dynamo's cost lives in `kv_cost` and nowhere else.
"""

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from dynamograph.protocol.engine import Role

from .active import SlotLoad
from .config import Policy, RouterConfig

Slot = tuple[int, int]


class Phase(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"  # the decode half of a disaggregated request


@dataclass(slots=True)
class Candidate:
    slot: Slot
    role: Role
    ready: bool
    lora_names: frozenset[str]
    total_blocks: int
    kv_usage: float  # scraped vllm:kv_cache_usage_perc of this rank (0 when never scraped)
    load: SlotLoad
    overlap: int = 0  # prompt blocks cached on this slot
    prefill_blocks: float = 0.0  # blocks this slot would have to compute, this request included
    decode_blocks: float = 0.0  # blocks this slot would hold, this request included
    cost: float = 0.0

    @property
    def usage(self) -> float:
        """KV usage: the larger of the scraped fraction and our booked blocks' fraction."""
        booked = self.load.decode_blocks / self.total_blocks if self.total_blocks else 0.0
        return max(self.kv_usage, booked)


@dataclass(slots=True)
class Context:
    """One selection's inputs, shared by the plugins."""

    phase: Phase
    prompt_blocks: int
    prompt_keys: list[int]  # prefix keys of the prompt's full blocks (`index.chain_keys`)
    overlaps: dict[Slot, int]
    lora_name: str | None
    allowed_ids: frozenset[int] | None
    output_blocks: int  # expected output blocks counted in the decode load (0 unless tracked)
    config: RouterConfig
    rng: random.Random


def kv_cost(prefill_blocks: float, decode_blocks: float, overlap_weight: float) -> float:
    """Dynamo's KV routing cost: lower is better."""
    return overlap_weight * prefill_blocks + decode_blocks


# -- filters -------------------------------------------------------------------------------


class Filter(Protocol):
    name: str

    def keep(self, ctx: Context, c: Candidate) -> bool: ...

    def reason(self, ctx: Context) -> str: ...


class RoleFilter:
    """Prefill selections take prefill workers; the others take aggregated and decode workers."""

    name = "role"

    def keep(self, ctx: Context, c: Candidate) -> bool:
        return (c.role == Role.PREFILL) == (ctx.phase == Phase.PREFILL)

    def reason(self, ctx: Context) -> str:
        if ctx.phase == Phase.PREFILL:
            return "no prefill worker is registered"
        return "no aggregated or decode worker is registered"


class ReadyFilter:
    name = "ready"

    def keep(self, ctx: Context, c: Candidate) -> bool:
        return c.ready

    def reason(self, ctx: Context) -> str:
        return f"no {ctx.phase.value} worker is ready"


class LoraFilter:
    name = "lora"

    def keep(self, ctx: Context, c: Candidate) -> bool:
        return not ctx.lora_name or ctx.lora_name in c.lora_names

    def reason(self, ctx: Context) -> str:
        return f"no ready {ctx.phase.value} worker serves LoRA adapter {ctx.lora_name!r}"


class AllowedFilter:
    """The caller's subset (e.g. GAIE's destination-endpoint-subset hint, as instance ids).

    Applies to the serving (aggregated/decode) side: prefill workers have no serving endpoint.
    """

    name = "subset"

    def keep(self, ctx: Context, c: Candidate) -> bool:
        return ctx.allowed_ids is None or ctx.phase == Phase.PREFILL or c.slot[0] in ctx.allowed_ids

    def reason(self, ctx: Context) -> str:
        return "no eligible worker is in the requested endpoint subset"


class BusyFilter:
    """Sheds workers whose KV usage reached `busy_threshold`; all busy → 429."""

    name = "busy"

    def keep(self, ctx: Context, c: Candidate) -> bool:
        threshold = ctx.config.busy_threshold
        return threshold is None or c.usage < threshold

    def reason(self, ctx: Context) -> str:
        return (
            f"every eligible {ctx.phase.value} worker is at or above the busy threshold "
            f"({ctx.config.busy_threshold:.0%} KV usage)"
        )


FILTERS: tuple[Filter, ...] = (
    RoleFilter(),
    ReadyFilter(),
    LoraFilter(),
    AllowedFilter(),
    BusyFilter(),
)
BUSY = BusyFilter.name


# -- scorers -------------------------------------------------------------------------------


class Scorer(Protocol):
    name: str

    def score(self, ctx: Context, c: Candidate) -> None: ...


class KvOverlapScorer:
    """Prefill term: uncached prompt blocks of this request plus prefills already booked here.

    A disaggregated decode selection has none (the prefill happens elsewhere).
    """

    name = "kv-overlap"

    def score(self, ctx: Context, c: Candidate) -> None:
        c.overlap = ctx.overlaps.get(c.slot, 0)
        if ctx.phase == Phase.DECODE:
            c.prefill_blocks = 0.0
        else:
            c.prefill_blocks = max(ctx.prompt_blocks - c.overlap, 0) + c.load.prefill_blocks


class LoadScorer:
    """Decode term: blocks of requests booked here plus the blocks this request would add
    (its prompt blocks that live requests here don't already hold, and expected output)."""

    name = "load"

    def score(self, ctx: Context, c: Candidate) -> None:
        new_prompt = ctx.prompt_blocks - c.load.held_prefix(ctx.prompt_keys)
        c.decode_blocks = c.load.decode_blocks + new_prompt + ctx.output_blocks


SCORERS: tuple[Scorer, ...] = (KvOverlapScorer(), LoadScorer())


# -- pickers -------------------------------------------------------------------------------


class Picker(Protocol):
    name: str

    def pick(self, ctx: Context, candidates: Sequence[Candidate]) -> Candidate: ...


def _least_loaded(ctx: Context, candidates: Iterable[Candidate], key) -> Candidate:
    """Minimum of `key`; ties to the least booked decode load, then fewest requests, then random."""
    best: list[Candidate] = []
    best_key = None
    for c in candidates:
        k = (key(c), c.load.decode_blocks, c.load.requests)
        if best_key is None or k < best_key:
            best, best_key = [c], k
        elif k == best_key:
            best.append(c)
    return best[0] if len(best) == 1 else ctx.rng.choice(best)


class KvPicker:
    """Dynamo's selection: temperature 0 = argmin cost; T > 0 = softmax over normalised costs."""

    name = "kv"

    def pick(self, ctx: Context, candidates: Sequence[Candidate]) -> Candidate:
        weight = 0.0 if ctx.phase == Phase.DECODE else ctx.config.overlap_weight
        for c in candidates:
            c.cost = kv_cost(c.prefill_blocks, c.decode_blocks, weight)
        temperature = ctx.config.temperature
        if temperature <= 0 or len(candidates) == 1:
            return _least_loaded(ctx, candidates, lambda c: c.cost)
        return candidates[softmax_sample([c.cost for c in candidates], temperature, ctx.rng)]


def softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn with probability ∝ exp(-normalised cost / T); costs normalised to [0, 1]."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return rng.randrange(len(costs))
    weights = [math.exp(-((c - lo) / (hi - lo)) / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


@dataclass
class RoundRobinPicker:
    name = "round-robin"
    _next: dict[Phase, int] = field(default_factory=dict)

    def pick(self, ctx: Context, candidates: Sequence[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.slot)
        i = self._next.get(ctx.phase, 0)
        self._next[ctx.phase] = i + 1
        return ordered[i % len(ordered)]


class RandomPicker:
    name = "random"

    def pick(self, ctx: Context, candidates: Sequence[Candidate]) -> Candidate:
        return ctx.rng.choice(list(candidates))


class LeastLoadedPicker:
    """Fewest booked requests (then booked blocks, then random); ignores the KV cache."""

    name = "least-loaded"

    def pick(self, ctx: Context, candidates: Sequence[Candidate]) -> Candidate:
        return _least_loaded(ctx, candidates, lambda c: c.load.requests)


def make_picker(policy: Policy) -> Picker:
    return {
        Policy.KV: KvPicker,
        Policy.ROUND_ROBIN: RoundRobinPicker,
        Policy.RANDOM: RandomPicker,
        Policy.LEAST_LOADED: LeastLoadedPicker,
    }[policy]()
