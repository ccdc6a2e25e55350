"""Traffic the e2e scenarios drive through a gateway, and what the replies say about routing.

`chat_body` asks for `nvext.extra_fields: ["worker_id"]`, so each reply names the decode (and,
disaggregated, prefill) worker the frontend sidecar actually called. The client sends no routing
headers and no worker ids: a direct-mode frontend refuses a request that names no worker, so a
successful reply is itself proof that the endpoint picker's routing headers reached the frontend.
"""

import asyncio
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

# A fixed vocabulary keeps prompts deterministic and tokenizer-friendly (common English words
# tokenize to about one token each, so N words ≈ N tokens ≈ N/16 KV blocks).
_WORDS = [
    "river",
    "stone",
    "garden",
    "window",
    "silver",
    "orange",
    "market",
    "winter",
    "bridge",
    "candle",
    "forest",
    "harbor",
    "lantern",
    "meadow",
    "pepper",
    "rocket",
    "saddle",
    "temple",
    "valley",
    "walnut",
    "yellow",
    "anchor",
    "butter",
    "copper",
    "desert",
    "engine",
    "feather",
    "guitar",
    "hammer",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "marble",
    "needle",
    "pillow",
    "quartz",
    "ribbon",
    "shadow",
    "ticket",
    "velvet",
    "wagon",
    "zebra",
    "basket",
    "cactus",
    "dragon",
    "falcon",
    "glacier",
    "helmet",
    "insect",
    "jungle",
    "koala",
]


@dataclass(frozen=True)
class Reply:
    status: int
    text: str
    body: dict[str, Any] | None = None
    decode_worker: int | None = None
    prefill_worker: int | None = None


@dataclass
class PromptFamily:
    """Prompts sharing one long prefix: the first seeds the KV cache, the rest should follow it."""

    prefix: str
    suffixes: list[str] = field(default_factory=list)

    def prompts(self) -> list[str]:
        return [f"{self.prefix} {s}" for s in self.suffixes]


def prompt_families(count: int, *, prefix_words: int = 240, variants: int = 3, seed: int = 7):
    """`count` families whose prefixes differ from the first word on (no shared blocks)."""
    rng = random.Random(seed)
    families = []
    for i in range(count):
        words = [f"topic{i}"] + [rng.choice(_WORDS) for _ in range(prefix_words)]
        suffixes = [
            f"Question {j}: what comes after {rng.choice(_WORDS)}?" for j in range(variants)
        ]
        families.append(PromptFamily(" ".join(words), suffixes))
    return families


def chat_body(model: str, prompt: str, *, max_tokens: int = 4, stream: bool = False) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "nvext": {"extra_fields": ["worker_id"]},
    }


def parse_reply(status: int, raw: bytes) -> Reply:
    """Read the worker ids out of a (non-streaming) chat completion; tolerate error bodies."""
    text = raw.decode(errors="replace")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return Reply(status, text)
    if not isinstance(body, dict):
        return Reply(status, text)
    ids = ((body.get("nvext") or {}).get("worker_id")) or {}
    return Reply(
        status,
        text,
        body,
        decode_worker=_int_or_none(ids.get("decode_worker_id")),
        prefill_worker=_int_or_none(ids.get("prefill_worker_id")),
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | str) and str(value).isdigit() else None


async def _post_chat(
    session: aiohttp.ClientSession, base_url: str, body: dict, request_timeout: float
) -> tuple[int, bytes]:
    async with session.post(
        f"{base_url}/v1/chat/completions",
        data=orjson.dumps(body),
        headers={"content-type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=request_timeout),
    ) as response:
        return response.status, await response.read()


async def chat(
    session: aiohttp.ClientSession, base_url: str, body: dict, *, request_timeout: float = 60.0
) -> Reply:
    return parse_reply(*await _post_chat(session, base_url, body, request_timeout))


async def chat_stream(
    session: aiohttp.ClientSession, base_url: str, body: dict, *, request_timeout: float = 60.0
) -> tuple[int, list[bytes]]:
    """A streamed chat completion: the status and its SSE `data:` payloads, in order."""
    status, raw = await _post_chat(session, base_url, {**body, "stream": True}, request_timeout)
    events = [
        line[len(b"data:") :].strip() for line in raw.splitlines() if line.startswith(b"data:")
    ]
    return status, events


async def run_families(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    families: list[PromptFamily],
) -> list[list[Reply]]:
    """Send every family's prompts round by round: all first prompts, then all second ones, ...

    Interleaving the families gives each engine's KV events time to reach the picker before
    that family's next prompt arrives, without any fixed sleep.
    """
    replies: list[list[Reply]] = [[] for _ in families]
    rounds = max(len(f.suffixes) for f in families)
    for r in range(rounds):
        for i, family in enumerate(families):
            if r < len(family.suffixes):
                prompt = family.prompts()[r]
                replies[i].append(await chat(session, base_url, chat_body(model, prompt)))
    return replies


def affinity_breaks(
    replies: list[list[Reply]], worker_of: Callable[[Reply], int | None]
) -> list[str]:
    """Families whose prompts did not all land on the worker that served the first one."""
    breaks = []
    for i, family in enumerate(replies):
        workers = [worker_of(r) for r in family]
        if None in workers or len(set(workers)) != 1:
            breaks.append(f"family {i}: workers {workers}")
    return breaks


def failures(replies: Iterable[Reply]) -> list[str]:
    return [f"{r.status}: {r.text[:300]}" for r in replies if r.status != 200]


async def send_until(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    done: Callable[[Reply], bool],
    *,
    max_requests: int = 60,
    concurrency: int = 4,
    max_tokens: int = 16,
) -> list[Reply]:
    """Send distinct prompts, `concurrency` at a time, until a reply satisfies `done` or the
    budget runs out; returns every reply (the caller asserts on them)."""
    replies: list[Reply] = []
    sent = 0
    while sent < max_requests:
        batch = min(concurrency, max_requests - sent)
        bodies = [
            chat_body(
                model,
                f"request {sent + k}: tell me about the {_WORDS[(sent + k) % len(_WORDS)]}",
                max_tokens=max_tokens,
            )
            for k in range(batch)
        ]
        sent += batch
        results = await asyncio.gather(*(chat(session, base_url, b) for b in bodies))
        replies.extend(results)
        if any(done(r) for r in results):
            break
    return replies


def metric_sum(text: str, sample: str, **labels: str) -> float:
    """Sum of a Prometheus sample (e.g. `..._total`) over series matching `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as response:
        response.raise_for_status()
        return await response.text()


def epp_ready_workers(text: str) -> dict[str, int]:
    """Role -> ready workers the EPP knows, from its `dynamograph_epp_workers` gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "dynamograph_epp_workers" and s.labels.get("ready") == "true" and s.value:
                out[s.labels["role"]] = out.get(s.labels["role"], 0) + int(s.value)
    return out
