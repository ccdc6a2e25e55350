"""Differential tests: our KvIndex against Dynamo's RadixTree (PyPI ai-dynamo-runtime) as oracle.

A small simulator plays vLLM engines: each (worker, dp_rank) slot keeps a prefix cache, stores
blocks under a parent it holds, evicts leaves first, sometimes clears everything; workers come
and go. The simulator's caches are a second oracle (the truth both indexes should report). Block contents come from a small alphabet so prefixes are shared across slots and
branch often. Every event goes to both indexes — ours as the vLLM event (token ids, engine
hashes; we hash the tokens ourselves), Dynamo's as its RouterEvent JSON with Dynamo's own
block hash — interleaved randomly across slots, and after every few events random queries must
give the same overlap for every (worker, dp_rank).

Engine hashes are the same function of the prefix on every engine (vLLM with a fixed
PYTHONHASHSEED): Dynamo 1.6.1's tree keeps one engine hash per node and fails to remove a block
that another worker stored under a different engine hash. Ours does not depend on that; the
salted run checks it against the simulator's truth only.
"""

import json
import random

import numpy as np
import pytest

from dynamograph.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from dynamograph.router import index as index_module
from dynamograph.router.index import KvIndex

dynamo = pytest.importorskip("dynamo._core", reason="needs PyPI ai-dynamo-runtime (dev extra)")

pytestmark = [pytest.mark.unit, pytest.mark.anchor]


@pytest.fixture(params=["default", "one-block stages", "arrays"])
def paths(request, monkeypatch):
    """Queries as lists converted in the index's default stages, as lists converted one block
    per stage (every kernel call resumes the walk of the one before), and as uint64 arrays."""
    if request.param == "one-block stages":
        monkeypatch.setattr(index_module, "FIRST_STAGE", 1)
        monkeypatch.setattr(index_module, "_STAGE_GROWTH", 1)
    return request.param


BLOCK = 4


class EngineSim:
    """One vLLM engine rank: a prefix cache of blocks (tuples of content ids)."""

    def __init__(self, salt: int) -> None:
        self.salt = salt
        self.held: set[tuple[int, ...]] = set()

    def engine_hash(self, prefix: tuple[int, ...]) -> int:
        # vLLM's hash is opaque to the router: any function of the prefix will do
        return hash((self.salt, prefix)) & ((1 << 64) - 1)

    def held_depth(self, seq: tuple[int, ...]) -> int:
        d = 0
        while d < len(seq) and seq[: d + 1] in self.held:
            d += 1
        return d

    def leaves(self) -> list[tuple[int, ...]]:
        parents = {p[:-1] for p in self.held}
        return [p for p in self.held if p not in parents]


def tokens_of(content: int) -> list[int]:
    return [content * 7 + i for i in range(BLOCK)]


class Fleet:
    """Feeds the same engine behaviour to both indexes."""

    def __init__(
        self,
        rng: random.Random,
        workers: int,
        ranks: int,
        alphabet: int,
        salted: bool = False,
        arrays: bool = False,
    ) -> None:
        self.rng = rng
        self.arrays = arrays  # queries as uint64 arrays instead of lists
        self.ours = KvIndex()
        self.theirs = None if salted else dynamo.RadixTree()
        self.alphabet = alphabet
        self.engines = {
            (w, r): EngineSim(rng.getrandbits(32) if salted else 0)
            for w in range(1, workers + 1)
            for r in range(ranks)
        }
        self.event_id = 0
        self.families = [self.random_seq(rng.randint(3, 12)) for _ in range(4)]

    def random_seq(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(self.alphabet) for _ in range(n))

    def request(self) -> tuple[int, ...]:
        fam = self.rng.choice(self.families)
        return fam[: self.rng.randint(0, len(fam))] + self.random_seq(self.rng.randint(0, 10))

    def _dynamo(self, slot, data) -> None:
        if self.theirs is None:
            return
        self.event_id += 1
        event = {"event_id": self.event_id, "dp_rank": slot[1], "data": data}
        self.theirs.apply_event(slot[0], json.dumps(event).encode())

    def store(self, slot) -> None:
        eng = self.engines[slot]
        seq = self.request()
        d = eng.held_depth(seq)
        if d == len(seq):
            return
        k = self.rng.randint(1, len(seq) - d)
        new = [seq[: i + 1] for i in range(d, d + k)]
        parent = eng.engine_hash(seq[:d]) if d else None
        hashes = [eng.engine_hash(p) for p in new]
        tokens = [t for p in new for t in tokens_of(p[-1])]
        eng.held.update(new)
        self.ours.apply_events(slot, [BlockStored(hashes, parent, tokens, BLOCK)])
        local = dynamo.compute_block_hash_for_seq(tokens, BLOCK)
        blocks = [{"block_hash": h, "tokens_hash": t} for h, t in zip(hashes, local, strict=True)]
        self._dynamo(slot, {"stored": {"parent_hash": parent, "blocks": blocks}})

    def evict(self, slot) -> None:
        eng = self.engines[slot]
        leaves = eng.leaves()
        if not leaves:
            return
        gone = self.rng.sample(leaves, self.rng.randint(1, min(4, len(leaves))))
        eng.held.difference_update(gone)
        hashes = [eng.engine_hash(p) for p in gone]
        self.ours.apply_events(slot, [BlockRemoved(hashes)])
        self._dynamo(slot, {"removed": {"block_hashes": hashes}})

    def clear(self, slot) -> None:
        self.engines[slot].held.clear()
        self.ours.apply_events(slot, [AllBlocksCleared()])
        self._dynamo(slot, "cleared")

    def remove_worker(self, worker: int) -> None:
        for slot, eng in self.engines.items():
            if slot[0] == worker:
                eng.held.clear()
        self.ours.remove_worker(worker)
        if self.theirs is not None:
            self.theirs.remove_worker(worker)

    def step(self) -> None:
        slot = self.rng.choice(list(self.engines))
        roll = self.rng.random()
        if roll < 0.6:
            self.store(slot)
        elif roll < 0.93:
            self.evict(slot)
        elif roll < 0.98:
            self.clear(slot)
        else:
            self.remove_worker(slot[0])

    def truth(self, seq: tuple[int, ...]) -> dict[tuple[int, int], int]:
        depths = {slot: eng.held_depth(seq) for slot, eng in self.engines.items()}
        return {slot: d for slot, d in depths.items() if d}

    def compare(self, queries: int) -> int:
        """Assert equal overlaps on random queries; returns how many had any match."""
        matched = 0
        for _ in range(queries):
            seq = self.request()
            tokens = [t for c in seq for t in tokens_of(c)]
            local = dynamo.compute_block_hash_for_seq(tokens, BLOCK)
            ours = self.ours.find_matches(np.array(local, np.uint64) if self.arrays else local)
            if self.theirs is not None:
                theirs = {k: v for k, v in self.theirs.find_matches(local).scores.items() if v}
                assert ours == theirs, f"query {seq}"
            assert ours == self.truth(seq), f"query {seq}"
            matched += bool(ours)
        return matched


@pytest.mark.parametrize("seed", range(3))
def test_overlaps_equal_dynamo_on_random_interleavings(seed, paths):
    rng = random.Random(seed)
    fleet = Fleet(
        rng,
        workers=rng.choice([3, 9, 70]),
        ranks=rng.choice([1, 2, 4]),
        alphabet=5,
        arrays=paths == "arrays",
    )
    matched = 0
    for step in range(1500):
        fleet.step()
        if step % 50 == 49:
            matched += fleet.compare(15)
    assert matched > 50  # the workload really shares prefixes
    assert fleet.ours.total_blocks() == sum(len(e.held) for e in fleet.engines.values())


def test_salted_engine_hashes_match_the_engines_caches(paths):
    rng = random.Random(7)
    fleet = Fleet(rng, workers=12, ranks=2, alphabet=4, salted=True, arrays=paths == "arrays")
    matched = 0
    for step in range(1500):
        fleet.step()
        if step % 50 == 49:
            matched += fleet.compare(15)
    assert matched > 50


def test_long_sequences_cross_chunk_boundaries(paths):
    """Matches longer than find_matches' first chunks (32, 128 …) still count exactly."""
    rng = random.Random(42)
    fleet = Fleet(rng, workers=4, ranks=2, alphabet=3, arrays=paths == "arrays")
    fleet.families = [fleet.random_seq(700) for _ in range(2)]
    for _ in range(120):
        fleet.store(rng.choice(list(fleet.engines)))
        if rng.random() < 0.2:
            fleet.evict(rng.choice(list(fleet.engines)))
    assert fleet.compare(25) > 5


def test_unknown_parent_and_unknown_removal_are_skipped_like_dynamo():
    fleet = Fleet(random.Random(1), workers=1, ranks=1, alphabet=5)
    slot = (1, 0)
    fleet.ours.apply_events(slot, [BlockStored([11], 999, tokens_of(1), BLOCK)])
    fleet.ours.apply_events(slot, [BlockRemoved([12345])])
    assert fleet.ours.total_blocks() == 0
    assert fleet.ours.find_matches(dynamo.compute_block_hash_for_seq(tokens_of(1), BLOCK)) == {}


def test_many_slots_sharing_prefixes(paths):
    """160 slots (three mask words) and a tiny alphabet: most rows are shared by many slots."""
    rng = random.Random(11)
    fleet = Fleet(rng, workers=40, ranks=4, alphabet=2, arrays=paths == "arrays")
    matched = 0
    for step in range(1200):
        fleet.step()
        if step % 100 == 99:
            matched += fleet.compare(10)
    assert matched > 50


def test_key_table_rebuilds_under_random_interleavings():
    """Long, varied sequences: the key table rebuilds (rows move, slots renumbered) mid-stream."""
    rng = random.Random(103)
    fleet = Fleet(rng, workers=20, ranks=2, alphabet=50)
    fleet.families = [fleet.random_seq(rng.randint(50, 400)) for _ in range(6)]
    sizes, matched = set(), 0
    for step in range(800):
        fleet.step()
        sizes.add(fleet.ours._keys.keys.size)
        if step % 100 == 99:
            matched += fleet.compare(10)
    assert len(sizes) > 1  # it did rebuild
    assert matched > 40
    assert fleet.ours.total_blocks() == sum(len(e.held) for e in fleet.engines.values())
