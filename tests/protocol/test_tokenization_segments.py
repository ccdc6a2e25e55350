"""The Qwen tokenizer's segment cache, and the chunks it cuts long text into, are bit-exact with
encoding the whole text at once."""

import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.protocol.tokenization import QwenTokenizer, SegmentCache, get_tokenizer

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

_PIECES = [
    "The router indexes its own content hash, never the engine's. ",
    "def f(x):\n    return x * 2\n\n",
    "日本語のテキストと émigré café ",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "   \n\t  ",
    "12345678901234567890 ",
    "e\u0301",  # not NFC: normalized to é before encoding
]


def _reference(tokenizer: QwenTokenizer, text: str) -> np.ndarray:
    normalized = unicodedata.normalize("NFC", text)
    return tokenizer._encoding.encode_to_numpy(normalized, allowed_special="all").astype("<u4")


@pytest.mark.parametrize("seed", range(20))
def test_segmented_encoding_equals_whole_text(seed):
    tokenizer = get_tokenizer("qwen")
    rng = random.Random(seed)
    text = "".join(rng.choice(_PIECES) for _ in range(rng.randrange(20, 400)))
    expected = _reference(tokenizer, text)
    assert np.array_equal(tokenizer.encode(text), expected)
    assert np.array_equal(tokenizer.encode(text), expected)  # now from the cache


def test_chat_history_hits_the_cache(monkeypatch):
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    history = [{"role": "system", "content": "You are helpful. " * 400}]
    tokenizer.encode(tokenizer.render_chat(history))
    misses = tokenizer.segments.misses
    turn = [*history, {"role": "user", "content": "A new question."}]
    text = tokenizer.render_chat(turn)
    assert np.array_equal(tokenizer.encode(text), _reference(tokenizer, text))
    # Only the new message's text was tokenized; the system prompt came from the cache.
    assert tokenizer.segments.misses - misses <= 2
    assert tokenizer.segments.hits >= 1


# Text aimed at the chunk cuts' edges: ASCII letters around single and repeated spaces,
# contractions, digits, punctuation, newlines, non-ASCII letters and combining marks next to
# ASCII ones, tabs; CJK ideographs, kana and hangul around the CJK sentence marks, a kana
# followed by a combining sound mark (NFC composes them), a fullwidth digit, an ideograph past
# the cut ranges (U+9FFF) and one NFC replaces (U+F900).
_EDGES = st.lists(
    st.sampled_from(
        [
            *"ab Zs'tdlm ,.!?\n\t01",
            *("  ", "é", "e\u0301", "日", "ß", "\u00a0"),
            *"本，。、！？；：か\u3099カー한국１\u9fff\uf900",
        ]
    ),
    max_size=300,
).map("".join)


@pytest.mark.parametrize("vocabulary", ["qwen", "qwen:qwen3.5-27b"])
@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=_EDGES)
def test_chunked_encoding_equals_whole_text(vocabulary, text, monkeypatch):
    """Cut every few characters (both Qwen pre-tokenization patterns), the chunks' ids joined
    are the whole text's."""
    tokenizer = get_tokenizer(vocabulary)
    monkeypatch.setattr(tokenizer, "CHUNK_CHARS", 3)
    monkeypatch.setattr(tokenizer, "SEGMENT_MIN_CHARS", 0)
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    chunks = tokenizer._chunks(text)
    assert "".join(chunks) == text
    assert np.array_equal(tokenizer.encode(text), _reference(tokenizer, text))


# Text aimed at the special tokens' edges: whole ones, ones that begin like another (extra_1,
# extra_10, extra_100), their beginnings and ends cut apart, and the marker's characters alone.
_SPECIAL_EDGES = st.lists(
    st.sampled_from(
        [
            *("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|extra_1|>", "<|extra_10|>"),
            *(
                "<|extra_100|>",
                "<|extra_1",
                "0|>",
                "<|im_",
                "start|>",
                "<|",
                "|>",
                "<",
                "|",
                "a",
                " ",
            ),
        ]
    ),
    max_size=60,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_SPECIAL_EDGES)
def test_special_tokens_are_split_out_as_a_regex_alternation_would(text):
    """`_parts` finds special tokens by their first character; it splits as the regex of every
    special token, longest first (what tiktoken honours), and the ids are tiktoken's."""
    tokenizer = get_tokenizer("qwen")
    specials = sorted(tokenizer._specials, key=len, reverse=True)
    pieces = re.split("(" + "|".join(map(re.escape, specials)) + ")", text)
    expected = [(piece, bool(i % 2)) for i, piece in enumerate(pieces) if piece]
    assert tokenizer._parts(text) == (expected or [(text, False)])
    assert np.array_equal(tokenizer.encode(text * 20), _reference(tokenizer, text * 20))


def test_encoding_after_asking_its_cost_gives_the_same_ids(monkeypatch):
    """The pipeline asks what a prompt costs, then encodes the same text (the second pass reuses
    the first's split): the ids are the whole text's, and a text equal to it but new, or the
    first text again after another, is encoded alike."""
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    doc = (REPO / "docs" / "benchmarks.md").read_text()[:30_000]
    text = f"<|im_start|>user\n{doc}<|im_end|>\n<|im_start|>assistant\n"
    expected = _reference(tokenizer, text)
    assert tokenizer.uncached_text_chars(text) == len(doc) + len("user\n\nassistant\n")
    assert np.array_equal(tokenizer.encode(text), expected)
    assert tokenizer.uncached_text_chars(text) == 0
    other = f"<|im_start|>user\nWhat changed?<|im_end|>\n<|im_start|>assistant\n{doc}"
    assert np.array_equal(tokenizer.encode(other), _reference(tokenizer, other))
    assert np.array_equal(tokenizer.encode("".join([text])), expected)
    assert np.array_equal(tokenizer.encode(text[:-1] + text[-1]), expected)


def test_prose_is_cut_into_chunks_that_encode_as_the_whole(monkeypatch):
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    # the repo's prose without its tables: a table row has no space between two letters, and
    # past `_CUT_WINDOW` characters without one the chunker stops cutting (as designed)
    lines = (REPO / "docs" / "benchmarks.md").read_text().splitlines(keepends=True)
    text = "".join(line for line in lines if not line.startswith("|"))
    chunks = tokenizer._chunks(text)
    assert len(chunks) > len(text) // (2 * tokenizer.CHUNK_CHARS)
    assert all(len(c) >= tokenizer.CHUNK_CHARS for c in chunks[:-1])
    assert np.array_equal(tokenizer.encode(text), _reference(tokenizer, text))


def test_a_long_text_that_begins_like_an_earlier_one_encodes_only_where_they_part(monkeypatch):
    """One long message with a shared beginning and a new end (a document with a new question,
    the Mooncake trace's prompts): only the chunk where the texts part and what follows it are
    encoded; the rest comes from the cache, with the ids of encoding the whole."""
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    shared = (REPO / "docs" / "benchmarks.md").read_text()[:40_000]
    first, second = shared + " What changed first?", shared + " And which policy won?"
    tokenizer.encode(first)
    assert tokenizer.uncached_text_chars(first) == 0
    new = tokenizer.uncached_text_chars(second)
    assert 0 < new <= 2 * tokenizer.CHUNK_CHARS + len(" And which policy won?")
    assert np.array_equal(tokenizer.encode(second), _reference(tokenizer, second))
    assert tokenizer.uncached_text_chars(second) == 0


def _cjk_prose(seed: int, sentences: int) -> str:
    """Chinese-like text: sentences of common ideographs ended by CJK marks, no spaces."""
    rng = random.Random(seed)
    words = ["我们", "路由", "缓存", "请求", "模型", "工作", "节点", "时间", "因为", "所以"]
    marks = "，，，。！？；："
    return "".join(
        "".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) + rng.choice(marks)
        for _ in range(sentences)
    )


@pytest.mark.parametrize("vocabulary", ["qwen", "qwen:qwen3.5-27b"])
def test_cjk_prose_is_cut_at_its_sentence_marks(vocabulary, monkeypatch):
    """Chinese and Japanese have no spaces between words: their long texts are cut before the
    CJK sentence marks, and the chunks' ids are the whole text's."""
    tokenizer = get_tokenizer(vocabulary)
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    japanese = "キャッシュを持つノードへ送ります、次の質問を待ちます。" * 400
    for text in (_cjk_prose(1, 2_000), japanese, "한국어 문장입니다 " * 2_000):
        chunks = tokenizer._chunks(text)
        assert len(chunks) > len(text) // (2 * tokenizer.CHUNK_CHARS)
        assert all(c[0] in " 、。，！？；：" for c in chunks[1:])
        assert np.array_equal(tokenizer.encode(text), _reference(tokenizer, text))


def test_a_long_cjk_text_that_begins_like_an_earlier_one_encodes_only_where_they_part(
    monkeypatch,
):
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    shared = _cjk_prose(2, 8_000)  # ~120,000 characters
    first, second = shared + "第一个问题？", shared + "哪个策略更好？"
    tokenizer.encode(first)
    new = tokenizer.uncached_text_chars(second)
    assert 0 < new <= 2 * tokenizer.CHUNK_CHARS + len("哪个策略更好？") < len(second) // 4
    assert np.array_equal(tokenizer.encode(second), _reference(tokenizer, second))


def test_a_vocabulary_with_another_pattern_is_not_cut(monkeypatch):
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "_chunked", False)
    text = "word " * 2000
    assert tokenizer._chunks(text) == [text]
    assert tokenizer.uncached_text_chars(text) == len(text)


def test_no_cut_near_where_one_is_due_ends_the_cutting():
    """Words ending in digits have no space between two letters: where no cut is found within
    `_CUT_WINDOW` characters of where one is due, the rest of the text is one chunk (it is not
    searched to its end at every request)."""
    tokenizer = get_tokenizer("qwen")
    digits = "word1 " * 3000  # 18,000 characters without a cut
    assert tokenizer._chunks(digits + "plain words " * 2000) == [digits + "plain words " * 2000]
    prose = "plain words " * 2000
    assert len(tokenizer._chunks(prose + digits)) > 1
