"""The multi-turn workload generator: session structure, think time, sizes, determinism."""

import itertools
from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from dynamograph.bench.workload import (
    DOCUMENT,
    TURN,
    WorkloadBuilder,
    WorkloadConfig,
    _plan_session,
    generate,
    inherent_reuse,
    session_stats,
)
from dynamograph.protocol.tokenization import get_tokenizer

pytestmark = pytest.mark.unit

# Small contexts keep generation cheap; the default-sized run has its own test.
SMALL = WorkloadConfig(
    rate=3.0, duration_s=60.0, seed=7, max_context=12_000, doc_tokens=(3_000, 9_000)
)


@pytest.fixture(scope="module")
def builder():
    return WorkloadBuilder(get_tokenizer("qwen"))


@pytest.fixture(scope="module")
def small(builder):
    return generate(SMALL, builder)


def by_session(requests):
    sessions = defaultdict(list)
    for r in requests:
        if r.kind == TURN:
            sessions[r.session].append(r)
    return sessions


def test_each_turn_extends_the_previous_one(small, builder):
    sessions = by_session(small)
    assert len(sessions) > 10
    extended = 0
    for turns in sessions.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))  # in arrival order
        assert turns[0].messages[0]["role"] == "system" and turns[0].gap_s == 0.0
        for prev, cur in itertools.pairwise(turns):
            # the previous messages, the assistant's answer to them, one new user message
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
            assert cur.prompt_tokens > prev.prompt_tokens + prev.output_tokens // 2
            # token for token, the previous prompt is a prefix of this one: an infinite cache
            # holds at least every full block of it
            before, after = builder.prompt(prev.messages), builder.prompt(cur.messages)
            assert np.array_equal(after[: len(before)], before)
            assert cur.reusable_tokens >= len(before) // 16 * 16
            extended += 1
    assert extended > 30


def test_think_time_separates_turns(small):
    config = SMALL
    waits, planned_gaps, thinks = [], [], []
    for sid, turns in by_session(small).items():
        plan = _plan_session(config, sid)
        for prev, cur in itertools.pairwise(turns):
            planned = plan.gaps_s[prev.turn - 1]
            answer_part = prev.output_tokens * config.answer_s_per_token
            assert cur.gap_s == pytest.approx(cur.arrival_s - prev.arrival_s)
            assert cur.gap_s >= planned > answer_part  # never sooner than think + answer time
            waits.append(cur.gap_s - planned)
            planned_gaps.append(planned)
            thinks.append(planned - answer_part)
    # the think time is log-normal around its median; the wait for an arrival slot that
    # comes on top of it is short next to the planned gap
    assert 0.7 * config.think_median_s < np.median(thinks) < 1.4 * config.think_median_s
    assert np.median(waits) < 0.5 * np.median(planned_gaps)


def test_sessions_plan_three_to_fifteen_turns_and_end_for_a_reason(small):
    config = SMALL
    ended_by_window = ended_by_cap = complete = 0
    first_turn_times = [r.arrival_s for r in small if r.kind == TURN and r.turn == 1]
    for sid, turns in by_session(small).items():
        plan = _plan_session(config, sid)
        assert config.min_turns <= plan.planned <= config.max_turns
        assert all(r.planned_turns == plan.planned for r in turns)
        n = len(turns)
        assert n <= plan.planned
        last = turns[-1]
        ready = last.arrival_s + plan.gaps_s[n - 1] if n < plan.planned else None
        if n == plan.planned:
            complete += 1
        elif (
            last.prompt_tokens + last.output_tokens + plan.user_tokens[n] + plan.answer_tokens[n]
            > config.max_context - 50
        ):
            ended_by_cap += 1  # its next turn's prompt and answer would not have fitted
        else:
            # Still open when the window closed: a new session starts only when no open one
            # is ready, so no first turn arrived after this one was ready.
            assert not any(f > ready for f in first_turn_times)
            ended_by_window += 1
    assert complete and ended_by_window and ended_by_cap


def test_sizes_documents_and_rate(small):
    config = SMALL
    assert all(r.prompt_tokens + r.output_tokens <= config.max_context for r in small)
    assert [r.index for r in small] == list(range(len(small)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(small))
    assert all(0 <= r.arrival_s < config.duration_s for r in small)
    n = len(small)
    expected = config.rate * config.duration_s
    assert abs(n - expected) < 4 * expected**0.5  # Poisson
    docs = [r for r in small if r.kind == DOCUMENT]
    assert 0.05 < len(docs) / n < 0.3
    for d in docs:
        assert (d.turn, d.planned_turns, len(d.messages)) == (1, 1, 2)
        assert d.messages[1]["content"].startswith("Summarise the following document.")
        assert 3_000 < d.prompt_tokens <= config.max_context
    stats = session_stats(small)
    assert stats["requests"] == n and stats["documents"] == len(docs)
    assert stats["first_turns"] == stats["sessions"]
    assert stats["first_turns"] + stats["follow_ups"] + stats["documents"] == n


def test_prompt_lengths_are_the_qwen_tokenizers(small, builder):
    tok = builder.tokenizer
    picks = [small[0], next(r for r in small if r.kind == DOCUMENT)]
    picks += [r for r in small if r.turn >= 4][:2]
    for r in picks:
        text = tok.render_chat(list(r.messages), add_generation_prompt=True)
        assert len(tok.encode(text)) == r.prompt_tokens
    # text-like: capitalised sentences of lowercase words, full stops, paragraphs
    content = small[0].messages[-1]["content"]
    assert content[0].isupper() and content.endswith(".") and "  " not in content
    assert all(w.strip(".").isalpha() for w in content.split())


def test_same_seed_same_bytes_other_seed_other_bytes(small, builder):
    again = generate(SMALL, builder)
    assert [(r.arrival_s, r.messages, r.prompt_tokens, r.output_tokens) for r in again] == [
        (r.arrival_s, r.messages, r.prompt_tokens, r.output_tokens) for r in small
    ]
    other = generate(replace(SMALL, seed=8), builder)
    assert other[0].messages != small[0].messages
    assert [r.arrival_s for r in other[:20]] != [r.arrival_s for r in small[:20]]


def test_a_session_is_the_same_conversation_at_every_rate(small, builder):
    faster = generate(replace(SMALL, rate=6.0), builder)
    assert len(faster) > 1.5 * len(small)
    slow, fast = by_session(small), by_session(faster)
    assert [r.arrival_s for r in slow[0]] != [r.arrival_s for r in fast[0]]
    for sid in list(slow)[:5]:
        k = min(len(slow[sid]), len(fast[sid]))
        assert [r.messages for r in slow[sid][:k]] == [r.messages for r in fast[sid][:k]]


def test_shared_system_prompts_and_inherent_reuse(small):
    firsts = [r for r in small if r.kind == TURN and r.turn == 1]
    systems = {r.messages[0]["content"] for r in firsts}
    assert 1 < len(systems) <= SMALL.system_prompts < len(firsts)
    assert any(r.reusable_tokens > 500 for r in firsts)  # a system prompt seen before
    reuse = inherent_reuse(small)
    follow_ups = [r for r in small if r.turn > 1]
    assert inherent_reuse(follow_ups) > reuse > 0.3  # follow-ups carry their history
    assert inherent_reuse(firsts) < reuse


def test_default_sessions_grow_towards_thirty_thousand_tokens(builder):
    requests = generate(WorkloadConfig(rate=2.0, duration_s=120.0), builder)
    longest = max(r.prompt_tokens + r.output_tokens for r in requests if r.kind == TURN)
    assert 20_000 < longest <= 30_000
    assert max(r.turn for r in requests) >= 10


def test_invalid_configs_are_refused(builder):
    with pytest.raises(ValueError):
        generate(WorkloadConfig(rate=0), builder)
    with pytest.raises(ValueError):
        generate(WorkloadConfig(min_turns=5, max_turns=4), builder)
