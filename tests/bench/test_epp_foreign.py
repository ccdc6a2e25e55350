"""bench epp's foreign comparison, bounded: our EPP and GAIE's (v1.5.0, `make counterparts`) on
three kwok pods of the repo's control plane (`make control-plane`), each sent a few requests of
two workloads with the gateways' processing mode (request and response bodies
FULL_DUPLEX_STREAMED), one at a time and then two streams at once.

What it proves: the comparison drives a foreign EPP to a pick for every request, as it does ours,
and every pick names one of the pods (an IP kwok gave a pod, on the pool's target port).
"""

import argparse

import pytest

from dynamograph.bench import epp
from dynamograph.bench.route_foreign_epp import unavailable

pytestmark = pytest.mark.integration

REQUESTS = 9  # per workload and EPP: 3 one at a time, 6 over two streams


@pytest.mark.timeout(300)
async def test_every_request_is_routed_to_one_of_the_pods(tmp_path):
    reason = unavailable("gaie-epp")
    if reason:
        pytest.skip(reason)
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    args = parser.parse_args(
        [
            "--foreign", "gaie-epp", "--foreign-workers", "3",
            "--foreign-requests", str(REQUESTS), "--concurrency", "2", "--idle-seconds", "0.5",
            "--prompt-tokens", "1024", "--prefix-groups", "4", "--latency-requests", "5",
            "--load-requests", "5", "--chat-tokens", "1024", "--chat-requests", str(REQUESTS),
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    names = epp._foreign_names(args)
    assert names == ["gaie-epp"]
    prefixes, bodies = epp._prompts(args)
    first, _ = epp._chat_turns(args)
    result = await epp._measure_foreign(
        args, names, prefixes, {"shared prefix": bodies, "chat": first}
    )
    pods = set(result["endpoints"])
    assert len(pods) == 3 and all(p.startswith("127.1.") for p in pods), pods
    rows = result["rows"]
    assert [(r["epp"], r["workload"]) for r in rows] == [
        (e, w) for e in (epp.OURS, "gaie-epp") for w in ("shared prefix", "chat")
    ]
    for row in rows:
        assert row["requests"] == REQUESTS
        assert row["routed_to_a_pod"] == REQUESTS, row
        assert set(row["destinations"]) <= pods, row
        assert row["pick_p50_ms"] is not None and row["cpu_ms_per_request"] is not None
