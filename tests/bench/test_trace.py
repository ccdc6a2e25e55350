"""Trace loading, prompt synthesis and the trace's inherent reuse."""

import json
from pathlib import Path

import numpy as np
import pytest

from dynamograph.bench.trace import (
    DEFAULT_TRACE,
    TOKENS_PER_HASH_ID,
    PromptSynthesizer,
    TraceError,
    TraceRequest,
    compress,
    fanout_trace,
    inherent_reuse,
    load_trace,
    parse_line,
)
from dynamograph.protocol.tokenization import get_tokenizer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO / DEFAULT_TRACE


def req(ts, n, ids, out=4):
    return TraceRequest(float(ts), n, out, tuple(ids))


@pytest.fixture(scope="module")
def synth():
    return PromptSynthesizer(get_tokenizer("qwen"))


def test_parse_line_checks_lengths_against_hash_ids():
    ok = parse_line(
        b'{"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'
    )
    assert ok.block_lengths() == [512, 88]
    with pytest.raises(TraceError, match="does not fit input_length 1100"):
        parse_line(
            '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2]}', 7
        )
    with pytest.raises(TraceError, match="trace line 3"):
        parse_line('{"timestamp": 0}', 3)


def test_load_trace_sorts_and_limits(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 30, "input_length": 10, "output_length": 1, "hash_ids": [2]},
        {"timestamp": 10, "input_length": 10, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 20, "input_length": 10, "output_length": 1, "hash_ids": [3]},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    assert [r.timestamp_ms for r in load_trace(path)] == [10, 20, 30]
    assert [r.hash_ids for r in load_trace(path, limit=2)] == [(1,), (2,)]
    with pytest.raises(TraceError, match="no trace at"):
        load_trace(tmp_path / "missing.jsonl")


def test_equal_ids_give_equal_tokens_and_lengths_are_respected(synth):
    a = req(0, 1024 + 100, [7, 8, 9])
    b = req(1, 512 + 300, [7, 8])
    c = req(2, 512 * 2, [7, 11])
    ta, tb, tc = synth.tokens(a), synth.tokens(b), synth.tokens(c)
    assert (len(ta), len(tb), len(tc)) == (1124, 812, 1024)
    assert np.array_equal(ta[:812], tb)  # same ids: same tokens, partial last id is a prefix
    assert np.array_equal(ta[:512], tc[:512])
    assert not np.array_equal(ta[512:1024], tc[512:])  # different id: different block
    # Deterministic across synthesizers (seeded by the id, not by call order).
    again = PromptSynthesizer(get_tokenizer("qwen"))
    assert np.array_equal(again.tokens(c), tc)


def test_text_tokenizes_back_to_the_synthesised_tokens(synth):
    tok = get_tokenizer("qwen")
    for r in (req(0, 1000, [3, 4]), req(0, 37, [99]), req(0, 1536, [5, 6, 123456])):
        assert np.array_equal(tok.encode(synth.text(r)), synth.tokens(r))


def test_inherent_reuse_prefix_semantics():
    # second request reuses id 1 fully (512), then diverges: 512 of 1024.
    assert inherent_reuse([req(0, 1024, [1, 2]), req(1, 1024, [1, 3])]) == pytest.approx(512 / 2048)
    # an id seen only partially (100 tokens) covers only 100 of a later full use, and the
    # match stops there even though id 5 was seen.
    rs = [req(0, 100, [4]), req(0, 1024, [4, 5]), req(0, 1024, [4, 5])]
    assert inherent_reuse(rs) == pytest.approx((100 + 1024) / (100 + 2048))
    # a repeated id after a miss does not count: a prefix cache matches from the start.
    assert inherent_reuse([req(0, 512, [1]), req(0, 1024, [2, 1])]) == 0.0


def test_compress_divides_time_from_the_first_arrival():
    rs = [req(1000, 10, [1]), req(3000, 10, [2]), req(5000, 10, [3])]
    assert compress(rs, 4) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError):
        compress(rs, 0)


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared trace missing at {SHARED_TRACE}")
def test_synthetic_trace_inherent_reuse_is_65_percent():
    requests = load_trace(SHARED_TRACE)
    assert len(requests) == 3993
    assert requests[-1].timestamp_ms == pytest.approx(1_022_025)
    assert all(r.block_lengths()[-1] <= TOKENS_PER_HASH_ID for r in requests)
    assert inherent_reuse(requests) == pytest.approx(0.65, abs=0.005)


def test_fanout_groups_share_their_context_and_nothing_else():
    requests = fanout_trace(groups=5, size=4, context_ids=3, interval_ms=1000, seed=1)
    assert len(requests) == 20
    assert [r.timestamp_ms for r in requests] == sorted(r.timestamp_ms for r in requests)
    by_context: dict = {}
    for r in requests:
        by_context.setdefault(r.hash_ids[:3], []).append(r)
        # a valid trace row: the ids cover the prompt, the question is 100-500 tokens
        row = {"timestamp": r.timestamp_ms, "input_length": r.input_length}
        row |= {"output_length": r.output_length, "hash_ids": list(r.hash_ids)}
        assert parse_line(json.dumps(row)) == r
        assert 100 <= r.input_length - 3 * 512 <= 500
    assert len(by_context) == 5 and all(len(g) == 4 for g in by_context.values())
    for group in by_context.values():  # one group arrives within 50 ms, each a question its own
        times = [r.timestamp_ms for r in group]
        assert max(times) - min(times) <= 50
        assert len({r.hash_ids[-1] for r in group}) == 4
    # reusable: every request's context after the group's first, nothing across groups
    context_tokens = 3 * 512
    total = sum(r.input_length for r in requests)
    assert inherent_reuse(requests) == pytest.approx(5 * (4 - 1) * context_tokens / total)
    assert fanout_trace(groups=5, size=4, context_ids=3, seed=1) == requests  # seeded
    with pytest.raises(ValueError, match="fan-out"):
        fanout_trace(groups=0)
