"""From an ext_proc request to a route: the EPP's endpoint pickers (used by `extproc.Exchange`).

- `KvEndpointPicker`: parse the OpenAI body and its `nvext`, route it through the router core's
  request pipeline (`router.pipeline.RequestPipeline`, the same one the frontend's kv mode
  uses), and turn the decision into the destination endpoint and the routing headers; a
  query-only request (`query_instance_id` annotation) into the answer the EPP gives itself.
  The InferenceObjective the request names (`x-gateway-inference-objective`) gives its
  priority in the router queue (`objectives.ObjectiveTable`).
- `RandomEndpointPicker`: a random ready endpoint without reading the body: GAIE's behaviour for
  header-only requests, and the pure-protocol floor of `dynamograph bench epp`.

Both keep a small view of the serving endpoints refreshed by discovery events, so a pick never
walks the discovery tables.
"""

import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from dynamograph.protocol.headers import INFERENCE_OBJECTIVE, routing_header_values
from dynamograph.protocol.nvext import NvExtError, parse_nvext
from dynamograph.protocol.openai import OpenAIError, parse_json_body
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.pipeline import RequestPipeline, query_answer
from dynamograph.router.scheduler import Router, WorkerState

from .extproc import Route
from .objectives import ObjectiveTable


@dataclass(frozen=True, slots=True)
class _Endpoint:
    instance_id: int
    endpoint: str


class EndpointView:
    """The serving endpoints of the workers, kept current by discovery listener calls."""

    def __init__(self) -> None:
        self.endpoints: dict[int, str] = {}
        self.by_endpoint: dict[str, int] = {}

    def added(self, record: WorkerRecord) -> None:
        if record.serving_endpoint:
            self.endpoints[record.instance_id] = record.serving_endpoint
        else:
            self.endpoints.pop(record.instance_id, None)
        self._reindex()

    def removed(self, record: WorkerRecord) -> None:
        if self.endpoints.pop(record.instance_id, None) is not None:
            self._reindex()

    def _reindex(self) -> None:
        self.by_endpoint = {e: i for i, e in self.endpoints.items()}

    def allowed_ids(self, subset: frozenset[str] | None) -> frozenset[int] | None:
        """Instance ids of the workers in a GAIE subset hint; None = no hint. An empty or
        unmatched hint refuses the request (the gateway allows nothing we can serve)."""
        if subset is None:
            return None
        ids = frozenset(self.by_endpoint[e] for e in subset if e in self.by_endpoint)
        if not ids:
            raise OpenAIError(
                503,
                "no ready worker is in the gateway's endpoint subset "
                f"({', '.join(sorted(subset)) or 'empty subset'})",
            )
        return ids


def _ready(state: WorkerState | None) -> bool:
    return state is not None and state.ready


class RandomEndpointPicker:
    """Any ready serving endpoint, body unread (GAIE header-only routing; the protocol floor)."""

    def __init__(self, view: EndpointView, router: Router | None = None):
        self.view = view
        self.router = router

    def pick_any(self, subset: frozenset[str] | None) -> Route:
        allowed = self.view.allowed_ids(subset)
        states = self.router.workers() if self.router is not None else None  # one copy a pick
        candidates = [
            (wid, endpoint)
            for wid, endpoint in self.view.endpoints.items()
            if (allowed is None or wid in allowed) and (states is None or _ready(states.get(wid)))
        ]
        if not candidates:
            raise OpenAIError(503, "no ready worker with a serving endpoint; check the worker pods")
        wid, endpoint = random.choice(candidates)
        return Route(endpoint=endpoint, headers={}, worker_id=wid)

    def refresh(self) -> None:
        """Nothing to bring up to date: a random pick reads no index."""

    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Route:
        return self.pick_any(subset)


class KvEndpointPicker:
    """KV-aware routing through the router core's request pipeline."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        view: EndpointView,
        objectives: ObjectiveTable | None = None,
    ):
        self.pipeline = pipeline
        self.view = view
        self.objectives = objectives or ObjectiveTable()
        self._random = RandomEndpointPicker(view, pipeline.router)

    def pick_any(self, subset: frozenset[str] | None) -> Route:
        return self._random.pick_any(subset)

    def refresh(self) -> None:
        self.pipeline.refresh()

    async def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Route:
        request = parse_json_body(body)
        try:
            nvext = parse_nvext(request.get("nvext"))
        except NvExtError as exc:
            raise OpenAIError(400, str(exc), param="nvext") from None
        routed = await self.pipeline.decide(
            path,
            request,
            request_id=headers.get("x-request-id") or uuid.uuid4().hex,
            nvext=nvext,
            allowed_ids=self.view.allowed_ids(subset),
            objective_priority=self.objectives.priority(headers.get(INFERENCE_OBJECTIVE)),
        )
        decision = routed.decision
        if routed.token_ids is not None:  # query-only: answered here, as the kv mode answers
            stream = request.get("stream") is True
            return Route(
                endpoint="",
                headers={},
                answer=query_answer(path, request, routed, stream=stream),
                answer_type="text/event-stream" if stream else "application/json",
            )
        decode, prefill = decision.decode, decision.prefill
        endpoint = self.view.endpoints.get(decode.worker_id)
        if endpoint is None:
            if decision.guard is not None:
                decision.guard.free()
            raise OpenAIError(
                503, f"worker {decode.worker_id} has no serving endpoint (is it a prefill worker?)"
            )
        return Route(
            endpoint=endpoint,
            headers=routing_header_values(
                decode.worker_id,
                decode.dp_rank,
                prefill.worker_id if prefill else None,
                prefill.dp_rank if prefill else None,
            ),
            guard=decision.guard,
            worker_id=decode.worker_id,
            prompt_tokens=routed.prompt_tokens,
            predicted_cached_tokens=routed.predicted_cached_tokens,
        )
