"""Built-in scorers. Together, with weights overlap_weight and 1, they are Dynamo's KV routing
cost: `overlap_weight · prefill_blocks + decode_blocks` (`RouterConfig`'s default profile)."""

import numpy as np
from numpy.typing import NDArray

from ..fleet import Candidates
from .base import Context, Phase, Scorer, register


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
        new_prompt: int | NDArray[np.int64] = ctx.prompt_blocks + ctx.output_blocks
        if c.held is not None:
            new_prompt = new_prompt - c.held
        return c.booked_decode + new_prompt
