"""The Qwen tokenizer's segment cache is bit-exact with encoding the whole text at once."""

import random
import unicodedata

import numpy as np
import pytest

from dynamograph.protocol.tokenization import QwenTokenizer, SegmentCache, get_tokenizer

pytestmark = pytest.mark.unit

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
