"""A routing profile: the plugin instances `RouterConfig` names, and how one selection runs them.

`build_profile(config)` checks every name and parameter against the registry
(`plugins.base`) and fails with a message naming what is wrong; `Profile` then filters, scores
and picks over a request's `Candidates`. The cost a picker sees is the scorers' weighted sum,
computed here and nowhere else.
"""

from dataclasses import dataclass
from typing import NoReturn, cast

import numpy as np

from dynamograph.protocol.router_config import PluginRef, RouterConfig

from .fleet import Candidates
from .plugins.base import Context, Filter, Picker, Scorer, make

# Applied to every selection, before the configured filters: without them a prefill request
# could land on a decode worker, a LoRA request on a worker without the adapter, or a long
# prompt on a worker whose context it does not fit.
HARD_CONSTRAINTS = ("role", "ready", "lora", "subset", "context")


@dataclass(frozen=True, slots=True)
class Profile:
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    cost_picker: Picker  # picks a pinned worker's rank, whatever the configured picker

    def eligible(self, ctx: Context, c: Candidates) -> np.ndarray:
        """Positions every filter keeps (ascending); refuses the request when none is left."""
        keep = None
        for f in self.filters:
            mask = f.mask(ctx, c)
            if mask is not None:
                keep = mask if keep is None else keep & mask
        at = keep.nonzero()[0] if keep is not None else np.arange(len(c.fleet))
        if not len(at):
            self._refuse(ctx, c)
        return at

    def passes_hard_constraints(self, ctx: Context, c: Candidates, position: int) -> bool:
        """Whether one slot passes the request's hard constraints (`HARD_CONSTRAINTS`, the
        first filters): what a sticky session's slot must still pass."""
        for f in self.filters[: len(HARD_CONSTRAINTS)]:
            mask = f.mask(ctx, c)
            if mask is not None and not mask[position]:
                return False
        return True

    def _refuse(self, ctx: Context, c: Candidates) -> NoReturn:
        """No candidate is left: the filter that removed the last one refuses the request."""
        keep = np.ones(len(c.fleet), bool)
        for f in self.filters:
            mask = f.mask(ctx, c)
            if mask is not None:
                keep &= mask
                if not keep.any():
                    raise f.refusal(ctx, c)
        raise AssertionError("filters kept a slot on the second pass")

    def score(self, ctx: Context, c: Candidates) -> None:
        """Fill `c.terms` (each scorer's column) and `c.cost` (their weighted sum)."""
        cost = np.zeros(len(c.fleet), np.float64)
        weights = ctx.weights
        for i, (scorer, weight) in enumerate(self.scorers):
            if weights is not None:
                weight = weights[i]
            term = scorer.score(ctx, c)
            c.terms[scorer.name] = term
            cost += weight * term
        c.cost = cost


def build_profile(config: RouterConfig) -> Profile:
    """The profile `config` names; ValueError (with what to fix) on an unknown plugin or bad
    parameters."""
    named = [ref.type for ref in config.filters]
    doubled = sorted(set(named) & set(HARD_CONSTRAINTS))
    if doubled:
        raise ValueError(
            f"router config: filters {', '.join(doubled)} always apply; remove them from `filters`"
        )
    refs = [PluginRef(type=name) for name in HARD_CONSTRAINTS] + list(config.filters)
    return Profile(
        filters=tuple(cast(Filter, make("filter", ref)) for ref in refs),
        scorers=tuple((cast(Scorer, make("scorer", ref)), ref.weight) for ref in config.scorers),
        picker=cast(Picker, make("picker", config.picker)),
        cost_picker=cast(Picker, make("picker", PluginRef(type="kv"))),
    )
