"""Instance ids, the /v1/engine document, and the vLLM KV-event codec."""

import socket

import msgpack
import pytest
import xxhash
from pydantic import ValidationError

from dynamograph.protocol.engine import EngineConfig, KvEventsEndpoint, Role
from dynamograph.protocol.identity import default_worker_name, instance_id
from dynamograph.protocol.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    endpoint_for_rank,
    engine_hash_key,
)

pytestmark = pytest.mark.unit


def test_instance_id_is_masked_xxh3_of_the_name():
    name = "graph-decode-7d9f8-abcde"
    assert instance_id(name) == xxhash.xxh3_64_intdigest(name.encode()) & ((1 << 63) - 1)
    assert 0 <= instance_id(name) < 1 << 63
    assert instance_id("a") != instance_id("b")
    with pytest.raises(ValueError, match="non-empty"):
        instance_id("")


def test_engine_config_round_trip_and_validation():
    config = EngineConfig(
        model="Qwen/Qwen3-0.6B",
        served_model_name="qwen",
        context_length=32768,
        kv_cache_block_size=16,
        total_kv_blocks=4096,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        instance_id=instance_id("w0"),
        name="w0",
        role=Role.DECODE,
        tokenizer="qwen:qwen2.5-72b-instruct",
        kv_events=KvEventsEndpoint(endpoint="tcp://127.0.0.1:5557"),
    )
    assert EngineConfig.model_validate_json(config.model_dump_json()) == config
    with pytest.raises(ValidationError, match="kv_cache_block_size"):
        EngineConfig.model_validate({**config.model_dump(), "kv_cache_block_size": 0})


def test_engine_config_needs_only_the_model():
    """Dynamo's EngineConfig requires only `model`; the rest is filled (docs/nvext.md), the
    tokenizer only for a model whose vocabulary ships with dynamograph."""
    config = EngineConfig.model_validate_json('{"model": "Qwen/Qwen3-0.6B"}', context={"name": "p"})
    assert (config.served_model_name, config.name) == ("Qwen/Qwen3-0.6B", "p")
    assert config.instance_id == instance_id("p") and config.tokenizer == "qwen"
    assert config.kv_cache_block_size == 16 and "kv_cache_block_size" not in config.model_fields_set
    assert config.total_kv_blocks is None and config.role == Role.AGGREGATED
    named = EngineConfig.model_validate({"model": "m", "tokenizer": "qwen"})
    assert named.name == "m"  # no context: the served name
    with pytest.raises(ValidationError, match="'m': its tokenizer is not one dynamograph ships"):
        EngineConfig.model_validate({"model": "m"})  # not a Qwen model: its tokenizer is named
    with pytest.raises(ValidationError, match="model"):
        EngineConfig.model_validate({"served_model_name": "m"})


def test_event_batch_round_trip():
    batch = EventBatch(
        ts=1.5,
        events=[
            BlockStored([11, 12], None, list(range(32)), 16, None, "GPU"),
            BlockRemoved([11]),
            AllBlocksCleared(),
        ],
        data_parallel_rank=1,
    )
    assert decode_batch(encode_batch(batch)) == batch


def test_decoder_accepts_vllm_omitted_defaults_and_bytes_hashes():
    # msgspec's omit_defaults drops trailing default fields; hashes may be bytes.
    payload = msgpack.packb([2.0, [["BlockStored", [b"\x01\x02"], None, [1, 2], 2]], None])
    event = decode_batch(payload).events[0]
    assert event.medium == "GPU" and event.lora_id is None
    assert engine_hash_key(event.block_hashes[0]) == 0x0102
    assert engine_hash_key(-1) == (1 << 64) - 1


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb({"ts": 1}), "EventBatch must be"),
        (msgpack.packb([1.0, [["Bogus"]], None]), "unknown KV event tag 'Bogus'"),
        (msgpack.packb([1.0, [["BlockStored", [1]]], None]), "at least 4 fields"),
    ],
)
def test_decoder_errors_say_what_is_wrong(payload, message):
    with pytest.raises(KvEventDecodeError, match=message):
        decode_batch(payload)


def test_sequence_numbers_and_rank_endpoints():
    assert decode_seq(encode_seq(7)) == 7
    assert decode_seq(END_SEQ) == -1
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert endpoint_for_rank("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert endpoint_for_rank("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"


def test_default_worker_name_is_the_pods_else_the_hosts(monkeypatch):
    monkeypatch.setenv("POD_NAME", "graph-decode-7f9c-abcde")
    assert default_worker_name() == "graph-decode-7f9c-abcde"
    monkeypatch.delenv("POD_NAME")
    assert default_worker_name() == socket.gethostname()
