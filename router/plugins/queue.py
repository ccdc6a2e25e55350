"""The `queue` scorer: engines with requests waiting cost more (GAIE's queue scorer, in blocks).

Also the worked example of adding a plugin (docs/router.md): one class, registered by name,
with its own parameters; `scorers: [..., {type: queue, weight: 1, parameters: {...}}]` uses it.
"""

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..fleet import Candidates
from .base import Context, Scorer, register


class QueueParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    blocks_per_request: float = Field(
        default=16.0, ge=0, description="cost, in KV blocks, of each request waiting on the slot"
    )


@register
class QueueScorer(Scorer):
    """Scraped `vllm:num_requests_waiting` per slot, times `blocks_per_request`."""

    name = "queue"
    Parameters = QueueParameters
    parameters: QueueParameters

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        return self.parameters.blocks_per_request * c.fleet.waiting
