"""bench route's `frontend-kv` policy: our frontend in kv mode, no gateway, in front of two real
mock workers. Requests repeating a document's prefix go to the worker that prefilled it (the
frontend's router follows the workers' KV events), and each result's engine TTFT and duration
are the ones its worker recorded (`/debug/requests`), not the frontend's wall clock, which it
puts in `nvext.timing` itself."""

import asyncio

import aiohttp
import pytest

from dynamograph.bench.route_client import completion_body, send_one
from dynamograph.bench.route_fleet import WorkerSpec, running_fleet
from dynamograph.bench.route_metrics import OK, RequestResult
from dynamograph.bench.route_routers import POLICIES, serve
from dynamograph.local.procs import PortPool

pytestmark = pytest.mark.integration

DOC = "Gamma notes. " + "The lighthouse keeper logs each passing ship by lamp light. " * 25


async def _records(session: aiohttp.ClientSession, workers) -> dict[str, dict[str, dict]]:
    """Each worker's request records by id, under its instance id (what `nvext` names)."""
    rows = {}
    for w in workers:
        async with session.get(w.url + "/v1/engine") as resp:
            instance = str((await resp.json())["instance_id"])
        async with session.get(w.url + "/debug/requests") as resp:
            rows[instance] = {row["request_id"]: row for row in (await resp.json())["recent"]}
    return rows


@pytest.mark.timeout(120)
async def test_frontend_kv_routes_a_prefix_to_its_holder_and_reports_engine_figures(tmp_path):
    spec = WorkerSpec(num_gpu_blocks=2048, speedup=100.0)
    async with (
        running_fleet(2, spec, tmp_path / "fleet") as workers,
        serve(POLICIES["frontend-kv"], workers, PortPool(), tmp_path, model=spec.model) as routed,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
    ):
        assert routed.pids and not routed.gateway_pids  # no Envoy in front
        # An earlier policy's requests on the same fleet, under the same ids: each worker
        # then holds an older record of every id.
        for w in workers:
            for k in range(4):
                body = completion_body(spec.model, f"An earlier run, request {k}.", 4)
                earlier = await send_one(session, w.url + "/v1/completions", body, RequestResult(k))
                assert earlier.status == OK, earlier.error
        results = []
        for k in range(4):
            body = completion_body(spec.model, DOC + f"Question {k}: which ship?", 4)
            results.append(
                await send_one(session, routed.url + "/v1/completions", body, RequestResult(k))
            )
            await asyncio.sleep(0.3)  # the first prefill's KV events reach the router
        assert [r.status for r in results] == [OK] * 4, [r.error for r in results]
        frontend_view = [(r.engine_ttft_s, r.engine_e2e_s) for r in results]
        assert routed.engine_view is not None
        await routed.engine_view(results)
        records = await _records(session, workers)
    assert len({r.worker for r in results}) == 1  # every request on the prefix's holder
    assert all(r.cached_tokens > 0 for r in results[1:])
    for r, before in zip(results, frontend_view, strict=True):
        row = records[r.worker][r.response_id.partition("-")[2]]
        assert (r.engine_ttft_s, r.engine_e2e_s) == (row["ttft_s"], row["e2e_s"])
        assert 0 < r.engine_ttft_s <= r.engine_e2e_s
        assert (r.engine_ttft_s, r.engine_e2e_s) != before  # the frontend's clock, replaced
