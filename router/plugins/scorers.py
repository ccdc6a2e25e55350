"""Built-in scorers: each a cost term in KV blocks, summed with the profile's weights.

The default profile (`RouterConfig`, `ttft_scorers`) prices a worker by what it would cost
this request's time to first token, in units of one block to prefill (~512 µs on the modelled
H100, 16 tokens × 32 µs): `kv-overlap` (prefill work queued there plus this request's uncached
blocks) at weight 1, `load` (active decode blocks) at its much smaller real weight,
`kv-overflow` (blocks that do not fit) as capacity pressure, `queue-delay`, the delay its
prefill adds to the requests that will queue behind it there, and `prefill-work`, the prefill
the fleet does for it. With weights overlap_weight and 1 and no other term, `kv-overlap` and
`load` are Dynamo's cost, `overlap_weight · prefill_blocks + decode_blocks`
(`dynamo_scorers`)."""

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


def uncached_blocks(ctx: Context, c: Candidates) -> NDArray[np.int64]:
    """The request's prompt blocks each slot would prefill: those its cache does not hold
    (overlaps never exceed the prompt's hashed blocks, so ≥ 0); none for a disaggregated decode
    selection (the prefill happens elsewhere)."""
    if ctx.phase == Phase.DECODE:
        return np.zeros_like(c.overlap)
    return ctx.prompt_blocks - c.overlap


@register
class KvOverlapScorer(Scorer):
    """Prefill term: uncached prompt blocks of this request plus prefills already booked here.

    A disaggregated decode selection has none (the prefill happens elsewhere).
    """

    name = "kv-overlap"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        if ctx.phase == Phase.DECODE:
            return np.zeros_like(c.overlap)
        return uncached_blocks(ctx, c) + c.booked_prefill


@register
class QueueDelayScorer(Scorer):
    """Externality term: this request's uncached prompt blocks here times the requests waiting
    here for their first token.

    A per-request TTFT alone moves a conversation off the worker holding its history whenever
    that worker's queue is longer than the history's re-prefill; each such move is faster for
    the one request, but the prefill it adds delays every later arrival there, and when the
    whole fleet queues the moves pile up work until it saturates. The requests that will wait
    behind this prefill are counted as those waiting there now (in steady state the next
    arrivals find about that many), so the term is 0 on an idle worker (moving there costs no
    one) and grows with the queue: under load a conversation stays where its KV is unless its
    worker's queue outweighs the extra work it would make the fleet do."""

    name = "queue-delay"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        return uncached_blocks(ctx, c) * c.unanswered


@register
class PrefillWorkScorer(Scorer):
    """Fleet-work term: this request's uncached prompt blocks here, the prefill the fleet does
    for it wherever it runs; on a worker without its prefix that includes recomputing what
    another worker already holds. Only stored blocks count as held here. Its weight prices a block of the fleet's work against a
    block of this request's wait: with weight λ a request leaves the worker holding its prefix
    only when the wait it saves is over (1 + λ) times the blocks it would recompute. A prompt
    no worker holds costs the same everywhere, so the term moves only requests with a prefix.

    Why the fleet's work counts: a move is faster for the one request, but the history it
    prefills again lengthens the queue of everything that arrives after it, there and (by the
    load it shifts) elsewhere; counting each request's own TTFT alone, conversations left
    their workers whenever a long document was prefilling there."""

    name = "prefill-work"

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        # Blocks a prefill under way there holds (`booked_prefix_hits`) shorten the wait, not
        # the work saved: a prefix many requests share (a system prompt) is worth its copy on
        # a second worker, and weighing them here kept first turns queueing behind it.
        if ctx.phase == Phase.DECODE:
            return np.zeros_like(c.stored)
        return ctx.prompt_blocks - c.stored


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
