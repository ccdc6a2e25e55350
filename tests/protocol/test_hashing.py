"""Block hashes are bit-exact with Dynamo's compute_block_hash_for_seq (the differential oracle)."""

import numpy as np
import pytest

from dynamograph.protocol.hashing import block_hash_array, block_hash_seed, block_hashes

dynamo = pytest.importorskip("dynamo._core", reason="needs PyPI ai-dynamo-runtime (dev extra)")

pytestmark = [pytest.mark.unit, pytest.mark.anchor]


@pytest.mark.parametrize("block_size", [1, 16, 64, 128])
@pytest.mark.parametrize("lora_name", [None, "sql-adapter", "ü-adapter"])
def test_equals_dynamo_on_random_sequences(block_size, lora_name):
    rng = np.random.default_rng(block_size)
    for _ in range(300 if block_size > 1 else 60):
        n = int(rng.integers(0, 6 * block_size + 7))
        tokens = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        ours = block_hashes(tokens, block_size, lora_name)
        theirs = dynamo.compute_block_hash_for_seq(tokens.tolist(), block_size, lora_name=lora_name)
        assert ours == theirs
        assert len(ours) == n // block_size  # the partial tail is dropped


def test_array_form_equals_the_list_form():
    tokens = list(range(1000))
    array = block_hash_array(tokens, 16, "a")
    assert array.dtype == np.uint64 and array.size == 62
    assert array.tolist() == block_hashes(tokens, 16, "a")
    assert block_hash_array(tokens[:15], 16).size == 0


def test_list_and_array_inputs_agree():
    tokens = list(range(1000))
    assert block_hashes(tokens, 16) == block_hashes(np.array(tokens, dtype=np.uint32), 16)


def test_empty_lora_name_is_the_base_model():
    assert block_hash_seed("") == block_hash_seed(None) == 1337
    assert block_hashes(list(range(32)), 16, "") == block_hashes(list(range(32)), 16)


def test_lora_changes_every_hash():
    base = block_hashes(list(range(64)), 16)
    adapted = block_hashes(list(range(64)), 16, "a")
    assert not set(base) & set(adapted)


@pytest.mark.parametrize("bad", [0, -16])
def test_bad_block_size_is_named(bad):
    with pytest.raises(
        ValueError, match=f"block_size must be a positive number of tokens, got {bad}"
    ):
        block_hashes([1, 2, 3], bad)
