"""A Hugging Face `tokenizer.json` encodes with fastokens only when fastokens loads it and gives
`tokenizers`' ids on the validation texts; otherwise `tokenizers` encodes, and a log says why.

The tokenizers here are trained offline on this repository's docs with `tokenizers` itself.
(The big exactness test of the Hugging Face path, a Qwen tokenizer.json on the differential
corpus, is in test_tokenization_exact.py.)
"""

import json
import logging
from pathlib import Path

import fastokens
import numpy as np
import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from dynamograph.protocol.tokenization import VALIDATION_TEXT, HuggingFaceTokenizer
from e2e.waiting import wait_for_sync

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
LOGGER = "dynamograph.protocol.tokenization"


def _docs() -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(REPO.glob("docs/*.md"))]


def _byte_level_bpe(pre_split: dict | None = None) -> Tokenizer:
    """A small byte-level BPE with a BOS/EOS post-processor and an added token."""
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_docs(), trainer)
    hf.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    hf.add_special_tokens(["<|tool|>"])
    if pre_split is not None:
        doc = json.loads(hf.to_str())
        doc["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [{"type": "Split", **pre_split}, doc["pre_tokenizer"]],
        }
        hf = Tokenizer.from_str(json.dumps(doc))
    return hf


def _word_piece() -> Tokenizer:
    hf = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    hf.normalizer = normalizers.BertNormalizer()
    hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=2000, special_tokens=["[UNK]", "[SEP]"], show_progress=False
    )
    hf.train_from_iterator(_docs(), trainer)
    return hf


def _unigram() -> Tokenizer:
    hf = Tokenizer(models.Unigram())
    hf.normalizer = normalizers.NFKC()
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=1000, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False
    )
    hf.train_from_iterator(_docs(), trainer)
    return hf


def _saved(hf: Tokenizer, folder: Path) -> Path:
    path = folder / "tokenizer.json"
    hf.save(str(path))
    return path


def _assert_like_tokenizers(tok: HuggingFaceTokenizer, texts: list[str]) -> None:
    for text in texts:
        for add in (False, True):
            got = tok.encode(text, add_special_tokens=add)
            assert got.dtype == np.dtype("<u4") and got.flags.writeable
            assert got.tolist() == tok._tok.encode(text, add_special_tokens=add).ids


def test_a_file_fastokens_takes_and_agrees_on_encodes_with_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tok = HuggingFaceTokenizer(_saved(_byte_level_bpe(), tmp_path), fast=True)
    assert tok.backend == "fastokens"
    assert "fastokens is not used" not in caplog.text
    _assert_like_tokenizers(tok, [*_docs(), VALIDATION_TEXT, "<s>x<|tool|>y</s>", ""])
    assert tok.encode("hi", add_special_tokens=True)[[0, -1]].tolist() == [0, 1]  # BOS, EOS


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (_word_piece, "unsupported normalizer type: BertNormalizer"),
        (_unigram, "unsupported normalizer type: NFKC"),
    ],
    ids=["wordpiece-bert-normalizer", "unigram-nfkc"],
)
def test_a_file_fastokens_cannot_load_encodes_with_tokenizers(tmp_path, caplog, build, reason):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tok = HuggingFaceTokenizer(_saved(build(), tmp_path), fast=True)
    assert tok.backend == "tokenizers"
    assert f"fastokens is not used for {tok.identity} (it cannot load it: " in caplog.text
    assert reason in caplog.text and "encoding with tokenizers" in caplog.text
    _assert_like_tokenizers(tok, [*_docs()[:3], VALIDATION_TEXT])


def test_a_file_fastokens_loads_but_reads_differently_encodes_with_tokenizers(tmp_path, caplog):
    r"""`\h` is a hex digit to Oniguruma (`tokenizers`) and horizontal space to PCRE2
    (fastokens): the file loads in both, and only the validation texts tell them apart."""
    path = _saved(
        _byte_level_bpe({"pattern": {"Regex": r"\h+"}, "behavior": "Isolated", "invert": False}),
        tmp_path,
    )
    direct = fastokens.Tokenizer.from_file(str(path))
    reference = Tokenizer.from_file(str(path))
    assert direct.encode(VALIDATION_TEXT).ids != reference.encode(VALIDATION_TEXT).ids
    with caplog.at_level(logging.INFO, logger=LOGGER):
        tok = HuggingFaceTokenizer(path, fast=True)
    assert tok.backend == "tokenizers"
    assert "its ids differ from tokenizers's on validation text 0" in caplog.text
    _assert_like_tokenizers(tok, [*_docs()[:3], VALIDATION_TEXT])


def test_tokenizers_hands_over_to_fastokens_once_it_has_spent_the_build_cost(tmp_path):
    tok = HuggingFaceTokenizer(_saved(_byte_level_bpe(), tmp_path))
    assert tok.backend == "tokenizers"
    tok.FAST_AFTER_SECONDS = 0.0
    before = [tok.encode(text, add_special_tokens=True) for text in _docs()]
    wait_for_sync(lambda: tok.backend == "fastokens", "fastokens to be built", interval=0.02)
    after = [tok.encode(text, add_special_tokens=True) for text in _docs()]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)
