"""vLLM's own KV-event bytes decoded by ours, for every layout vLLM has published.

The payloads are what msgspec (0.22) encodes for one batch with the Struct declarations of
vllm/distributed/kv_events.py (`EventBatch`, `KVCacheEvent` and its events, `KVEventBatch`) as
each vLLM named below declares them, taken from its release wheel (or, for the map batch, its
source at commit 0181ea31): the batch `ts=1.5, data_parallel_rank=1` holds
`BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=range(32), block_size=16,
lora_id=None, medium="GPU")` (with lora_name=None, extra_keys=[None, None], group_idx=0,
kv_cache_spec_kind="full_attention" where the version has them), `BlockRemoved([7], "GPU")`
(group_idx=0 where it has it) and `AllBlocksCleared()`. Neither vLLM nor msgspec is a
dependency here: the bytes are data, so these tests pin the wire format itself.
"""

import numpy as np
import pytest

from dynamograph.protocol.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    decode_batch_arrays,
    parse_batch,
    warm_up,
)

pytestmark = pytest.mark.unit

VLLM_PAYLOADS = {
    # array_like batch and events; 7-field BlockStored
    "0.11.0": (
        "93cb3ff80000000000009397ab426c6f636b53746f726564920708c0dc0020000102030405060708090a"
        "0b0c0d0e0f101112131415161718191a1b1c1d1e1f10c0a347505593ac426c6f636b52656d6f76656491"
        "07a347505591b0416c6c426c6f636b73436c656172656401"
    ),
    # array_like batch and events, with the fields 0.20-0.23 added after `medium`
    "0.23.0": (
        "93cb3ff8000000000000939cab426c6f636b53746f726564920708c0dc0020000102030405060708090a"
        "0b0c0d0e0f101112131415161718191a1b1c1d1e1f10c0a3475055c092c0c000ae66756c6c5f61747465"
        "6e74696f6ec094ac426c6f636b52656d6f7665649107a34750550091b0416c6c426c6f636b73436c6561"
        "72656401"
    ),
    # events are `type`-tagged maps (vLLM PR #42892), the batch still an array
    "0.24.0": (
        "93cb3ff8000000000000938ba474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
        "920708b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc002000010203040506"
        "0708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f7261"
        "5f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967"
        "726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f"
        "6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469756d"
        "a3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401"
    ),
    # as 0.24.0; more optional fields declared, so msgspec writes a map16 header
    "0.33.0": (
        "93cb3ff800000000000093de000ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
        "6573920708b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc00200001020304"
        "05060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f"
        "72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0"
        "a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74"
        "696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865739107a66d656469"
        "756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656401"
    ),
    # the batch a map too (`EventBatch` without array_like): vLLM's source at commit 0181ea31
    "main@0181ea31": (
        "83a27473cb3ff8000000000000a66576656e7473938ba474797065ab426c6f636b53746f726564ac626c"
        "6f636b5f686173686573920708b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473"
        "dc0020000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1faa626c6f636b5f"
        "73697a6510a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa6578747261"
        "5f6b65797392c0c0a967726f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c"
        "6c5f617474656e74696f6e84a474797065ac426c6f636b52656d6f766564ac626c6f636b5f6861736865"
        "739107a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b7343"
        "6c6561726564b2646174615f706172616c6c656c5f72616e6b01"
    ),
}

EXPECTED = EventBatch(
    1.5,
    [
        BlockStored([7, 8], None, list(range(32)), 16, None, "GPU"),
        BlockRemoved([7], "GPU"),
        AllBlocksCleared(),
    ],
    1,
)


@pytest.mark.parametrize("version", VLLM_PAYLOADS)
def test_vllms_own_bytes_decode_to_the_same_batch(version):
    payload = bytes.fromhex(VLLM_PAYLOADS[version])
    assert decode_batch(payload) == EXPECTED
    warm_up()
    arrays = decode_batch_arrays(payload)  # what the EPP's subscribers decode with
    assert (arrays.ts, arrays.data_parallel_rank) == (1.5, 1)
    stored, removed, cleared = arrays.events
    assert list(stored.block_hashes) == [7, 8] and list(stored.token_ids) == list(range(32))
    assert (stored.parent_block_hash, stored.block_size, stored.lora_id) == (None, 16, None)
    assert list(removed.block_hashes) == [7] and removed.medium == stored.medium == "GPU"
    assert isinstance(cleared, AllBlocksCleared)


def test_the_compiled_parser_reads_every_released_layout_and_leaves_the_map_batch():
    warm_up()
    for version in ("0.11.0", "0.23.0", "0.24.0", "0.33.0"):
        payload = bytes.fromhex(VLLM_PAYLOADS[version])
        parsed = parse_batch(payload)  # None: left to decode_batch
        assert parsed is not None, version
        stored, removed, _ = parsed.events
        assert stored.block_hashes.dtype == np.uint64 and stored.token_ids.dtype == np.uint32
        assert [stored.block_hashes.tolist(), stored.token_ids.tolist()] == [
            [7, 8],
            list(range(32)),
        ]
        assert removed.block_hashes.tolist() == [7]
        lists = EventBatch(
            parsed.ts,
            [
                BlockStored(stored.block_hashes.tolist(), stored.parent_block_hash,
                            stored.token_ids.tolist(), stored.block_size, stored.lora_id,
                            stored.medium),
                BlockRemoved(removed.block_hashes.tolist(), removed.medium),
                parsed.events[2],
            ],
            parsed.data_parallel_rank,
        )  # fmt: skip
        assert lists == decode_batch(payload) == EXPECTED, version
    assert parse_batch(bytes.fromhex(VLLM_PAYLOADS["main@0181ea31"])) is None
