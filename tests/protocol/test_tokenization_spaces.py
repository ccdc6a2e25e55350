"""Long runs of spaces are encoded without the pre-tokenizer regex (`QwenTokenizer.
_split_space_runs`), exactly as tiktoken encodes them, in linear time; and request bodies
nested past `MAX_JSON_DEPTH` are refused before anything recurses over them."""

import time

import numpy as np
import pytest

from dynamograph.protocol.openai import MAX_JSON_DEPTH, OpenAIError, parse_json_body
from dynamograph.protocol.tokenization import LONG_SPACE_RUN, QwenTokenizer

pytestmark = pytest.mark.unit

VOCABULARIES = ("Qwen/Qwen3-0.6B", "Qwen/Qwen3.5-9B")


@pytest.fixture(scope="module", params=VOCABULARIES)
def qwen(request):
    return QwenTokenizer(request.param)


def reference(tok: QwenTokenizer, text: str) -> np.ndarray:
    return tok._encoding.encode_to_numpy(text, allowed_special="all").astype("<u4")


def test_a_run_of_spaces_is_the_longest_space_token_repeated_then_the_rest(qwen):
    """The rule `_space_ids` relies on, against tiktoken: every length up to 1,100, then
    every 37th up to 6,000."""
    rule = qwen._space_run_rule()
    assert rule is not None and rule[1] == 128
    for length in [*range(1, 1100), *range(1100, 6000, 37)]:
        assert np.array_equal(qwen._space_ids(length, rule), reference(qwen, " " * length)), length


@pytest.mark.parametrize(
    "text",
    [
        " " * 5000,
        "a" + " " * 5000 + "b",
        " " * 5000 + "x",
        "x" + " " * 5000,
        "x\n" + " " * 5000 + "y",  # touches a newline: left to the encoder
        "x" + " " * 5000 + "\ty",  # touches a tab: left to the encoder
        "hi " * 1000 + " " * 70_000 + "ok" + " " * LONG_SPACE_RUN + "z" * 10 + " " * 9000,
        "<|im_start|>" + " " * 6000 + "<|im_end|>" + " " * (LONG_SPACE_RUN + 1) + ".",
        "it's" + " " * 5000 + "'s 12" + " " * 5000 + "!!" + " " * 5000 + "\u00e9t\u00e9",
        " " * 200_000 + "end",
    ],
)
def test_texts_with_long_runs_of_spaces_encode_as_tiktoken_does(qwen, text):
    assert np.array_equal(qwen.encode(text), reference(qwen, text))


def test_ten_megabytes_of_spaces_encode_in_linear_time(qwen):
    """tiktoken fails on it (its regex backtracking limit); fastokens needs ~18 s."""
    start = time.perf_counter()
    ids = qwen.encode(" " * 10_000_000)
    assert len(ids) == 78_125 and time.perf_counter() - start < 2.0


def test_text_the_reference_regex_gives_up_on_is_a_400(qwen):
    with pytest.raises(OpenAIError) as err:
        qwen.encode("x\n" + " " * 1_500_000 + "y")
    assert err.value.status == 400 and "could not be tokenized" in str(err.value)


def test_bodies_nested_past_the_limit_are_refused_naming_it():
    def nested(depth: int) -> bytes:  # the body is level 1
        inner = b"[" * (depth - 1) + b"]" * (depth - 1)
        return b'{"model": "m", "x": ' + inner + b"}"

    assert parse_json_body(nested(MAX_JSON_DEPTH))["model"] == "m"
    for raw in (nested(MAX_JSON_DEPTH + 1), b'{"nvext": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001):
        with pytest.raises(OpenAIError) as err:
            parse_json_body(raw)
        assert err.value.status == 400 and f"deeper than {MAX_JSON_DEPTH} levels" in str(err.value)
    # Many brackets side by side are not depth.
    wide = b'{"x": [' + b",".join([b"[{}]"] * 5000) + b"]}"
    assert len(parse_json_body(wide)["x"]) == 5000
