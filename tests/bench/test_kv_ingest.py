"""`bench epp`'s KV-event ingestion measure, run small: every batch of the paced stream and of
the burst reaches the router of the ingest process, and the figures it reports are sane."""

import pytest

from dynamograph.bench import kv_ingest

pytestmark = pytest.mark.integration


def test_every_batch_is_applied_and_measured():
    row = kv_ingest.measure(
        kv_ingest.INGEST_INTERVAL_S, workers=2, rate=200, seconds=1.0, burst=300, seed=0
    )
    assert row["paced_applied"] == 200 and row["burst_applied"] == 300, row
    assert row["cpu_us_per_batch"] > 0 and row["burst_cpu_us_per_batch"] > 0
    assert 0 <= row["lag_p50_ms"] <= row["lag_p99_ms"]
    assert row["max_batches_per_s"] > 0
