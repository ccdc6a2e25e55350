"""One tokenization for every component: chat template + real tokenizers, offline."""

import json

import numpy as np
import pytest
from pydantic import ValidationError

from dynamograph.protocol.engine import EngineConfig
from dynamograph.protocol.openai import OpenAIError
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens, tokenizer_for_model

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def test_qwen_is_the_real_vocabulary():
    tok = get_tokenizer("qwen")
    assert tok.encode("Hello world").tolist() == [9707, 1879]
    assert tok.encode("Hello world").dtype == np.dtype("<u4")


def test_chat_renders_chatml_and_round_trips():
    tok = get_tokenizer("qwen")
    ids = request_tokens(tok, CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert request_tokens(tok, CHAT, parts).tolist() == ids.tolist()


def test_completion_prompt_text_ids_and_token_data():
    tok = get_tokenizer("qwen")
    assert request_tokens(tok, COMPLETIONS, {"prompt": "Hello world"}).tolist() == [9707, 1879]
    assert request_tokens(tok, COMPLETIONS, {"prompt": [5, 6]}).tolist() == [5, 6]
    assert request_tokens(tok, COMPLETIONS, {"prompt": ["Hello world"]}).tolist() == [9707, 1879]
    # token_data counts only with backend_instance_id (Dynamo: GAIE's second stage)
    body = {"prompt": "Hello world", "nvext": {"token_data": [9, 8]}}
    assert request_tokens(tok, COMPLETIONS, body).tolist() == [9707, 1879]
    body["nvext"]["backend_instance_id"] = 7
    assert request_tokens(tok, COMPLETIONS, body).tolist() == [9, 8]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (CHAT, {}, 400, "non-empty 'messages'"),
        (CHAT, {"messages": ["hi"]}, 400, r"messages\[0\] must be an object"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "'image_url'",
        ),
        (COMPLETIONS, {}, 400, "needs a 'prompt'"),
        (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "batched prompts"),
        (COMPLETIONS, {"prompt": [1, -1]}, 400, "0..4294967295"),
        (COMPLETIONS, {"prompt": "x", "nvext": {"dp_rank": "x"}}, 400, r"nvext\.dp_rank"),
        ("/v1/embeddings", {}, 404, "no generation endpoint"),
    ],
)
def test_bad_requests(path, body, status, message):
    with pytest.raises(OpenAIError, match=message) as info:
        request_tokens(get_tokenizer("qwen"), path, body)
    assert info.value.status == status


def test_hugging_face_tokenizer_json_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user:": 5, "bot:": 6}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}bot:{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    tok = get_tokenizer(str(tmp_path))
    assert tok.eos_token_id == 2
    ids = request_tokens(tok, CHAT, {"messages": [{"role": "user", "content": "hello world"}]})
    assert ids.tolist() == [1, 5, 3, 4, 6]
    assert request_tokens(tok, COMPLETIONS, {"prompt": "hello"}).tolist() == [3]


def test_unknown_tokenizer_spec():
    with pytest.raises(ValueError, match="unknown tokenizer 'nope'"):
        get_tokenizer("nope")


def test_model_names_map_to_offline_vocabularies():
    assert tokenizer_for_model("Qwen/Qwen3-0.6B") == "qwen"
    assert tokenizer_for_model("Qwen/Qwen2.5-72B-Instruct") == "qwen"
    assert tokenizer_for_model("Qwen/Qwen3.5-27B") == "qwen:qwen3.5-27b"


def test_another_models_tokenizer_is_never_guessed():
    """A real engine serving Llama tokenizes with Llama's vocabulary: hashing its prompts with
    Qwen's ids would find no overlap with its KV events, so the tokenizer must be named. The mock
    engine, which simulates any model with the embedded vocabulary, still gets the default."""
    with pytest.raises(ValueError, match=r"Llama-3\.3-70B-Instruct.*tokenizer\.json"):
        tokenizer_for_model("meta-llama/Llama-3.3-70B-Instruct")
    assert tokenizer_for_model("meta-llama/Llama-3.3-70B-Instruct", simulated=True) == "qwen"
    with pytest.raises(ValidationError, match="its tokenizer is not one dynamograph ships"):
        EngineConfig(model="meta-llama/Llama-3.3-70B-Instruct", name="w")
    named = EngineConfig(model="meta-llama/Llama-3.3-70B-Instruct", name="w", tokenizer="/t.json")
    assert named.tokenizer == "/t.json"


def test_concurrent_first_loads_share_one_tokenizer(monkeypatch):
    """A preloading thread and a first request asking at once get the same object, loaded once."""
    from concurrent.futures import ThreadPoolExecutor

    from dynamograph.protocol import tokenization

    loads = []
    original = tokenization.QwenTokenizer

    class Counting(original):
        def __init__(self, vocabulary, **kwargs):
            loads.append(vocabulary)
            super().__init__(vocabulary, **kwargs)

    monkeypatch.setattr(tokenization, "QwenTokenizer", Counting)
    spec = "qwen:qwen2.5-7b-instruct"  # a spec no other test loads
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: tokenization.get_tokenizer(spec), range(4)))
    assert len(loads) == 1
    assert all(t is got[0] for t in got)
