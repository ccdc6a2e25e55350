"""The compiled block-hash kernel (`hashing.warm_up`) is bit-exact with xxhash, and only the
processes that ask for it load numba."""

import subprocess
import sys

import numpy as np
import pytest
import xxhash

from dynamograph.protocol import hashing

pytestmark = pytest.mark.unit


def _oracle(tokens: np.ndarray, block_size: int, seed: int) -> list[int]:
    data = tokens.astype("<u4").tobytes()
    step = block_size * 4
    return [
        xxhash.xxh3_64_intdigest(data[i : i + step], seed)
        for i in range(0, len(data) // step * step, step)
    ]


@pytest.fixture(scope="module")
def compiled():
    hashing.warm_up()
    assert hashing._kernel is not None
    return hashing._kernel


@pytest.mark.parametrize("block_size", list(hashing.KERNEL_BLOCK_SIZES))
def test_every_kernel_block_size_equals_xxhash(compiled, block_size):
    rng = np.random.default_rng(block_size)
    seeds = [1337, 0, (1 << 64) - 1, hashing.block_hash_seed("sql-adapter")]
    seeds += [int(s) for s in rng.integers(0, 1 << 63, 4, dtype=np.int64)]
    for seed in seeds:
        n = int(rng.integers(0, 40 * block_size))
        tokens = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype("<u4")
        assert hashing._kernel_hash(tokens, block_size, seed).tolist() == _oracle(
            tokens, block_size, seed
        )


@pytest.mark.parametrize("block_size", [1, 4, 16, 32, 33, 64])
def test_public_path_after_warm_up(compiled, block_size):
    """Sizes the kernel takes and sizes it leaves to xxhash, lists and arrays, LoRA seeds."""
    rng = np.random.default_rng(7)
    for lora in (None, "ü-adapter"):
        tokens = rng.integers(0, 1 << 32, 50 * block_size + 3, dtype=np.uint64).astype("<u4")
        seed = hashing.block_hash_seed(lora)
        want = _oracle(tokens, block_size, seed)
        assert hashing.block_hash_array(tokens, block_size, lora).tolist() == want
        assert hashing.block_hashes(tokens.tolist(), block_size, lora) == want


def test_read_only_and_list_inputs(compiled):
    tokens = np.random.default_rng(3).integers(0, 1 << 32, 800, dtype=np.uint64).astype("<u4")
    frozen = np.frombuffer(tokens.tobytes(), dtype="<u4")  # read-only, as from a bytes buffer
    want = _oracle(tokens, 16, 1337)
    assert hashing.block_hash_array(frozen, 16).tolist() == want
    assert hashing.block_hash_array(tokens.tolist(), 16).tolist() == want


def test_importing_hashing_and_tokenization_does_not_load_numba():
    code = (
        "import sys\n"
        "import dynamograph.protocol.hashing as h, dynamograph.protocol.tokenization\n"
        "h.block_hash_array(list(range(4096)), 16)\n"
        "assert 'numba' not in sys.modules, 'numba was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
