"""The one request pipeline: an OpenAI HTTP request → a `RouteRequest` → the router's `Decision`.

Both callers of the router core go through here, so a request is routed the same way behind the
gateway (the EPP, `epp.picker`) and without one (the frontend's `kv` mode):
1. the `model` names the base model or a LoRA adapter some worker serves (404 otherwise);
2. the prompt is tokenized with the tokenizer the workers serving that model publish at
   `/v1/engine` (`protocol.tokenization`), chat requests through their template — at most
   `RouterConfig.max_prompt_chars` characters of it: a longer prompt is routed by its prefix,
   its length estimated;
3. its full KV blocks are hashed with the pool's block size, under the adapter's name
   (`protocol.hashing`);
4. the router schedules it with the request's pins, sticky session, expected output length and
   the caller's endpoint subset; refusals become `OpenAIError`s (503; with Retry-After when
   every worker is busy).

The catalog of models and tokenizers is fed by the same worker add/remove calls as the router.
"""

import asyncio
import functools
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson

from dynamograph.protocol.engine import EngineConfig, lora_for_model, served_models
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.nvext import NvExt, NvExtResponse, WorkerIdInfo
from dynamograph.protocol.openai import CHAT_COMPLETIONS, COMPLETIONS, OpenAIError, require_model
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.tokenization import (
    Tokenizer,
    get_tokenizer,
    is_loaded,
    prompt_prefix,
    request_tokens,
)

from .errors import Overloaded, RoutingError
from .scheduler import Decision, Router, RouteRequest
from .tokenizers import TokenizerLoads
from .waiting import WaitQueue, shed

_CHARS_PER_TOKEN = 4  # English prose with a BPE vocabulary; only estimates a cut prompt's length
# Below this many characters of prompt still to encode (~4k tokens of English, ~0.1 ms of
# fastokens BPE, the router's tokenizer), the hop to the tokenizing thread and back costs more
# than tokenizing on the loop (`bench epp`, docs/epp.md "Cost per request").
INLINE_CHARS = 16384


@dataclass(slots=True)
class Routed:
    """A decision and what the caller reports about it."""

    decision: Decision
    prompt_tokens: int
    # prompt tokens the chosen worker has stored, or (booked_prefix_hits) its live requests hold
    predicted_cached_tokens: int
    # a query-only request (`query_instance_id` annotation): its prompt's token ids, to answer
    token_ids: list[int] | None = None


class RequestPipeline:
    """Turns OpenAI requests into routing decisions for one router (see the module docstring)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._configs: dict[int, EngineConfig] = {}
        self._lora_by_model: dict[str, str | None] = {}  # served name → None, adapter → itself
        self._tokenizer_by_model: dict[str, str] = {}
        # the workers' tokenizers, loaded as they appear; one that fails holds its workers back
        self.tokenizers = TokenizerLoads(router, self.load_tokenizer)
        self._thread: ThreadPoolExecutor | None = None  # tokenizes long prompts off the loop
        self._all_loaded = False  # every published tokenizer loaded (until a worker is added)
        self.preparing = 0  # requests being tokenized off the loop now
        # what brings the router's index up to date before a decision: the KV-event ingest's
        # `read_queued` (the index as fresh as the queued events; no wake-up of its own)
        self.read_events: Callable[[], None] | None = None
        # every worker busy: requests wait here, by priority (`waiting`), when configured
        config = router.config
        self.queue: WaitQueue[Routed] | None = None
        if config.queue_max_requests > 0:
            self.queue = WaitQueue(config.queue_max_requests, config.queue_timeout_s, _release)
            router.active.on_free = self.queue.wake

    # -- the workers ---------------------------------------------------------------------
    def add_engine(self, config: EngineConfig) -> bool:
        """Register a worker with the router and the catalog; False when the router refuses it
        (then it stays out of routing)."""
        if not self.router.add_engine(config):
            return False
        self._configs[config.instance_id] = config
        self._reindex()
        self._all_loaded = False
        return True

    def remove_engine(self, instance_id: int) -> None:
        if self._configs.pop(instance_id, None) is not None:
            self._reindex()
        self.router.remove_worker(instance_id)

    def _reindex(self) -> None:
        configs = self._configs.values()
        self._lora_by_model = served_models(configs)
        self._tokenizer_by_model = {
            model: config.tokenizer for config in configs for model in served_models([config])
        }

    @property
    def models(self) -> dict[str, str | None]:
        """The `model` names the registered workers serve: None for a base model, the adapter's
        name for a LoRA adapter."""
        return dict(self._lora_by_model)

    @staticmethod
    def load_tokenizer(identity: str) -> Tokenizer:
        """The tokenizer a worker publishes, fast (a router encodes every prompt). The first
        call loads it: make that call off the event loop when a worker appears."""
        return get_tokenizer(identity, fast=True)

    # -- a request -----------------------------------------------------------------------
    def route_request(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        nvext: NvExt | None = None,
        pins: RoutePins | None = None,
        allowed_ids: frozenset[int] | None = None,
    ) -> RouteRequest:
        """What the router needs to know about an OpenAI request (OpenAIError when it can't).

        A query-only request (`query_instance_id` annotation) is decided and not booked; the
        caller answers it with `query_answer` (the prompt's token ids in `Routed.token_ids`),
        calling no engine."""
        block_size = self.router.block_size
        if block_size is None:
            raise OpenAIError(503, "no workers are registered yet; they are still being discovered")
        model = require_model(body)
        lora_name = lora_for_model(model, self._lora_by_model)  # 404 when nobody serves it
        spec = self._tokenizer_by_model[model]
        if spec in self.tokenizers.held:  # failed to load: not tried again per request
            raise OpenAIError(
                503,
                f"the tokenizer of model {model!r} ({spec}) cannot be loaded; its workers are "
                "not routed to until it can (the router's log says why)",
                retry_after_s=self.router.config.retry_after_s,
            )
        tokenizer = self.load_tokenizer(spec)
        prefix, cut = prompt_prefix(path, body, self.router.config.max_prompt_chars)
        tokens = request_tokens(tokenizer, path, prefix)
        isl_tokens = len(tokens)
        if cut:
            # The prefix's last tokens (where the cut split a word, then the template's tail)
            # differ from the whole prompt's: hash only blocks clear of them.
            isl_tokens += cut // _CHARS_PER_TOKEN
            tokens = tokens[: max(len(tokens) - 2 * block_size, 0)]
        hints = nvext.agent_hints if nvext is not None else None
        query_only = nvext is not None and nvext.has_query_instance_id_annotation()
        config = None
        if nvext is not None and nvext.router_config_override is not None:
            try:
                config = self.router.config.overridden(nvext.router_config_override)
            except ValueError as exc:
                raise OpenAIError(400, str(exc), param="nvext") from None
        return RouteRequest(
            request_id=request_id,
            block_hashes=block_hash_array(tokens, block_size, lora_name),
            isl_tokens=isl_tokens,
            lora_name=lora_name,
            pins=pins if pins is not None else RoutePins.from_nvext(nvext),
            session=nvext.session_control if nvext is not None else None,
            allowed_ids=allowed_ids,
            expected_output_tokens=hints.osl if hints is not None else None,
            max_tokens=_max_tokens(body),
            isl_exact=not cut,
            query_only=query_only,
            prompt_tokens=tokens if query_only else None,
            config=config,
        )

    async def decide(
        self,
        path: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        nvext: NvExt | None = None,
        pins: RoutePins | None = None,
        allowed_ids: frozenset[int] | None = None,
        objective_priority: int = 0,
    ) -> Routed:
        """Route one request and book it (its `decision.guard` frees the booking).
        `objective_priority`: the GAIE InferenceObjective priority of the request (the EPP
        reads it; 0 when none): the queue's first order, and a negative one is sheddable — a
        429 instead of the busy 503 or a wait (`router.waiting`). A prompt with more than
        `INLINE_CHARS` characters to encode (a conversation's messages found in the tokenizer's
        segment cache do not count), or any prompt while a tokenizer is still loading, is
        tokenized and hashed on the pipeline's own thread (the tokenizers release the GIL, so
        the loop keeps serving other requests meanwhile); scheduling stays on the loop."""
        prepare = functools.partial(
            self.route_request,
            path,
            body,
            request_id=request_id,
            nvext=nvext,
            pins=pins,
            allowed_ids=allowed_ids,
        )
        if self._tokenizers_loaded() and self._chars_to_encode(path, body) <= INLINE_CHARS:
            request = prepare()
        else:
            if self._thread is None:  # one thread: the tokenizers' caches are not shared
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
            self.preparing += 1
            try:
                request = await asyncio.get_running_loop().run_in_executor(self._thread, prepare)
            finally:
                self.preparing -= 1
        queue = self.queue
        if queue is None:
            try:
                return self._attempt(request)
            except Overloaded as exc:
                busy_now = shed(exc, objective_priority) if objective_priority < 0 else exc
                raise _busy_error(busy_now) from None
        if queue.depth == 0:  # others waiting: a newcomer takes its place among them
            try:
                return self._attempt(request)
            except Overloaded as exc:
                busy = exc
        else:
            busy = Overloaded("every eligible worker is busy", self.router.config.retry_after_s)
        tier, jump = nvext.queue_order() if nvext is not None else (0, 0.0)
        try:
            return await queue.wait(
                functools.partial(self._attempt, request), tier, busy, jump, objective_priority
            )
        except Overloaded as exc:
            raise _busy_error(exc) from None

    def _chars_to_encode(self, path: str, body: Mapping[str, Any]) -> int:
        """Characters of the prompt its tokenizer has not encoded before (an upper bound)."""
        chars = prompt_chars(path, body)
        if chars <= INLINE_CHARS:
            return chars
        if chars > self.router.config.max_prompt_chars:
            return chars  # cut before tokenizing: not what the cache holds, nor worth a look
        model = body.get("model")
        spec = self._tokenizer_by_model.get(model) if isinstance(model, str) else None
        if spec is None or spec in self.tokenizers.held:
            return chars  # held: refused before tokenizing
        tokenizer = get_tokenizer(spec)  # loaded (`_tokenizers_loaded`): a dict read
        messages, prompt = body.get("messages"), body.get("prompt")
        if path == CHAT_COMPLETIONS and isinstance(messages, list):
            return tokenizer.uncached_chat_chars(messages)
        if path == COMPLETIONS and isinstance(prompt, str):
            return tokenizer.uncached_text_chars(prompt)
        return chars

    def _tokenizers_loaded(self) -> bool:
        """Whether every published tokenizer is loaded (or held, its requests refused): loading
        one takes seconds, which a request must then wait for on the tokenizing thread, not on
        the event loop."""
        if self._all_loaded:
            return True
        held = self.tokenizers.held
        self._all_loaded = all(
            is_loaded(spec) or spec in held for spec in self._tokenizer_by_model.values()
        )
        return self._all_loaded

    def schedule(self, request: RouteRequest) -> Routed:
        """Book a prepared request; the router's refusals as OpenAIErrors."""
        try:
            return self._attempt(request)
        except Overloaded as exc:
            raise _busy_error(exc) from None

    def refresh(self) -> None:
        """Bring the router's index up to date (`read_events`). Every decision does this first;
        a caller awake for another reason (the EPP after answering a response's headers, a
        kv-mode frontend once an engine has answered) calls it too, so that the next
        decision finds fewer batches left to read on its path."""
        if self.read_events is not None:
            self.read_events()

    def _attempt(self, request: RouteRequest) -> Routed:
        """`schedule`, leaving `Overloaded` (every worker busy) as it is, for the queue."""
        self.refresh()
        try:
            decision = self.router.schedule(request)
        except Overloaded:
            raise
        except RoutingError as exc:
            raise OpenAIError(exc.status, exc.reason) from None
        first_leg = decision.prefill or decision.decode
        cached = first_leg.overlap_blocks * (self.router.block_size or 0)
        token_ids = None
        if request.query_only and request.prompt_tokens is not None:
            token_ids = [int(t) for t in request.prompt_tokens]
        return Routed(decision, request.isl_tokens, min(cached, request.isl_tokens), token_ids)

    def close(self) -> None:
        """Stop the tokenizing thread (a tokenization under way finishes on its own) and the
        queue."""
        if self.queue is not None:
            self.queue.close()
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None


def prompt_chars(path: str, body: Mapping[str, Any]) -> int:
    """Characters of prompt text in a request, cheaply (string contents only; parts and token
    ids count as nothing: parts are rare, ids cost nothing to tokenize)."""
    if path == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        return sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, str) else 0


def query_answer(path: str, body: Mapping[str, Any], routed: Routed, *, stream: bool) -> bytes:
    """The answer to a query-only request (`query_instance_id` annotation, Dynamo's GAIE first
    stage), the same from the frontend's kv mode and the EPP: an OpenAI-shaped object with no
    choices whose `nvext` holds the chosen workers and the prompt's token ids; streamed, that
    object as one SSE event followed by `[DONE]`."""
    decision = routed.decision
    prefill = decision.prefill
    nvext = NvExtResponse(
        worker_id=WorkerIdInfo(
            decode_worker_id=decision.decode.worker_id,
            decode_dp_rank=decision.decode.dp_rank,
            prefill_worker_id=prefill.worker_id if prefill else None,
            prefill_dp_rank=prefill.dp_rank if prefill else None,
        ),
        token_ids=routed.token_ids,
    )
    chat = path == CHAT_COMPLETIONS
    out: dict[str, Any] = {
        "id": f"query-{time.time_ns():x}",
        "object": ("chat.completion.chunk" if stream else "chat.completion")
        if chat
        else "text_completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [],
        "nvext": nvext.model_dump(),
    }
    if not stream:
        return orjson.dumps(out)
    return b"data: " + orjson.dumps(out) + b"\n\ndata: [DONE]\n\n"


def _max_tokens(body: Mapping[str, Any]) -> int:
    """The tokens the answer may take, as the engines read them (`max_completion_tokens`, else
    `max_tokens`); 1 when neither is a positive integer (vLLM then fills the rest of the
    context, and the engine validates the value itself)."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if type(value) is int and value > 0:
            return value
    return 1


def _busy_error(exc: Overloaded) -> OpenAIError:
    message = f"{exc.reason}; retry after {exc.retry_after_s:g} s"
    return OpenAIError(exc.status, message, retry_after_s=exc.retry_after_s)


def _release(routed: Routed) -> None:
    """Free the booking of a request that left the queue as it was dispatched."""
    if routed.decision.guard is not None:
        routed.decision.guard.free()
