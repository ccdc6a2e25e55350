"""Property test: under any interleaving of arrivals, steps and aborts, the scheduler and the KV
cache keep their books straight, and the KV events describe exactly the cached blocks."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dynamograph.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from dynamograph.worker.kv_cache import KvCache
from dynamograph.worker.scheduler import Scheduler, Sequence

pytestmark = pytest.mark.unit

BS = 4

op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30), st.integers(1, 12)),
    st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def check(cache: KvCache, sched: Scheduler, mirror: set) -> None:
    holders = Counter(b for s in (*sched.running, *sched.loading) for b in s.blocks)
    for b in range(cache.num_blocks):
        assert cache.ref_count[b] == holders[b], f"block {b}"
        assert (b in cache.free) == (cache.ref_count[b] == 0)
    assert all(cache.block_hash[b] == h for h, b in cache.cached.items())
    assert sum(h is not None for h in cache.block_hash) == len(cache.cached)
    assert all(not s.blocks for s in sched.waiting)
    assert len(sched.running) <= sched.max_num_seqs
    assert mirror == set(cache.cached)


def apply_events(cache: KvCache, mirror: set) -> None:
    for e in cache.take_events():
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == BS * len(e.block_hashes)
            assert e.parent_block_hash is None or e.parent_block_hash in mirror
            mirror.update(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            assert set(e.block_hashes) <= mirror
            mirror.difference_update(e.block_hashes)
        elif isinstance(e, AllBlocksCleared):
            mirror.clear()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=1, max_size=80), st.integers(6, 24), st.integers(4, 32))
# Twins: two equal prompts prefilled together, then the shared block evicted under pressure.
@example([("add", 0, 4, 1), ("add", 0, 4, 5), ("add", 1, 12, 2)], 6, 5)
def test_books_balance(ops, num_blocks, budget):
    cache = KvCache(num_blocks, BS)
    sched = Scheduler(cache, max_num_seqs=3, max_num_batched_tokens=budget)
    prefixes = [np.arange(p * 100, p * 100 + 30, dtype="<u4") for p in range(4)]
    live: list[Sequence] = []
    mirror: set = set()
    made = 0

    def finish(seq: Sequence) -> None:
        cache.release(sched.remove(seq))
        live.remove(seq)

    for step in ops:
        if step[0] == "add":
            _, prefix, length, max_tokens = step
            if length + max_tokens > num_blocks * BS:
                continue  # the engine refuses these at the door
            prompt = prefixes[prefix][:length]
            seq = Sequence(f"s{made}", prompt, max_tokens, BS)
            made += 1
            sched.add(seq)
            live.append(seq)
        elif step[0] == "step":
            plan = sched.schedule(0.0)
            assert plan.num_tokens <= budget
            for seq in sched.complete(plan):
                seq.append(7 + seq.num_output)
                if seq.num_output >= seq.max_tokens:
                    finish(seq)
        elif live:
            finish(live[step[1] % len(live)])
        apply_events(cache, mirror)
        check(cache, sched, mirror)
    # Drain: everything finishes (no deadlock) and every block comes back.
    for _ in range(2000):
        if not live:
            break
        plan = sched.schedule(0.0)
        for seq in sched.complete(plan):
            seq.append(1)
            if seq.num_output >= seq.max_tokens:
                finish(seq)
        apply_events(cache, mirror)
        check(cache, sched, mirror)
    assert not live and cache.num_free == num_blocks
