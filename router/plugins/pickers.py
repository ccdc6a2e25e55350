"""Built-in pickers: `kv` (Dynamo's choice by cost) and the cost-blind baselines."""

import math
import random
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from .. import kernels
from ..fleet import Candidates
from .base import Context, Phase, Picker, register
from .scorers import KvOverlapScorer, PrefillWorkScorer


def least(ctx: Context, at: np.ndarray, k1: np.ndarray, k2: np.ndarray, k3: np.ndarray) -> int:
    """The position in `at` with the smallest (k1, k2, k3), compared like a tuple; ties at
    random, among them in fleet order (one compiled pass: `kernels.least_of`)."""
    if len(at) == 1:
        return int(at[0])
    tied = np.empty(len(at), np.int64)
    n = kernels.least_of(at, k1, k2, k3, tied)
    if n == 1:
        return int(tied[0])
    return int(tied[ctx.rng.choice(range(n))])  # the draw `rng.choice(list)` would make


class CostParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    home_margin: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="temperature 0: a request leaves the slot with more of its prompt stored "
        "than any other (its conversation's home) only for a slot whose cost is below (1 − this) × "
        "the home's; 0: the lowest cost wins",
    )


# The scorers that price the prompt's cached blocks (their weight follows the overlap weight)
CACHE_TERMS = frozenset({KvOverlapScorer.name, PrefillWorkScorer.name})


@register
class CostPicker(Picker):
    """Dynamo's selection over the scorers' summed cost: temperature 0 = argmin (ties go to
    the least booked decode load, then fewest requests, then random); T > 0 = softmax
    sampling over normalised costs.

    `home_margin` is hysteresis for conversations: the cost is an estimate made from a fleet
    state that changes within a prefill, and a follow-up that leaves its history's worker to
    save a few percent of its wait recomputes that history elsewhere and leaves its next turns
    two places to be cached. With a margin m it moves only when the move saves over m of its
    estimated cost at home. A prompt no slot holds more of than all others (a first turn over a
    shared system prompt, a new document) has no home and takes the lowest cost."""

    name = "kv"
    Parameters = CostParameters
    parameters: CostParameters

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        assert c.cost is not None  # the router scores before it picks
        temperature = ctx.config.temperature
        if temperature > 0 and len(at) > 1:
            return int(at[softmax_sample(c.cost[at].tolist(), temperature, ctx.rng)])
        best = least(ctx, at, c.cost, c.booked_decode, c.requests)
        margin = self.parameters.home_margin
        if margin and ctx.phase != Phase.DECODE and len(at) > 1:
            home = home_slot(c, at, best)
            if (
                home is not None
                and c.cost[best] > (1 - margin) * c.cost[home]
                and weighs_the_cache(ctx)
            ):
                return home
        return best


def weighs_the_cache(ctx: Context) -> bool:
    """Whether this request's cost counts cached blocks at all (a request weighing the overlap
    at 0, Dynamo's overlap_score_weight, asks for load alone: no worker is its home)."""
    return any(ref.weight > 0 and ref.type in CACHE_TERMS for ref in ctx.config.scorers)


def home_slot(c: Candidates, at: np.ndarray, best: int) -> int | None:
    """The position in `at` with more of the prompt stored than every other, when that is not
    `best` (the usual case, settled by one max); else None. Blocks only a prefill under way
    holds (`booked_prefix_hits`) make no home: a first turn following its system prompt's
    first prefill is not a conversation coming back."""
    stored = c.stored[at]
    most = stored.max()
    if most == 0 or c.stored[best] == most:
        return None
    top = np.flatnonzero(stored == most)
    return int(at[top[0]]) if len(top) == 1 else None


def softmax_sample(costs: Sequence[float], temperature: float, rng: random.Random) -> int:
    """Index drawn with probability ∝ exp(-normalised cost / T); costs normalised to [0, 1]."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return rng.randrange(len(costs))
    weights = [math.exp(-((c - lo) / (hi - lo)) / temperature) for c in costs]
    return rng.choices(range(len(costs)), weights=weights)[0]


@register
class RoundRobinPicker(Picker):
    """Each phase cycles through the eligible slots in (worker id, rank) order."""

    name = "round-robin"

    def __init__(self, parameters: BaseModel | None = None) -> None:
        super().__init__(parameters)
        self._next: dict[Phase, int] = {}

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        ordered: list[int] = sorted(at.tolist(), key=c.fleet.slots.__getitem__)
        i = self._next.get(ctx.phase, 0)
        self._next[ctx.phase] = i + 1
        return ordered[i % len(ordered)]


@register
class RandomPicker(Picker):
    name = "random"

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        return int(at[ctx.rng.choice(range(len(at)))])


@register
class LeastLoadedPicker(Picker):
    """Fewest booked requests (then booked blocks, then random); ignores the KV cache."""

    name = "least-loaded"

    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        return least(ctx, at, c.requests.astype(np.float64), c.booked_decode, c.requests)
