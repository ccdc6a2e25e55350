"""bench route's gaie-epp policy end to end: GAIE's own EPP (v1.5.0, `make counterparts`) watching
the repo's control plane (`make control-plane`), routing two mock workers at their kwok pod IPs
through our real Envoy.

What it proves: the EPP found the pods through the API server, Envoy sent each request where the
EPP's header said, and every answer came from the worker the EPP says it picked (its
`inference_extension_scheduler_attempts_total` per pod against the engines' own ids).
"""

from collections import Counter

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.bench.route_client import completion_body, send_one
from dynamograph.bench.route_fleet import WorkerSpec, worker_procs
from dynamograph.bench.route_foreign_epp import serve_foreign_epp
from dynamograph.bench.route_metrics import OK, RequestResult
from dynamograph.local.procs import PortPool
from dynamograph.protocol.identity import instance_id

from .conftest import skip_unless_foreign_epp_runs

pytestmark = pytest.mark.integration

REQUESTS = 10


async def _picks(session: aiohttp.ClientSession, url: str) -> Counter:
    """The EPP's successful scheduling attempts so far, per pod name."""
    async with session.get(url) as resp:
        text = await resp.text()
    picks: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "inference_extension_scheduler_attempts_total"
                and sample.labels.get("status") == "success"
            ):
                picks[sample.labels["pod_name"]] += int(sample.value)
    return picks


@pytest.mark.timeout(180)
async def test_gaie_epp_answers_come_from_its_picks(tmp_path):
    skip_unless_foreign_epp_runs("gaie-epp")
    spec = WorkerSpec(num_gpu_blocks=2048, speedup=100.0)
    ports = PortPool()
    # Only the commands: the policy starts their twins at the pods' IPs.
    workers = worker_procs(2, spec, tmp_path / "fleet", ports)
    async with serve_foreign_epp(
        "gaie-epp", "gaie-epp", workers, ports, tmp_path, model=spec.model
    ) as routed:
        assert routed.metrics_url is not None
        assert {w.name for w in routed.workers} == {w.name for w in workers}
        assert all(w.url.startswith("http://127.1.") for w in routed.workers)
        by_id = {str(instance_id(w.name)): w.name for w in routed.workers}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            before = await _picks(session, routed.metrics_url)
            results = []
            for i in range(REQUESTS):
                # distinct prompts, sent one at a time: each is scheduled on its own
                body = completion_body(spec.model, f"Request {i}: " + "tell me more. " * 40, 4)
                results.append(
                    await send_one(
                        session, routed.url + "/v1/completions", body, RequestResult(index=i)
                    )
                )
            after = await _picks(session, routed.metrics_url)
    assert [r.status for r in results] == [OK] * REQUESTS, [r.error for r in results]
    answered = Counter(by_id[r.worker] for r in results if r.worker is not None)
    assert sum(answered.values()) == REQUESTS  # every engine said who it is
    picked = after - before
    assert picked == answered, f"EPP picks {dict(picked)}, answers from {dict(answered)}"
