"""From an HTTP request to a routing decision: the EPP's pickers (used by `extproc.Exchange`).

- `KvPicker`: parse the OpenAI body, check the model, tokenize with the model's tokenizer
  (`protocol.tokenization.request_tokens`), hash blocks with the fleet's block size from
  `/v1/engine` (`protocol.hashing.block_hash_array`), ask the router core, and turn its decision
  into the destination endpoint and the routing headers. A `model` that names a LoRA adapter
  some worker serves (`protocol.engine.served_models`) is hashed under the adapter's name and
  routed only to workers serving it (the router core's `lora` filter).
- `RandomPicker`: a random ready endpoint without reading the body: GAIE's behaviour for
  header-only requests, and the pure-protocol floor of `dynamograph bench epp`.

Both keep a small view of the workers (endpoint, models, tokenizer) refreshed by discovery
events, so a pick never walks the discovery tables.
"""

import logging
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from dynamograph.protocol.engine import EngineConfig, Role, lora_for_model, served_models
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.headers import routing_header_values
from dynamograph.protocol.nvext import NvExtError, parse_nvext
from dynamograph.protocol.openai import OpenAIError, parse_json_body, require_model
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.tokenization import Tokenizer, get_tokenizer, request_tokens
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.scheduler import (
    NoEligibleWorker,
    Overloaded,
    Router,
    RouteRequest,
    WorkerState,
)

from .extproc import Refusal, Route

log = logging.getLogger(__name__)


def tokenizer_spec(identity: str) -> str:
    """A worker's tokenizer identity as a `get_tokenizer` spec (`hf:<path>` → `<path>`)."""
    return identity.removeprefix("hf:")


@dataclass(frozen=True, slots=True)
class _Worker:
    instance_id: int
    endpoint: str | None
    role: Role
    models: frozenset[str]
    tokenizer: str


class WorkerView:
    """The picker's copy of the fleet, kept current by discovery listener calls."""

    def __init__(self) -> None:
        self.workers: dict[int, _Worker] = {}
        self.by_endpoint: dict[str, int] = {}
        self.tokenizer_by_model: dict[str, str] = {}
        self.lora_by_model: dict[str, str | None] = {}  # served name → None, adapter → itself
        self._configs: dict[int, EngineConfig] = {}

    def added(self, record: WorkerRecord) -> None:
        config = record.config
        self._configs[record.instance_id] = config
        self.workers[record.instance_id] = _Worker(
            record.instance_id,
            record.serving_endpoint,
            config.role,
            frozenset(served_models([config])),
            tokenizer_spec(config.tokenizer),
        )
        self._reindex()

    def removed(self, record: WorkerRecord) -> None:
        self._configs.pop(record.instance_id, None)
        if self.workers.pop(record.instance_id, None) is not None:
            self._reindex()

    def _reindex(self) -> None:
        self.by_endpoint = {w.endpoint: i for i, w in self.workers.items() if w.endpoint}
        self.tokenizer_by_model = {m: w.tokenizer for w in self.workers.values() for m in w.models}
        self.lora_by_model = served_models(self._configs.values())

    def allowed_ids(self, subset: frozenset[str] | None) -> frozenset[int] | None:
        """Instance ids of the workers in a GAIE subset hint; None = no hint. An empty or
        unmatched hint refuses the request (the gateway allows nothing we can serve)."""
        if subset is None:
            return None
        ids = frozenset(self.by_endpoint[e] for e in subset if e in self.by_endpoint)
        if not ids:
            raise Refusal(
                503,
                "no ready worker is in the gateway's endpoint subset "
                f"({', '.join(sorted(subset)) or 'empty subset'})",
            )
        return ids


def _ready(state: WorkerState | None) -> bool:
    return state is not None and state.ready


class RandomPicker:
    """Any ready serving endpoint, body unread (GAIE header-only routing; the protocol floor)."""

    def __init__(self, view: WorkerView, router: Router | None = None):
        self.view = view
        self.router = router

    def pick_any(self, subset: frozenset[str] | None) -> Route:
        allowed = self.view.allowed_ids(subset)
        states = self.router.workers() if self.router is not None else None  # one copy a pick
        candidates = [
            w
            for w in self.view.workers.values()
            if w.endpoint
            and (allowed is None or w.instance_id in allowed)
            and (states is None or _ready(states.get(w.instance_id)))
        ]
        if not candidates:
            raise Refusal(503, "no ready worker with a serving endpoint; check the worker pods")
        worker = random.choice(candidates)
        return Route(endpoint=worker.endpoint, headers={}, worker_id=worker.instance_id)

    def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Route:
        return self.pick_any(subset)


class KvPicker:
    """KV-aware routing through the router core."""

    def __init__(self, router: Router, view: WorkerView):
        self.router = router
        self.view = view
        self._random = RandomPicker(view, router)

    def pick_any(self, subset: frozenset[str] | None) -> Route:
        return self._random.pick_any(subset)

    def load_tokenizer(self, spec: str) -> Tokenizer:
        """The tokenizer a worker names, fast (a router encodes every prompt); call it off the
        event loop when a worker appears, so the first request does not pay for loading it."""
        return get_tokenizer(spec, fast=True)

    def pick(
        self, path: str, headers: Mapping[str, str], body: bytes, subset: frozenset[str] | None
    ) -> Route:
        request = parse_json_body(body)
        model = require_model(request)
        lora_name = lora_for_model(model, self.view.lora_by_model)  # 404 when nobody serves it
        tokenizer = self.load_tokenizer(self.view.tokenizer_by_model[model])
        tokens = request_tokens(tokenizer, path, request)
        block_size = self.router.block_size
        if block_size is None:
            raise Refusal(503, "no workers registered yet; the EPP is still discovering them")
        try:
            nvext = parse_nvext(request.get("nvext"))
        except NvExtError as exc:
            raise OpenAIError(400, str(exc), param="nvext") from None
        hints = nvext.agent_hints if nvext is not None else None
        route_request = RouteRequest(
            request_id=headers.get("x-request-id") or uuid.uuid4().hex,
            block_hashes=block_hash_array(tokens, block_size, lora_name),
            isl_tokens=len(tokens),
            lora_name=lora_name,
            pins=RoutePins.from_nvext(nvext),
            session=nvext.session_control if nvext is not None else None,
            allowed_ids=self.view.allowed_ids(subset),
            expected_output_tokens=hints.osl if hints is not None else None,
        )
        try:
            decision = self.router.schedule(route_request)
        except Overloaded as exc:
            raise Refusal(429, exc.reason, retry_after_s=exc.retry_after_s) from None
        except NoEligibleWorker as exc:
            raise Refusal(503, exc.reason) from None
        decode, prefill = decision.decode, decision.prefill
        worker = self.view.workers.get(decode.worker_id)
        if worker is None or not worker.endpoint:
            if decision.guard is not None:
                decision.guard.free()
            raise Refusal(
                503, f"worker {decode.worker_id} has no serving endpoint (is it a prefill worker?)"
            )
        cached = (prefill or decode).overlap_blocks * block_size
        return Route(
            endpoint=worker.endpoint,
            headers=routing_header_values(
                decode.worker_id,
                decode.dp_rank,
                prefill.worker_id if prefill else None,
                prefill.dp_rank if prefill else None,
            ),
            guard=decision.guard,
            worker_id=decode.worker_id,
            prompt_tokens=len(tokens),
            predicted_cached_tokens=min(cached, len(tokens)),
        )
