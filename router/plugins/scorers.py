"""Built-in scorers: each a cost term in KV blocks, summed with the profile's weights.

The default profile (`RouterConfig`, `ttft_scorers`) prices a worker by what it would cost
this request's time to first token, in units of one block to prefill (~512 µs on the modelled
H100, 16 tokens × 32 µs): `kv-overlap` (prefill work queued there plus this request's uncached
blocks) at weight 1, `load` (active decode blocks) at its much smaller real weight, and
`kv-overflow` (blocks that do not fit) as capacity pressure. With weights overlap_weight and 1
and no overflow term, `kv-overlap` and `load` are Dynamo's cost, `overlap_weight ·
prefill_blocks + decode_blocks` (`dynamo_scorers`)."""

import numpy as np
from numpy.typing import NDArray

from ..fleet import Candidates
from .base import Context, Phase, Scorer, register


def new_blocks(ctx: Context, c: Candidates) -> int | NDArray[np.int64]:
    """KV blocks this request would add to each slot: its prompt blocks that live requests
    there don't already hold, and its expected output."""
    blocks: int | NDArray[np.int64] = ctx.prompt_blocks + ctx.output_blocks
    if c.held is not None:
        blocks = blocks - c.held
    return blocks


@register
class KvOverlapScorer(Scorer):
    """Prefill term: uncached prompt blocks of this request plus prefills already booked here.

    A disaggregated decode selection has none (the prefill happens elsewhere).
    """

    name = "kv-overlap"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        if ctx.phase == Phase.DECODE:
            return np.zeros_like(c.overlap)
        # uncached blocks: overlaps never exceed the prompt's hashed blocks, so ≥ 0
        return (ctx.prompt_blocks - c.overlap) + c.booked_prefill


@register
class LoadScorer(Scorer):
    """Decode term: blocks of requests booked here plus the blocks this request would add
    (its prompt blocks that live requests here don't already hold, and expected output)."""

    name = "load"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        return c.booked_decode + new_blocks(ctx, c)


@register
class KvOverflowScorer(Scorer):
    """Capacity term: the blocks this request would add beyond the slot's free KV blocks (in
    use: the larger of the scraped KV usage and the blocks booked here), rounded up by one
    sequence of the slot's mean size. The engine frees blocks a sequence at a time (one ends,
    or is preempted and computed again), so a request that does not fit waits for, or
    recomputes, at least one whole sequence; 0 while it fits."""

    name = "kv-overflow"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        total = c.fleet.total_blocks
        used = c.usage() * total
        over = used + new_blocks(ctx, c) - total
        sequence = used / np.maximum(c.requests, 1)
        return np.where(over > 0, over + sequence, 0.0)
