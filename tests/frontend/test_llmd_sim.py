"""The frontend's kv mode in front of engines we did not write, with no gateway: a `dynamograph
frontend --mode kv` process over unmodified llm-d-inference-sim processes (built by `make
counterparts`), described to it by `--engine-config` as the operator does for a standalone
frontend service (docs/operator.md, "Engines we did not launch"). The simulators' publishers
dial the frontend's bound SUB; a shared prefix keeps going to the simulator that holds it, whose
own cache then reports it, and the frontend's /metrics shows the batches it applied. The EPP's
counterpart behind Envoy: tests/epp/test_llmd_sim.py."""

import asyncio

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.bench.counterparts import binary
from dynamograph.bench.route_fleet import DYNAMOGRAPH, Proc, stop_all, wait_http
from dynamograph.local.procs import log_tail
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for
from tests.llmd_sim import BLOCK, PREFIX, cached, complete, engine_document, sim_procs

pytestmark = pytest.mark.integration


async def _live_batches(http, url: str) -> float:
    """KV-event batches the frontend applied from live streams (its own metric)."""
    async with http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "dynamograph_frontend_kv_event_batches"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("source") == "live"
    )


async def test_a_kv_frontend_routes_foreign_engines_by_their_own_events(tmp_path):
    sim = binary("sim")
    if sim is None:
        pytest.skip("llm-d-inference-sim is not built: run `make counterparts`")
    events = f"tcp://127.0.0.1:{free_port()}"
    document = tmp_path / "engine.yaml"
    document.write_text(yaml.safe_dump(engine_document(events)))
    # the unrelated prompts tie on idle simulators: seeded, their tie-breaks spread them
    router = tmp_path / "router.yaml"
    router.write_text(yaml.safe_dump({"seed": 3}))
    procs, sims = sim_procs(sim, events, tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    frontend = Proc(
        "frontend",
        [
            *DYNAMOGRAPH,
            "frontend",
            "--mode",
            "kv",
            "--port",
            str(port),
            "--router-config",
            str(router),
            "--engine-config",
            str(document),
            *(f"--worker={u}={u.removeprefix('http://')}" for u in sims.values()),
        ],
        tmp_path / "frontend.log",
    )
    try:
        for proc in procs:
            proc.start()
        await asyncio.gather(
            *(wait_http(p, u + "/v1/models") for p, u in zip(procs, sims.values(), strict=True))
        )
        frontend.start()
        await wait_http(frontend, url + "/health", within_s=60)
        async with aiohttp.ClientSession() as http:
            first = PREFIX + list(range(50_000, 50_000 + BLOCK))
            holder, payload = await complete(http, url, sims, first)
            assert payload["choices"] and cached(payload) == 0  # a cold cache
            # the simulator's event (its topic, its blocks) reached the frontend's index
            await wait_for(
                lambda: _live_batches(http, url),
                "the frontend to apply a KV-event batch",
                within=30,
                detail=lambda: f"logs: {[log_tail(p.log, 5) for p in (*procs, frontend)]}",
            )
            served = []
            for i in range(6):
                # unrelated prompts spread; the shared prefix keeps going to its holder, whose
                # own cache then has it
                start = 100_000 * (i + 1)
                other, payload = await complete(
                    http, url, sims, list(range(start, start + 30 * BLOCK))
                )
                assert cached(payload) == 0
                tail = list(range(60_000 + i * 100, 60_000 + i * 100 + BLOCK))
                again, payload = await complete(http, url, sims, PREFIX + tail)
                served.append(other)
                assert again == holder
                assert cached(payload) >= len(PREFIX)  # the simulator's own cache had it
            assert len(set(served)) > 1  # the unrelated prompts did not all go to one place
    finally:
        stop_all([frontend, *procs])
