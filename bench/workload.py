"""A multi-turn chat workload of our own: growing conversations mixed with single-shot documents.

What one run of the generator is (`generate(config, builder)`):

- **Arrivals.** A Poisson process of `rate` requests per second (the workload's clock, which
  the benchmark compresses like the Mooncake trace's) over `duration_s`. Each arrival is, with
  probability `doc_fraction`, a single-shot long **document**; otherwise it is the next turn of
  the open **session** that has been ready longest (its think time has passed), or, when no
  session is ready, the first turn of a new session. The request rate is therefore exactly the
  configured Poisson rate from the first second (no ramp-up while sessions fill), and a turn's
  gap to its predecessor is its think time plus the wait for an arrival slot (sessions that
  are ready queue for slots, longest-ready first; the wait is short next to the think time).
- **Sessions.** Each plans 3–15 turns (uniform). Turn 1 is one of `system_prompts` shared
  system prompts (500–2,500 tokens; several apps' instructions, so first turns share a prefix
  across sessions) and a first user message (200–4,000 tokens, log-uniform). Turn k+1 is turn
  k's messages + the assistant's answer to turn k (the `output_tokens` the engine was asked for
  in turn k, synthesised) + a new user message (50–6,000 tokens, log-uniform: a question, or
  pasted text): the context grows every turn. A session ends after its planned turns, before
  a turn whose prompt + answer would exceed `max_context` tokens (~30k), or when the window
  closes (sessions still open then are cut short, as in any trace window;
  `WorkloadRequest.planned_turns` keeps the plan).
- **Think time** between turns: the time the answer takes at a nominal decode pace
  (`output_tokens × answer_s_per_token`) plus the user's think time (log-normal, median
  `think_median_s`). It counts from the previous turn's *arrival*: the replay is open loop, so
  a slow fleet builds a queue (a follow-up can then arrive before its predecessor's answer),
  as real traffic would, and every policy sees the same arrivals.
- **Documents.** A shared system prompt and one user message: "Summarise the following
  document." and 8,000–28,000 tokens (uniform; cut at a sentence to fit `max_context`);
  nothing else shares its text.
- **Answers** are 64–512 tokens (log-uniform) for turns, 128–512 for documents.

Text is text-like, not random ids: words drawn from the tokenizer's single-token lowercase
words (the ones `trace.PromptSynthesizer` uses), grouped into capitalised sentences of 6–18
words ending in a full stop and paragraphs of 3–6 sentences. Every request's prompt length is
the Qwen tokenizer's count of its rendered chat (`encode_chat`, ChatML; the same as tokenizing
the rendered text), not an estimate.

**Determinism.** Every random choice comes from a generator seeded with `seed` and the thing
it decides (a session's plan and text from `(seed, session)`, a document's from
`(seed, document)`, arrivals from `(seed, rate)`), so one seed gives the same bytes every time,
and the n-th session has the same plan and text at every rate of a sweep — only the arrival
times differ.

**Inherent reuse** (`inherent_reuse`): the fraction of prompt tokens in full blocks (the
engine's block size) whose whole prefix an earlier request already carried — the ceiling
for any router's prefix hit rate on these requests with one infinite cache. The synthesised
answer that turn k+1 carries is not what the engine generated in turn k, so the engine's
cached output blocks are never reused (in real serving they would be: a few % of a prompt).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .trace import _single_token_words

TURN = "turn"
DOCUMENT = "document"


@dataclass(frozen=True)
class WorkloadConfig:
    rate: float = 4.0  # requests per second (workload clock), Poisson
    duration_s: float = 180.0  # arrivals fall in [0, duration_s)
    seed: int = 0
    doc_fraction: float = 0.15  # share of arrivals that are single-shot documents
    min_turns: int = 3
    max_turns: int = 15
    max_context: int = 30_000  # no request's prompt + answer exceeds this many tokens
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (500, 2_500)
    first_user_tokens: tuple[int, int] = (200, 4_000)
    followup_tokens: tuple[int, int] = (50, 6_000)
    answer_tokens: tuple[int, int] = (64, 512)
    doc_tokens: tuple[int, int] = (8_000, 28_000)
    doc_answer_tokens: tuple[int, int] = (128, 512)
    think_median_s: float = 2.0  # the user's part of the gap between turns (log-normal)
    think_sigma: float = 0.6
    answer_s_per_token: float = 0.01  # nominal decode pace: the answer's part of the gap

    def validate(self) -> WorkloadConfig:
        if self.rate <= 0 or self.duration_s <= 0:
            raise ValueError("workload rate and duration must be positive")
        if not 0 <= self.doc_fraction <= 1:
            raise ValueError("doc_fraction must be in [0, 1]")
        if not 1 <= self.min_turns <= self.max_turns:
            raise ValueError("need 1 <= min_turns <= max_turns")
        if self.system_prompts < 1 or self.max_context < 1_000:
            raise ValueError("need at least one system prompt and max_context >= 1000")
        return self


@dataclass(frozen=True)
class WorkloadRequest:
    index: int  # position in arrival order
    arrival_s: float  # workload seconds from the start
    kind: str  # TURN or DOCUMENT
    session: int  # session id (documents: their own id, counted separately)
    turn: int  # 1-based turn number within the session (documents: 1)
    planned_turns: int  # the session's plan (documents: 1)
    gap_s: float  # since the session's previous turn arrived (first turns: 0)
    messages: tuple[dict, ...]  # OpenAI chat messages, ending with the new user message
    prompt_tokens: int  # the Qwen tokenizer's length of the rendered chat (+ generation prompt)
    output_tokens: int  # max_tokens = min_tokens of the request
    reusable_tokens: int = 0  # prompt tokens an infinite prefix cache already held (inherent)

    @property
    def follow_up(self) -> bool:
        return self.kind == TURN and self.turn > 1

    def label(self) -> dict:
        """What a per-request log needs to split metrics (first turns, follow-ups, documents)."""
        return {
            "kind": self.kind,
            "session": self.session,
            "turn": self.turn,
            "arrival_s": self.arrival_s,
            "prompt_tokens_expected": self.prompt_tokens,
            "reusable_tokens": self.reusable_tokens,
        }


@dataclass
class _Session:
    id: int
    planned: int
    system: int
    user_tokens: list[int]
    answer_tokens: list[int]
    gaps_s: list[float]  # gap before turn 2, 3, ...
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    last_arrival: float = 0.0


class WorkloadBuilder:
    """Text and token counts for a workload; one per tokenizer, reused across a sweep's rates
    (sessions and documents are the same at every rate, so their text is built once)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ids, self._words = _single_token_words(tokenizer)
        self._word_list: list[str] = self._words.tolist()  # " word": one token each
        self._capitalised = [w[0] + w[1:2].upper() + w[2:] for w in self._word_list]

    def text(self, rng: np.random.Generator, tokens: int) -> str:
        """About `tokens` tokens of sentences and paragraphs made of single-token words."""
        words = max(1, round(tokens * 12 / 13))  # a full stop every ~12 words is a token too
        vocab, capitalised = self._word_list, self._capitalised
        picks = rng.integers(0, len(vocab), words).tolist()
        # Sentence lengths and paragraph sizes drawn in bulk (enough for the shortest case).
        lengths = rng.integers(6, 19, words // 6 + 1).tolist()
        paragraphs = rng.integers(3, 7, words // 18 + 2).tolist()
        parts: list[str] = []
        i = s = p = in_paragraph = 0
        new_paragraph = True
        while i < words:
            n = min(lengths[s], words - i)
            s += 1
            first = capitalised[picks[i]]
            parts.append(first[1:] if new_paragraph else first)
            parts.extend([vocab[k] for k in picks[i + 1 : i + n]])
            i += n
            in_paragraph += 1
            new_paragraph = in_paragraph == paragraphs[p] and i < words
            if new_paragraph:
                parts.append(".\n\n")
                in_paragraph, p = 0, p + 1
            else:
                parts.append(".")
        return "".join(parts)

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a handful of configs per builder
    def system_prompts(self, seed: int, count: int, lo: int, hi: int) -> tuple[str, ...]:
        out = []
        for k in range(count):
            rng = np.random.default_rng([seed, 1, k])
            out.append(self.text(rng, int(rng.integers(lo, hi + 1))))
        return tuple(out)

    def prompt(self, messages: Sequence[dict]) -> np.ndarray:
        """The rendered chat's token ids, with the assistant generation prompt."""
        return self.tokenizer.encode_chat(list(messages), add_generation_prompt=True)

    def prompt_tokens(self, messages: Sequence[dict]) -> int:
        return len(self.prompt(messages))


def _log_uniform(rng: np.random.Generator, lo: int, hi: int) -> int:
    return round(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _plan_session(config: WorkloadConfig, sid: int) -> _Session:
    rng = np.random.default_rng([config.seed, 2, sid])
    planned = int(rng.integers(config.min_turns, config.max_turns + 1))
    user = [_log_uniform(rng, *config.first_user_tokens)]
    user += [_log_uniform(rng, *config.followup_tokens) for _ in range(planned - 1)]
    answers = [_log_uniform(rng, *config.answer_tokens) for _ in range(planned)]
    think = rng.lognormal(math.log(config.think_median_s), config.think_sigma, planned)
    gaps = [float(answers[k] * config.answer_s_per_token + think[k]) for k in range(planned - 1)]
    return _Session(
        id=sid,
        planned=planned,
        system=int(rng.integers(0, config.system_prompts)),
        user_tokens=user,
        answer_tokens=answers,
        gaps_s=gaps,
    )


def _arrivals(config: WorkloadConfig) -> tuple[np.ndarray, np.ndarray]:
    """Poisson arrival times in [0, duration) and, per arrival, whether it is a document."""
    rng = np.random.default_rng([config.seed, 3, round(config.rate * 1000)])
    expected = config.rate * config.duration_s
    gaps = rng.exponential(1.0 / config.rate, int(expected + 10 * math.sqrt(expected) + 20))
    times = np.cumsum(gaps) - gaps[0]  # the first request at t = 0
    times = times[times < config.duration_s]
    is_doc = rng.random(len(times)) < config.doc_fraction
    return times, is_doc


class _PrefixCache:
    """One infinite cache of `block_size`-token blocks, chained like an engine's prefix cache:
    a block counts as held only if every block before it was held too; partial last blocks
    never count (engines cache only full blocks)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._seen: set[int] = set()

    def offer(self, ids: np.ndarray) -> int:
        """Tokens of `ids` already held; then hold all of its full blocks."""
        size = self.block_size
        full = len(ids) // size
        blocks = np.asarray(ids[: full * size], dtype="<u4").reshape(full, size)
        parent, held, matching = 0, 0, True
        for row in blocks:
            parent = hash((parent, row.tobytes()))
            if matching and parent in self._seen:
                held += size
            else:
                matching = False
                self._seen.add(parent)
        return held


def generate(
    config: WorkloadConfig, builder: WorkloadBuilder, block_size: int = 16
) -> list[WorkloadRequest]:
    """The workload's requests in arrival order (see the module docstring); each carries the
    tokens of its prompt an infinite cache of `block_size`-token blocks already held."""
    config.validate()
    systems = builder.system_prompts(config.seed, config.system_prompts, *config.system_tokens)
    times, is_doc = _arrivals(config)
    cache = _PrefixCache(block_size)
    ready: list[tuple[float, int]] = []  # (ready at, session id): open sessions
    sessions: dict[int, _Session] = {}
    requests: list[WorkloadRequest] = []
    next_session = next_doc = 0

    def new_session() -> _Session:
        nonlocal next_session
        session = sessions[next_session] = _plan_session(config, next_session)
        session.messages = [{"role": "system", "content": systems[session.system]}]
        next_session += 1
        return session

    for t, doc in zip(times.tolist(), is_doc.tolist(), strict=True):
        if doc:
            requests.append(_document(config, builder, cache, systems, next_doc, len(requests), t))
            next_doc += 1
            continue
        ready_now = ready and ready[0][0] <= t
        session = sessions[heapq.heappop(ready)[1]] if ready_now else new_session()
        request = _next_turn(config, builder, cache, session, len(requests), t)
        if request is None:  # the context cap ended that session: a new one takes the slot
            del sessions[session.id]
            session = new_session()
            request = _next_turn(config, builder, cache, session, len(requests), t)
            if request is None:
                raise ValueError(f"max_context {config.max_context} is smaller than a first turn")
        requests.append(request)
        if session.turns < session.planned:
            heapq.heappush(ready, (t + session.gaps_s[session.turns - 1], session.id))
        else:
            del sessions[session.id]
    return requests


def _next_turn(config, builder, cache, session: _Session, index: int, t: float):
    """Turn `session.turns + 1`: the history, the previous answer, a new user message; None
    (and the session is over) when its prompt and answer would not fit `max_context`."""
    k = session.turns
    messages = list(session.messages)
    if k > 0:
        answer_rng = np.random.default_rng([config.seed, 5, session.id, k - 1])
        answer = builder.text(answer_rng, session.answer_tokens[k - 1])
        messages.append({"role": "assistant", "content": answer})
    rng = np.random.default_rng([config.seed, 4, session.id, k])
    messages.append({"role": "user", "content": builder.text(rng, session.user_tokens[k])})
    ids = builder.prompt(messages)
    if len(ids) + session.answer_tokens[k] > config.max_context:
        return None
    session.messages = messages
    session.turns = k + 1
    gap = t - session.last_arrival if k else 0.0
    session.last_arrival = t
    return WorkloadRequest(
        index=index,
        arrival_s=t,
        kind=TURN,
        session=session.id,
        turn=k + 1,
        planned_turns=session.planned,
        gap_s=gap,
        messages=tuple(messages),
        prompt_tokens=len(ids),
        output_tokens=session.answer_tokens[k],
        reusable_tokens=cache.offer(ids),
    )


DOCUMENT_ASK = "Summarise the following document.\n\n"


def _document(config, builder, cache, systems, doc: int, index: int, t: float):
    rng = np.random.default_rng([config.seed, 6, doc])
    system = systems[int(rng.integers(0, len(systems)))]
    size = min(
        int(rng.integers(config.doc_tokens[0], config.doc_tokens[1] + 1)), config.max_context
    )
    output = _log_uniform(rng, *config.doc_answer_tokens)
    body = builder.text(rng, size)
    while True:
        messages = (
            {"role": "system", "content": system},
            {"role": "user", "content": DOCUMENT_ASK + body},
        )
        ids = builder.prompt(messages)
        if len(ids) + output <= config.max_context:
            break
        if not body:
            raise ValueError(f"max_context {config.max_context} leaves no room for a document")
        # Too long with its system prompt: cut whole sentences off the end and measure again.
        keep = body[: int(len(body) * (config.max_context - output) / len(ids) * 0.98)]
        body = keep[: keep.rfind(".") + 1]
    return WorkloadRequest(
        index=index,
        arrival_s=t,
        kind=DOCUMENT,
        session=doc,
        turn=1,
        planned_turns=1,
        gap_s=0.0,
        messages=messages,
        prompt_tokens=len(ids),
        output_tokens=output,
        reusable_tokens=cache.offer(ids),
    )


def inherent_reuse(requests: Iterable[WorkloadRequest]) -> float:
    """Fraction of prompt tokens an infinite prefix cache already held (see `generate`): the
    ceiling for any router's prefix hit rate on these requests."""
    held = total = 0
    for r in requests:
        held += r.reusable_tokens
        total += r.prompt_tokens
    return held / total if total else 0.0


def session_stats(requests: Sequence[WorkloadRequest]) -> dict:
    """Counts for the run's header: requests, sessions, turns, documents, context sizes."""
    turns = [r for r in requests if r.kind == TURN]
    docs = [r for r in requests if r.kind == DOCUMENT]
    per_session: dict[int, int] = {}
    for r in turns:
        per_session[r.session] = max(per_session.get(r.session, 0), r.turn)
    prompts = sorted(r.prompt_tokens for r in requests)
    span = requests[-1].arrival_s if requests else 0.0
    return {
        "requests": len(requests),
        "sessions": len(per_session),
        "first_turns": sum(r.turn == 1 for r in turns),
        "follow_ups": sum(r.turn > 1 for r in turns),
        "documents": len(docs),
        "mean_turns_per_session": (
            sum(per_session.values()) / len(per_session) if per_session else 0.0
        ),
        "max_turn": max(per_session.values(), default=0),
        "prompt_tokens_mean": float(np.mean(prompts)) if prompts else 0.0,
        "prompt_tokens_p50": prompts[len(prompts) // 2] if prompts else 0,
        "prompt_tokens_max": prompts[-1] if prompts else 0,
        "offered_rate": len(requests) / span if span > 0 else 0.0,
    }
