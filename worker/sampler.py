"""Deterministic output tokens from the real tokenizer's vocabulary, and their text.

The mock engine does not run a model, but its outputs are real token ids of the served model's
tokenizer that detokenize to readable words: the same (seed, prompt) always yields the same
continuation, so tests and benchmarks are reproducible. Only tokens that decode on their own to
a space followed by letters are drawn, so every token's text can be streamed as soon as it is
produced (no partial UTF-8 sequences).
"""

import functools
from collections.abc import Sequence

import numpy as np
import xxhash

from dynamograph.protocol.tokenization import Tokenizer

_SCAN_LIMIT = 60_000  # the most frequent BPE merges sit at low ids: plenty of words


@functools.lru_cache(maxsize=8)
def _word_pool(tokenizer: Tokenizer) -> tuple[np.ndarray, tuple[str, ...]]:
    ids, texts = [], []
    for token_id in range(min(tokenizer.vocab_size, _SCAN_LIMIT)):
        try:
            text = tokenizer.decode([token_id])
        except Exception:  # ids a vocabulary leaves unassigned
            continue
        if len(text) >= 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            ids.append(token_id)
            texts.append(text)
    if not ids:
        raise ValueError(f"tokenizer {tokenizer.identity} has no plain word tokens to sample")
    return np.asarray(ids, dtype="<u4"), tuple(texts)


_U64 = (1 << 64) - 1


class OutputSampler:
    """Per-request token streams: `stream(prompt, seed)` then `next()` per step."""

    def __init__(self, tokenizer: Tokenizer, seed: int = 0):
        self.tokenizer = tokenizer
        self.seed = seed
        # a tokenizer hashes by identity; mypy takes no protocol type as Hashable
        self.ids, self.texts = _word_pool(tokenizer)  # type: ignore[arg-type]
        self.id_list: list[int] = self.ids.tolist()

    def stream(self, prompt: np.ndarray, request_seed: int | None = None) -> "TokenStream":
        key = xxhash.xxh3_64_intdigest(np.ascontiguousarray(prompt, dtype="<u4").tobytes())
        seed = self.seed if request_seed is None else request_seed
        # numpy takes only non-negative seeds; a negative one is read as its 64-bit two's
        # complement, as torch's manual_seed (what vLLM seeds with) reads it.
        return TokenStream(self, np.random.default_rng((seed & _U64, key)))

    def text(self, index: Sequence[int]) -> str:
        return "".join(self.texts[i] for i in index)


class TokenStream:
    _BATCH = 64  # draw indices in batches: one numpy call per 64 tokens, not per token

    def __init__(self, sampler: OutputSampler, rng: np.random.Generator):
        self._sampler = sampler
        self._rng = rng
        self._drawn: list[int] = []

    def next(self) -> tuple[int, str]:
        if not self._drawn:
            self._drawn = self._rng.integers(len(self._sampler.ids), size=self._BATCH).tolist()
            self._drawn.reverse()
        i = self._drawn.pop()
        return self._sampler.id_list[i], self._sampler.texts[i]
