"""Mooncake-format traces: loading, prompt synthesis, inherent reuse and time compression, and a
generated fan-out workload in the same format.

A trace line is `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}`
where every hash id stands for 512 prompt tokens and equal ids mean an equal prefix (the ids
are remapped prefix hashes: an id always follows the same predecessor). The last id may cover
fewer than 512 tokens, so `input_length` decides how much of it is used.

Prompts are synthesised so that equal ids give equal tokens: block `id` is 512 tokens drawn by
a generator seeded with the id, from a vocabulary of words that are each ONE token of the
serving tokenizer (" word", a leading space and lowercase letters). Tokenizers split text into
pre-tokens at every such word boundary, so the text of a prompt tokenizes back to exactly the
synthesised ids — the same tokens reach every router (sglang-router and vllm-router route on
text; our EPP tokenizes it) and every engine.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

TOKENS_PER_HASH_ID = 512
DEFAULT_TRACE = Path("../shared/traces/mooncake_synthetic_trace.jsonl")  # from the repo root
REPO_ROOT = Path(__file__).resolve().parents[1]
_WORD = re.compile(r" [a-z]{3,10}")
_VOCAB_SIZE = 4096  # words drawn from; plenty for distinct blocks, cheap to build


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_lengths(self) -> list[int]:
        """Tokens each hash id contributes (512, except maybe the last)."""
        n = len(self.hash_ids)
        return [
            min(TOKENS_PER_HASH_ID, self.input_length - TOKENS_PER_HASH_ID * i) for i in range(n)
        ]


class TraceError(ValueError):
    pass


def parse_line(line: str | bytes, lineno: int = 0) -> TraceRequest:
    try:
        row = orjson.loads(line)
        request = TraceRequest(
            timestamp_ms=float(row["timestamp"]),
            input_length=int(row["input_length"]),
            output_length=int(row["output_length"]),
            hash_ids=tuple(int(h) for h in row["hash_ids"]),
        )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceError(
            f"trace line {lineno}: expected a JSON object with timestamp, input_length, "
            f"output_length and hash_ids ({exc})"
        ) from None
    n = len(request.hash_ids)
    if request.input_length <= 0 or request.output_length <= 0:
        raise TraceError(f"trace line {lineno}: input_length and output_length must be positive")
    if not (n - 1) * TOKENS_PER_HASH_ID < request.input_length <= n * TOKENS_PER_HASH_ID:
        raise TraceError(
            f"trace line {lineno}: {n} hash ids cover {n * TOKENS_PER_HASH_ID} tokens at "
            f"{TOKENS_PER_HASH_ID} per id, which does not fit input_length {request.input_length}"
        )
    return request


def resolve_trace(path: Path) -> Path:
    """`path` as given, else (when relative) relative to the repository root."""
    path = Path(path)
    if path.is_file() or path.is_absolute():
        return path
    beside_repo = REPO_ROOT / path
    return beside_repo if beside_repo.is_file() else path


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace (the first `limit` requests), sorted by timestamp."""
    path = resolve_trace(path)
    if not path.is_file():
        raise TraceError(
            f"no trace at {path}: pass --trace PATH (the repo expects "
            f"{DEFAULT_TRACE} relative to its root)"
        )
    requests = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            requests.append(parse_line(line, lineno))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def inherent_reuse(requests: Iterable[TraceRequest]) -> float:
    """Fraction of input tokens whose prefix an earlier request already had (infinite cache).

    One pool, unbounded memory, prefix semantics: a request reuses the leading run of its
    hash ids that any earlier request carried, token-exact for a partial last id (a shorter
    earlier use of an id only covers as many tokens as it had). The ceiling for any router's
    prefix hit rate on this trace.
    """
    longest: dict[int, int] = {}  # hash id -> most tokens of it any request has held
    hit = total = 0
    for request in requests:
        matching = True
        for hash_id, length in zip(request.hash_ids, request.block_lengths(), strict=True):
            held = longest.get(hash_id, 0)
            if matching:
                hit += min(held, length)
                matching = held >= length
            if length > held:
                longest[hash_id] = length
        total += request.input_length
    return hit / total if total else 0.0


def sample_families(
    requests: Sequence[TraceRequest], fraction: float, seed: int = 0
) -> list[TraceRequest]:
    """Keep a seeded `fraction` of prefix families, whole, over the trace's full time span.

    Requests can only share a prefix when they share their first hash id, so families by
    first id are independent: keeping whole families keeps every reuse relation (and so the
    inherent reuse) of the kept requests, where cutting a time window would lose the prefixes
    made before it. Arrival rate drops by about `fraction`.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"family fraction must be in (0, 1], got {fraction}")
    roots = sorted({r.hash_ids[0] for r in requests if r.hash_ids})
    rng = np.random.default_rng(seed)
    keep = set(rng.permutation(roots)[: max(1, round(fraction * len(roots)))].tolist())
    return [r for r in requests if r.hash_ids and r.hash_ids[0] in keep]


def fanout_trace(
    groups: int = 60,
    size: int = 8,
    context_ids: int = 40,
    interval_ms: float = 1000.0,
    output_length: int = 50,
    seed: int = 0,
) -> list[TraceRequest]:
    """A fan-out workload in the trace's format: every `interval_ms` a group of `size` requests
    arrives within 50 ms, all over one new context of `context_ids` hash ids (40: 20,480
    tokens, an agent's shared document or history) followed by a question of their own (100–500
    tokens). Nothing is shared between groups, so the reusable part is each group's context
    after its first request; whether it is computed once or once per worker is the router's
    doing. Seeded, sorted by arrival."""
    if groups < 1 or size < 1 or context_ids < 1 or interval_ms <= 0 or output_length < 1:
        raise ValueError("fan-out: groups, size, context_ids, output_length ≥ 1, interval > 0")
    rng = np.random.default_rng(seed)
    requests = []
    next_id = 0
    for g in range(groups):
        context = tuple(range(next_id, next_id + context_ids))
        next_id += context_ids
        for _ in range(size):
            question = int(rng.integers(100, 501))
            requests.append(
                TraceRequest(
                    timestamp_ms=g * interval_ms + float(rng.integers(0, 51)),
                    input_length=context_ids * TOKENS_PER_HASH_ID + question,
                    output_length=output_length,
                    hash_ids=(*context, next_id),
                )
            )
            next_id += 1
    requests.sort(key=lambda r: r.timestamp_ms)
    return requests


def compress(requests: Sequence[TraceRequest], factor: float) -> list[float]:
    """Arrival offsets in seconds from the first request, the trace's time divided by `factor`."""
    if factor <= 0:
        raise ValueError(f"time compression factor must be positive, got {factor}")
    if not requests:
        return []
    start = requests[0].timestamp_ms
    return [(r.timestamp_ms - start) / 1000.0 / factor for r in requests]


class PromptSynthesizer:
    """Deterministic prompts for trace requests: equal hash ids give equal tokens and text."""

    def __init__(self, tokenizer):
        self._ids, self._words = _single_token_words(tokenizer)

    @functools.lru_cache(maxsize=16_384)  # noqa: B019 - one synthesizer per run, bounded
    def _block_choice(self, hash_id: int) -> np.ndarray:
        rng = np.random.default_rng([hash_id, 0x6D6F6F6E])  # seed: the id (and a salt)
        return rng.integers(0, len(self._ids), TOKENS_PER_HASH_ID)

    def tokens(self, request: TraceRequest) -> np.ndarray:
        """The request's prompt token ids (u32), exactly `input_length` of them."""
        parts = [
            self._ids[self._block_choice(h)[:n]]
            for h, n in zip(request.hash_ids, request.block_lengths(), strict=True)
        ]
        return np.concatenate(parts).astype("<u4", copy=False)

    @functools.lru_cache(maxsize=16_384)  # noqa: B019
    def _block_text(self, hash_id: int) -> tuple[str, np.ndarray]:
        words = self._words[self._block_choice(hash_id)]
        ends = np.cumsum([len(w) for w in words])
        return "".join(words), ends

    def text(self, request: TraceRequest) -> str:
        """The prompt as text; the serving tokenizer turns it back into `tokens(request)`."""
        parts = []
        for h, n in zip(request.hash_ids, request.block_lengths(), strict=True):
            text, ends = self._block_text(h)
            parts.append(text[: ends[n - 1]])
        return "".join(parts)


def _single_token_words(tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (and their text) of words that are one token of `tokenizer`, lowest ids first."""
    ids: list[int] = []
    words: list[str] = []
    for token_id in range(min(tokenizer.vocab_size, 200_000)):
        try:
            text = tokenizer.decode([token_id])
        except Exception:  # ids a vocabulary leaves unused (special or reserved ranges)
            continue
        if not _WORD.fullmatch(text):
            continue
        if tokenizer.encode(text).tolist() != [token_id]:
            continue
        ids.append(token_id)
        words.append(text)
        if len(ids) == _VOCAB_SIZE:
            break
    if len(ids) < 256:
        raise ValueError(
            f"tokenizer {tokenizer.identity} has only {len(ids)} single-token words; "
            "cannot synthesise prompts from it"
        )
    return np.asarray(ids, dtype="<u4"), np.asarray(words, dtype=object)
