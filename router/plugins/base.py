"""The plugin contract and registry: filters, scorers and pickers, registered by name.

One selection (a phase: aggregated, prefill or decode) runs
    candidates (every (worker, dp_rank) slot of the fleet, as columns: `fleet.Candidates`)
      → the hard constraints, then the configured filters, in order (each may only remove
        candidates; the first to remove the last one refuses the request with its `refusal`)
      → the configured scorers (each returns a cost column, lower is better; the router sums
        them with their weights into `Candidates.cost`)
      → the picker (chooses one position).

A plugin is a small class with a registered `name` and, when it takes settings, a pydantic
`Parameters` model; `RouterConfig` names the plugins (`filters`, `scorers` with weights,
`picker`) and `build_profile` turns it into instances, refusing unknown names and bad
parameters with a message. Adding a plugin is one class decorated with `@register` (in a module
of this folder, which `build_profile` imports, or anywhere imported before the router starts)
and one line of config.
"""

import importlib
import random
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from dynamograph.protocol.nvext import describe_validation_error
from dynamograph.protocol.router_config import PluginRef, RouterConfig

from ..errors import NoEligibleWorker, RoutingError
from ..fleet import Candidates


class Phase(StrEnum):
    AGGREGATED = "aggregated"
    PREFILL = "prefill"
    DECODE = "decode"  # the decode half of a disaggregated request


@dataclass(slots=True)
class Context:
    """One selection's inputs, shared by the plugins."""

    phase: Phase
    prompt_blocks: int
    lora_name: str | None
    allowed_ids: frozenset[int] | None
    output_blocks: int  # expected output blocks (agent_hints.osl) counted in the decode load
    config: RouterConfig  # with the request's `router_config_override` applied
    rng: random.Random
    block_size: int = 0  # the pool's KV block size (prefill blocks → tokens)
    # the scorers' weights when the request overrides them (`config.scorers` order); None:
    # the profile's own
    weights: tuple[float, ...] | None = None
    # what must fit a worker's context length: the prompt's tokens (None: the count is an
    # estimate, not checked) and those this phase may generate
    prompt_tokens: int | None = None
    max_tokens: int = 1


class NoParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Plugin:
    """A named, configurable step of a selection."""

    name: ClassVar[str]
    Parameters: ClassVar[type[BaseModel]] = NoParameters

    def __init__(self, parameters: BaseModel | None = None) -> None:
        self.parameters = parameters if parameters is not None else self.Parameters()


class Filter(Plugin):
    def mask(self, ctx: Context, c: Candidates) -> np.ndarray | None:
        """Which slots pass (a bool column); None when this request leaves every slot in."""
        raise NotImplementedError

    def reason(self, ctx: Context) -> str:
        """Why no slot is left, when this filter removed the last one."""
        raise NotImplementedError

    def refusal(self, ctx: Context, c: Candidates) -> RoutingError:
        """The error to raise when this filter removed the last candidate."""
        return NoEligibleWorker(self.reason(ctx))


class Scorer(Plugin):
    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        """A cost column over every slot (lower is better), in blocks where that makes sense."""
        raise NotImplementedError


class Picker(Plugin):
    def pick(self, ctx: Context, c: Candidates, at: np.ndarray) -> int:
        """The chosen position among `at` (the positions the filters kept, ascending)."""
        raise NotImplementedError


P = TypeVar("P", bound=type[Plugin])
KINDS: dict[type[Plugin], str] = {Filter: "filter", Scorer: "scorer", Picker: "picker"}
REGISTRY: dict[str, dict[str, type[Plugin]]] = {kind: {} for kind in KINDS.values()}


def kind_of(cls: type[Plugin]) -> str:
    for base, kind in KINDS.items():
        if issubclass(cls, base):
            return kind
    raise TypeError(f"{cls.__name__} is not a Filter, Scorer or Picker")


def register(cls: P) -> P:
    """Class decorator: make a plugin available to `RouterConfig` under its `name`."""
    registered = REGISTRY[kind_of(cls)]
    other = registered.get(cls.name)
    if other is not None and other is not cls:
        raise ValueError(f"{kind_of(cls)} {cls.name!r} is already registered ({other.__name__})")
    registered[cls.name] = cls
    return cls


def load_builtin_plugins() -> None:
    """Import every module of this folder, so their `@register` classes are known."""
    for path in sorted(Path(__file__).parent.glob("*.py")):
        if path.stem != "base":
            importlib.import_module(f"{__package__}.{path.stem}")


def make(kind: str, ref: PluginRef) -> Plugin:
    """An instance of the registered plugin `ref.type`, its parameters checked."""
    load_builtin_plugins()
    cls = REGISTRY[kind].get(ref.type)
    if cls is None:
        known = ", ".join(sorted(REGISTRY[kind])) or "none"
        raise ValueError(f"router config: unknown {kind} {ref.type!r} (registered: {known})")
    try:
        parameters = cls.Parameters.model_validate(ref.parameters)
    except ValidationError as exc:
        raise ValueError(describe_validation_error(f"{kind} {ref.type!r}", exc)) from None
    return cls(parameters)
