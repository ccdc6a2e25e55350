"""bench epp's foreign comparison, bounded: our EPP and a field's one (GAIE's v1.5.0, or llm-d's
scheduler v0.7.1 with its precise prefix-cache scorer; `make counterparts`) on three kwok pods of
the repo's control plane (`make control-plane`), each sent a few requests of two workloads with
the gateways' processing mode (request and response bodies FULL_DUPLEX_STREAMED), one at a time
and then two streams at once.

What it proves: the comparison drives a foreign EPP to a pick for every request, as it does ours,
and every pick names one of the pods (an IP kwok gave a pod, on the pool's target port); llm-d's
precise scorer is measured with its tokenizer service, and its index holds the prefixes the
workers' KV events reported (its lookups hit).
"""

import argparse

import pytest

from dynamograph.bench import epp
from dynamograph.bench.route_routers import POLICIES, unavailable

pytestmark = pytest.mark.integration

REQUESTS = 9  # per workload and EPP: 3 one at a time, 6 over two streams


@pytest.mark.timeout(300)
@pytest.mark.parametrize("foreign", ["gaie-epp", "llmd-precise"])
async def test_every_request_is_routed_to_one_of_the_pods(tmp_path, foreign):
    reason = unavailable(POLICIES[foreign])
    if reason:
        pytest.skip(reason)
    parser = argparse.ArgumentParser()
    epp.add_arguments(parser)
    args = parser.parse_args(
        [
            "--foreign", foreign, "--foreign-workers", "3",
            "--foreign-requests", str(REQUESTS), "--concurrency", "2", "--idle-seconds", "0.5",
            "--prompt-tokens", "1024", "--prefix-groups", "4", "--latency-requests", "5",
            "--load-requests", "5", "--chat-tokens", "1024", "--chat-requests", str(REQUESTS),
            "--out", str(tmp_path),
        ]
    )  # fmt: skip
    names = epp._foreign_names(args)
    assert names == [foreign]
    prefixes, bodies = epp._prompts(args)
    first, _ = epp._chat_turns(args)
    result = await epp._measure_foreign(
        args, names, prefixes, {"shared prefix": bodies, "chat": first}
    )
    pods = set(result["endpoints"])
    assert len(pods) == 3 and all(p.startswith("127.1.") for p in pods), pods
    rows = result["rows"]
    assert [(r["epp"], r["workload"]) for r in rows] == [
        (e, w) for e in (epp.OURS, foreign) for w in ("shared prefix", "chat")
    ]
    for row in rows:
        assert row["requests"] == REQUESTS
        assert row["routed_to_a_pod"] == REQUESTS, row
        assert set(row["destinations"]) <= pods, row
        assert row["pick_p50_ms"] is not None and row["cpu_ms_per_request"] is not None
    theirs = {r["workload"]: r for r in rows if r["epp"] == foreign}
    if foreign == "llmd-precise":  # the EPP and its tokenizer service
        assert all(r["processes"] == 2 for r in theirs.values())
        # the shared prefixes, stored by the warm-up once it subscribed, are found
        assert theirs["shared prefix"]["kv_index_lookup_hits"] > 0, theirs
    else:
        assert all(r["processes"] == 1 for r in theirs.values())
        assert all(r["kv_index_lookup_hits"] is None for r in theirs.values())
