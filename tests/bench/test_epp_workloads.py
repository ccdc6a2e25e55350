"""bench epp's workloads measure what their rows say."""

import argparse

import orjson
import pytest

from dynamograph.bench import epp
from dynamograph.protocol.tokenization import SegmentCache, get_tokenizer

pytestmark = pytest.mark.unit


def test_the_chinese_document_rows_requests_differ_only_in_their_question(monkeypatch):
    """One Chinese document, written without spaces, then a new question each request: once the
    EPP's tokenizer has seen one, only the document's last chunk and the question are new."""
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    args = parser.parse_args(["--document-chars", "40000", "--chat-requests", "3"])
    bodies = epp._cjk_document_bodies(args)
    messages = [orjson.loads(b)["messages"] for b in bodies]
    texts = [m[0]["content"] for m in messages]
    assert len(set(texts)) == 3 and " " not in texts[0]
    document = texts[0][: texts[0].rindex("问题")]
    assert len(document) >= args.document_chars and all(t.startswith(document) for t in texts)
    tokenizer = get_tokenizer("qwen")
    monkeypatch.setattr(tokenizer, "segments", SegmentCache(tokenizer._encode_ordinary))
    assert tokenizer.uncached_chat_chars(messages[1]) > args.document_chars
    tokenizer.encode_chat(messages[0])
    new = tokenizer.uncached_chat_chars(messages[1])
    assert 0 < new <= 2 * tokenizer.CHUNK_CHARS + 50
