"""The scheduler's plugins: filters, scorers and pickers, each small and named.

One selection (a phase: aggregated, prefill or decode) runs
    candidates (every (worker, dp_rank) slot, ready or not)
      → filters, in order (each may only remove candidates; the first to remove the last one
        names the reason for the 503, the busy filter turns it into a 429)
      → scorers (fill in the cost terms of each candidate)
      → picker (chooses one).
Dynamo's cost lives in `kv_cost` and nowhere else.

The plugins work on whole columns: `Candidates` holds one numpy array per attribute over every
slot of the fleet (`fleet.Fleet`, in the router's worker order), a filter returns a mask, a
scorer fills a column, a picker takes the positions the filters kept and returns one. Per slot
Python objects cost more than all of the arithmetic at 64 workers; the decisions are the same
(`tests/epp/test_scheduler_reference.py` checks them against a per-slot reference).
"""

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from dynamograph.protocol.router_config import Policy, RouterConfig

from . import kernels

if TYPE_CHECKING:
    from .fleet import Fleet

Slot = tuple[int, int]


class Phase(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"  # the decode half of a disaggregated request


@dataclass(slots=True)
class Candidates:
    """Every slot of the fleet, for one request, as columns (numpy arrays by fleet position).

    The fleet's columns (role, ready, adapters, capacity, scraped usage) plus this request's:
    the load booked on each slot, the prompt blocks each slot has cached, and how many leading
    prompt blocks live requests on each slot already hold. Scorers fill the cost terms."""

    fleet: "Fleet"
    booked_prefill: np.ndarray  # blocks booked slots still have to prefill
    booked_decode: np.ndarray  # blocks booked requests hold (shared prompt blocks once)
    requests: np.ndarray  # booked requests
    overlap: np.ndarray  # prompt blocks cached on the slot (KV index)
    held: np.ndarray | None  # leading prompt blocks live requests here hold (None: nowhere)
    prefill_blocks: np.ndarray | None = None  # blocks the slot would compute, this request's too
    decode_blocks: np.ndarray | None = None  # blocks the slot would hold, this request's too
    cost: np.ndarray | None = None  # the picker's cost (the kv picker's; else unset)

    def usage(self) -> np.ndarray:
        """KV usage: the larger of the scraped fraction and our booked blocks' fraction."""
        return np.maximum(self.fleet.kv_usage, self.booked_decode / self.fleet.total_blocks)


@dataclass(slots=True)
class Context:
    """One selection's inputs, shared by the plugins."""

    phase: Phase
    prompt_blocks: int
    lora_name: str | None
    allowed_ids: frozenset[int] | None
    output_blocks: int  # expected output blocks counted in the decode load (0 unless tracked)
    config: RouterConfig
    rng: random.Random


def kv_cost(prefill_blocks, decode_blocks, overlap_weight: float):
    """Dynamo's KV routing cost: lower is better. Numbers or numpy columns of them."""
    return overlap_weight * prefill_blocks + decode_blocks


# -- filters -------------------------------------------------------------------------------


class Filter(Protocol):
    name: str

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        """Which slots pass (a bool column); None when this request leaves every slot in."""
        ...

    def reason(self, ctx: Context) -> str: ...


class RoleFilter:
    """Prefill selections take prefill workers; the others take aggregated and decode workers."""

    name = "role"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray:
        fleet = c.fleet
        return fleet.prefill_role if ctx.phase == Phase.PREFILL else fleet.serving_role

    def reason(self, ctx: Context) -> str:
        if ctx.phase == Phase.PREFILL:
            return "no prefill worker is registered"
        return "no aggregated or decode worker is registered"


class ReadyFilter:
    name = "ready"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray:
        return c.fleet.ready

    def reason(self, ctx: Context) -> str:
        return f"no {ctx.phase.value} worker is ready"


class LoraFilter:
    name = "lora"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        return c.fleet.serves(ctx.lora_name) if ctx.lora_name else None

    def reason(self, ctx: Context) -> str:
        return f"no ready {ctx.phase.value} worker serves LoRA adapter {ctx.lora_name!r}"


class AllowedFilter:
    """The caller's subset (e.g. GAIE's destination-endpoint-subset hint, as instance ids).

    Applies to the serving (aggregated/decode) side: prefill workers have no serving endpoint.
    """

    name = "subset"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        allowed = ctx.allowed_ids
        if allowed is None or ctx.phase == Phase.PREFILL:
            return None
        ids = c.fleet.worker_ids
        return np.fromiter((w in allowed for w in ids), bool, len(ids))

    def reason(self, ctx: Context) -> str:
        return "no eligible worker is in the requested endpoint subset"


class BusyFilter:
    """Sheds workers whose KV usage reached `busy_threshold`; all busy → 429."""

    name = "busy"

    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        threshold = ctx.config.busy_threshold
        return None if threshold is None else c.usage() < threshold

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

    def score(self, ctx: Context, c: Candidates) -> None: ...


class KvOverlapScorer:
    """Prefill term: uncached prompt blocks of this request plus prefills already booked here.

    A disaggregated decode selection has none (the prefill happens elsewhere).
    """

    name = "kv-overlap"

    def score(self, ctx: Context, c: Candidates) -> None:
        if ctx.phase == Phase.DECODE:
            c.prefill_blocks = np.zeros_like(c.overlap)
        else:  # uncached blocks: overlaps never exceed the prompt's hashed blocks, so ≥ 0
            c.prefill_blocks = (ctx.prompt_blocks - c.overlap) + c.booked_prefill


class LoadScorer:
    """Decode term: blocks of requests booked here plus the blocks this request would add
    (its prompt blocks that live requests here don't already hold, and expected output)."""

    name = "load"

    def score(self, ctx: Context, c: Candidates) -> None:
        new_prompt = ctx.prompt_blocks + ctx.output_blocks
        if c.held is not None:
            new_prompt = new_prompt - c.held
        c.decode_blocks = c.booked_decode + new_prompt


SCORERS: tuple[Scorer, ...] = (KvOverlapScorer(), LoadScorer())


# -- pickers -------------------------------------------------------------------------------


class Picker(Protocol):
    name: str

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        """The chosen position among `at` (the positions the filters kept, ascending)."""
        ...


def _least(ctx: Context, at: np.ndarray, k1: np.ndarray, k2: np.ndarray, k3: np.ndarray) -> int:
    """The position in `at` with the smallest (k1, k2, k3), compared like a tuple; ties at
    random, among them in fleet order (one compiled pass: `kernels.least_of`)."""
    if len(at) == 1:
        return int(at[0])
    tied = np.empty(len(at), np.int64)
    n = kernels.least_of(at, k1, k2, k3, tied)
    if n == 1:
        return int(tied[0])
    return int(tied[ctx.rng.choice(range(n))])  # the draw `rng.choice(list)` would make


class KvPicker:
    """Dynamo's selection: temperature 0 = argmin cost; T > 0 = softmax over normalised costs.

    Ties at temperature 0 go to the least booked decode load, then fewest requests, then random.
    """

    name = "kv"

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        weight = 0.0 if ctx.phase == Phase.DECODE else ctx.config.overlap_weight
        c.cost = kv_cost(c.prefill_blocks, c.decode_blocks, float(weight))  # float64 column
        temperature = ctx.config.temperature
        if temperature <= 0 or len(at) == 1:
            return _least(ctx, at, c.cost, c.booked_decode, c.requests)
        return int(at[softmax_sample(c.cost[at].tolist(), temperature, ctx.rng)])


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

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        ordered = sorted(at.tolist(), key=c.fleet.slots.__getitem__)
        i = self._next.get(ctx.phase, 0)
        self._next[ctx.phase] = i + 1
        return ordered[i % len(ordered)]


class RandomPicker:
    name = "random"

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        return int(at[ctx.rng.choice(range(len(at)))])


class LeastLoadedPicker:
    """Fewest booked requests (then booked blocks, then random); ignores the KV cache."""

    name = "least-loaded"

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        return _least(ctx, at, c.requests.astype(np.float64), c.booked_decode, c.requests)


def make_picker(policy: Policy) -> Picker:
    return {
        Policy.KV: KvPicker,
        Policy.ROUND_ROBIN: RoundRobinPicker,
        Policy.RANDOM: RandomPicker,
        Policy.LEAST_LOADED: LeastLoadedPicker,
    }[policy]()
