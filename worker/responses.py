"""OpenAI request → `GenerateRequest`, and engine outputs → OpenAI response bodies (pure logic).

The shapes follow vLLM's OpenAI server: `usage.prompt_tokens_details.cached_tokens`, a
top-level `kv_transfer_params` on responses of the disaggregated hand-off, streaming chunks
with `stream_options.include_usage` adding a final usage-only chunk, and `nvext` on the last
chunk when the client asked for `extra_fields`.
"""

import time
from typing import Any

import numpy as np

from dynamograph.protocol.nvext import NvExt, NvExtResponse, TimingInfo, WorkerIdInfo
from dynamograph.protocol.openai import CHAT_COMPLETIONS, OpenAIError

from .engine import EngineOutput, GenerateRequest, Usage
from .handoff import HandoffError, validate_params


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OpenAIError(400, f"'{key}' must be a positive integer, got {value!r:.40}", param=key)
    return value


def build_request(
    request_id: str,
    path: str,
    body: dict[str, Any],
    tokens: np.ndarray,
    nvext: NvExt | None,
    *,
    dp_rank: int | None,
    context_length: int,
    default_max_tokens: int,
    priority_scheduling: bool = True,
) -> GenerateRequest:
    """Validate the generation parameters the engine honours; 400 naming the field otherwise."""
    n = body.get("n", 1)
    if n != 1:
        raise OpenAIError(400, f"only n=1 is supported, got n={n!r:.20}", param="n")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    if max_tokens is None:
        # vLLM defaults to the rest of the context; a simulator stops after a modest answer.
        max_tokens = max(1, min(default_max_tokens, context_length - len(tokens)))
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIError(400, f"'seed' must be an integer, got {seed!r:.40}", param="seed")
    if seed is not None and not -(2**63) <= seed < 2**63:
        # vLLM's bounds (a torch long); negative seeds are valid there, and here (the sampler)
        raise OpenAIError(
            400, f"'seed' must be a 64-bit signed integer, got {str(seed)[:40]}", param="seed"
        )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise OpenAIError(400, "'stream' must be true or false", param="stream")
    try:
        kv_params = validate_params(body.get("kv_transfer_params"))
    except HandoffError as exc:
        raise OpenAIError(400, str(exc), param="kv_transfer_params") from None
    if dp_rank is None and nvext is not None:
        dp_rank = nvext.dp_rank
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise OpenAIError(
            400, f"'priority' must be an integer, got {priority!r:.40}", param="priority"
        )
    if priority and not priority_scheduling:  # vLLM's refusal, in its words
        raise OpenAIError(
            400,
            f"Got priority {priority} but Priority scheduling is not enabled.",
            param="priority",
        )
    return GenerateRequest(
        request_id=request_id,
        prompt_tokens=tokens,
        max_tokens=max_tokens,
        seed=seed,
        dp_rank=dp_rank,
        kv_transfer_params=kv_params,
        nvext=nvext,
        priority=priority,
        final_only=not stream,
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def nvext_body(
    nvext: NvExt | None,
    last: EngineOutput,
    *,
    instance_id: int,
    prefill: bool,
    received_ms: float | None = None,
) -> dict[str, Any] | None:
    """`nvext` of a response: worker ids and timing (simulated durations, wall-clock receipt)."""
    if nvext is None or not nvext.extra_fields:
        return None
    out = NvExtResponse()
    if nvext.wants("worker_id"):
        out.worker_id = (
            WorkerIdInfo(prefill_worker_id=instance_id, prefill_dp_rank=last.dp_rank)
            if prefill
            else WorkerIdInfo(decode_worker_id=instance_id, decode_dp_rank=last.dp_rank)
        )
    if nvext.wants("timing") and last.timing is not None:
        t = last.timing
        out.timing = TimingInfo(
            request_received_ms=received_ms,
            prefill_time_ms=t.prefill_time * 1e3,
            ttft_ms=None if t.ttft is None else t.ttft * 1e3,
            total_time_ms=None if t.e2e is None else t.e2e * 1e3,
            cached_tokens=last.usage.cached_tokens if last.usage else None,
            prompt_tokens=last.usage.prompt_tokens if last.usage else None,
        )
    return out.model_dump()


class ResponseBuilder:
    """Builds the body (or the SSE chunks) of one request in its endpoint's format."""

    def __init__(self, path: str, request_id: str, model: str):
        self.chat = path == CHAT_COMPLETIONS
        self.id = request_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, last: EngineOutput, extra: dict[str, Any]) -> dict[str, Any]:
        reason = last.finish_reason.value if last.finish_reason else None
        if self.chat:
            body = self._envelope("chat.completion")
            body["choices"] = [{
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": []},
                "logprobs": None,
                "finish_reason": reason,
                "stop_reason": None,
            }]  # fmt: skip
        else:
            body = self._envelope("text_completion")
            body["choices"] = [{
                "index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                "stop_reason": None,
            }]  # fmt: skip
        body["usage"] = usage_body(last.usage) if last.usage else None
        body.update(extra)
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role, as OpenAI and vLLM do."""
        if not self.chat:
            return None
        body = self._envelope("chat.completion.chunk")
        body["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}]  # fmt: skip
        return body

    def chunk(self, out: EngineOutput, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        reason = out.finish_reason.value if out.finish_reason else None
        if self.chat:
            body = self._envelope("chat.completion.chunk")
            delta = {"content": out.text} if out.text or reason is None else {}
            body["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": reason}]  # fmt: skip
        else:
            body = self._envelope("text_completion")
            body["choices"] = [{"index": 0, "text": out.text, "logprobs": None,
                                "finish_reason": reason}]  # fmt: skip
        if extra:
            body.update(extra)
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage_body(usage)
        return body
