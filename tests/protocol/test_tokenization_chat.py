"""`QwenTokenizer.encode_chat` (ChatML segments, no rendering) gives exactly the ids of
encoding the Jinja-rendered ChatML text, and the segment cache's cheap keys never confuse texts."""

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.protocol.openai import OpenAIError
from dynamograph.protocol.tokenization import SegmentCache, get_tokenizer, request_tokens

pytestmark = pytest.mark.unit

_PIECES = [
    "hello", " world", "\n", "\n\n", "  ", "\t", "日本語", "é", "e\u0301", "\u0301", "\u0338",
    "<", ">", "|>", "<|", "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|im_end",
    "<think>", "</think>", "<tool_call>", "'s", "123", "😀", "x" * 300,
]  # fmt: skip
_content = st.one_of(
    st.lists(st.sampled_from(_PIECES), max_size=40).map("".join),
    st.text(max_size=200),
    st.lists(st.sampled_from(_PIECES), max_size=5).map(lambda p: {"type": "text", "text": "".join(p)}).map(lambda part: [part, part]),
)  # fmt: skip
_role = st.one_of(
    st.sampled_from(["system", "user", "assistant", "tool", "", "<|im_end|>", "a|>", "x\n"]),
    st.text(max_size=8),
)
_messages = st.lists(
    st.fixed_dictionaries({"role": _role, "content": _content}), min_size=1, max_size=6
)


def _rendered(tokenizer, messages, **kwargs) -> list[int]:
    return tokenizer.encode(tokenizer.render_chat(messages, **kwargs)).tolist()


@pytest.mark.parametrize("spec", ["qwen", "qwen:qwen3.5-27b"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=_messages, generation=st.sampled_from([None, True, False, 0, "yes"]))
def test_chat_segments_equal_the_rendered_text(spec, messages, generation):
    tokenizer = get_tokenizer(spec)
    kwargs = {} if generation is None else {"add_generation_prompt": generation}
    got = tokenizer.encode_chat(messages, **kwargs)
    assert got.dtype == np.dtype("<u4")
    assert got.tolist() == _rendered(tokenizer, messages, **kwargs)


def test_long_shared_system_prompt_comes_from_the_cache():
    tokenizer = get_tokenizer("qwen")
    system = {"role": "system", "content": "Shared instructions, numbered 17. " * 800}
    first = [system, {"role": "user", "content": "first question"}]
    assert tokenizer.encode_chat(first).tolist() == _rendered(tokenizer, first)
    misses = tokenizer.segments.misses
    # an equal system prompt in a new str object, as each request's JSON gives
    second = [{**system, "content": "".join(system["content"])}, {"role": "user", "content": "2"}]
    assert tokenizer.encode_chat(second).tolist() == _rendered(tokenizer, second)
    assert tokenizer.segments.misses - misses <= 2  # "user\n2" and at most one of the others


def test_the_loop_and_the_tokenizing_thread_share_the_cache_safely():
    """Two threads getting segments whose keys collide (same length and ends), evicting each
    other's: every answer is its own text's ids and the byte count stays exact."""
    import threading

    ends = "e" * SegmentCache.KEY_ENDS
    texts = [ends + f"{i:03d}" * (20 + i % 8) + ends for i in range(40)]  # 8 keys, 5 texts each
    # room for 4 entries of ~250 bytes: the threads evict each other's too
    cache = SegmentCache(lambda text: np.asarray([texts.index(text)], dtype="<u4"), 1200)
    failures = []

    def work(seed: int) -> None:
        for n in range(3000):
            i = (n * 7 + seed) % len(texts)
            if cache.get(texts[i]).tolist() != [i]:
                failures.append(i)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: without the lock the count drifts
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not failures
    assert cache.bytes == sum(size for _, _, size in cache._data.values()) <= 1200
    assert cache.hits and cache.misses


@pytest.mark.parametrize("spec", ["qwen", "qwen:qwen3.5-27b"])
def test_a_conversation_tokenizes_only_its_new_messages_each_turn(spec):
    """Turn after turn, the ids equal the whole rendered prompt's encoded without the cache
    (fastokens or the reference on the full text), while only the turn's new messages (and the
    first turn's segments) are tokenized: the history comes from the cache."""
    tokenizer = get_tokenizer(spec, fast=True)
    tokenizer.segments = SegmentCache(tokenizer._encode_ordinary)
    messages = [{"role": "system", "content": "You answer in full sentences. " * 200}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: why é, 日本語? " * 90})
        misses = tokenizer.segments.misses
        got = request_tokens(tokenizer, "/v1/chat/completions", {"messages": messages})
        whole = tokenizer.render_chat(messages, add_generation_prompt=True)
        assert got.tolist() == tokenizer._ids(whole).tolist()
        if turn:  # the new question (and the answer before it) only
            assert tokenizer.segments.misses - misses == 2
        messages.append({"role": "assistant", "content": f"Answer {turn}. " * 50})


def test_template_errors_are_still_400():
    tokenizer = get_tokenizer("qwen")
    with pytest.raises(OpenAIError) as err:
        request_tokens(tokenizer, "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})  # fmt: skip
    assert err.value.status == 400
    with pytest.raises(OpenAIError):  # no role: the template reports it
        tokenizer.encode_chat([{"content": "x"}])


def test_cache_keys_of_equal_length_and_ends_never_mix_texts():
    encoded = []

    def encode(text: str) -> np.ndarray:
        encoded.append(text)
        return np.asarray([len(encoded)], dtype="<u4")

    cache = SegmentCache(encode, max_bytes=40_000)
    ends = "e" * SegmentCache.KEY_ENDS
    a, b = ends + "A" * 50 + ends, ends + "B" * 50 + ends
    assert cache.get(a).tolist() == [1]
    assert cache.get(b).tolist() == [2]  # same length and ends, other text: encoded
    assert cache.get(b).tolist() == [2]
    assert cache.get(a).tolist() == [3]  # b replaced it
    assert len(cache) == 1 and cache.bytes == sys.getsizeof(a) + 4  # text and one u32 id
    for i in range(100):  # bounded by bytes: the oldest go
        cache.get(f"{i:04d}" + "z" * 996)
    assert cache.bytes <= 40_000 and 30 <= len(cache) < 40
    assert cache.get("0099" + "z" * 996).tolist() == [103]  # the newest stayed
    assert cache.get("0000" + "z" * 996).tolist() == [104]  # the oldest went
