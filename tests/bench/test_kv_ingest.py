"""`bench epp`'s KV-event ingestion measure, run small: every batch of the paced stream and of
the burst reaches the router of the ingest process, and the figures it reports are sane; the
decode-shaped stream `decode_costs` also times is shaped as vLLM's decode steps."""

import numpy as np
import pytest

from dynamograph.bench import kv_ingest
from dynamograph.protocol.kv_events import BlockRemoved, BlockStored, decode_batch

pytestmark = pytest.mark.integration


def test_every_batch_is_applied_and_measured():
    row = kv_ingest.measure(
        kv_ingest.INGEST_INTERVAL_S, workers=2, rate=200, seconds=1.0, burst=300, seed=0
    )
    assert row["paced_applied"] == 200 and row["burst_applied"] == 300, row
    assert row["cpu_us_per_batch"] > 0 and row["burst_cpu_us_per_batch"] > 0
    assert 0 <= row["lag_p50_ms"] <= row["lag_p99_ms"]
    assert row["max_batches_per_s"] > 0


def test_the_decode_shaped_stream_and_its_costs():
    stream = kv_ingest._Stream(np.random.default_rng(0), 1, kv_ingest.DECODE)
    steps = kv_ingest.CACHE_BLOCKS // kv_ingest.DECODE_EVENTS + 2
    first, *_, last = (decode_batch(stream.frame()[2]) for _ in range(steps))
    # a step: 8 requests completing one block each, chained to what the worker held
    assert [type(e) for e in first.events] == [BlockStored] * 8
    assert all(len(e.block_hashes) == 1 for e in first.events)
    # once the cache is full, as many blocks evicted, one event each
    assert [type(e) for e in last.events] == [BlockStored] * 8 + [BlockRemoved] * 8
    assert all(len(e.block_hashes) == 1 for e in last.events)
    costs = kv_ingest.decode_costs(batches=40, shape=kv_ingest.DECODE)
    assert costs["shape"] == kv_ingest.DECODE
    assert costs["parsed_by_the_compiled_parser"] == {"array": 40, "map": 40}
    stages = {row["stage"] for row in costs["rows"]}
    assert {"decode + apply to an index", "decode + apply to an index, event by event"} <= stages
    assert all(row["new_p50_us"] > 0 and row["old_p50_us"] > 0 for row in costs["rows"])
