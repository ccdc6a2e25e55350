"""Speculative prefill (`nvext.agent_hints.speculative_prefill`): the predicted next turn (pure).

After a turn of a session completes, Dynamo prefills the conversation so far — the request's
prompt followed by the answer just given — as a `max_tokens=1` request on the worker the session
is bound to, so the next turn, which starts with that prefix, finds it cached. This module turns
a finished turn into that request's body; the frontend (`Frontend._speculate`) sends it and
cancels it when the session's next turn arrives first. It runs in the frontend because the
frontend relays the answer (the endpoint picker does not read response bodies) and knows which
worker served the turn.
"""

from typing import Any

import orjson

from dynamograph.protocol.openai import CHAT_COMPLETIONS

# What of the client's body carries over: the model and what shapes the prompt's tokens
# (sampling and stream settings are the speculative request's own: one token, not streamed).
_KEPT = ("model", "chat_template_kwargs", "add_special_tokens", "add_generation_prompt")


def answer_text(path: str, chunks: list[bytes], stream: bool) -> str | None:
    """The answer's text from the engine's response (the whole JSON body, or the SSE chunks of a
    stream); None when it has none (an error, several choices, no text)."""
    chat = path == CHAT_COMPLETIONS
    try:
        if not stream:
            (choice,) = orjson.loads(b"".join(chunks))["choices"]
            text = choice["message"]["content"] if chat else choice["text"]
            return text if isinstance(text, str) else None
        parts = []
        for line in b"".join(chunks).split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices") or ():
                if choice.get("index", 0) != 0:
                    return None
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if isinstance(piece, str):
                    parts.append(piece)
        return "".join(parts)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None


def next_turn_body(path: str, body: dict[str, Any], answer: str) -> dict[str, Any] | None:
    """The speculative request: the turn's prompt followed by its answer, one token, not
    streamed, no `nvext` (the caller pins the worker); None when the prompt is not text (token
    ids, several prompts)."""
    out = {k: body[k] for k in _KEPT if k in body}
    if path == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out["messages"] = [*messages, {"role": "assistant", "content": answer}]
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        out["prompt"] = prompt + answer
    out["max_tokens"] = 1
    out["stream"] = False
    return out
