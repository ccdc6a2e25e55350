"""KV events from real mock workers into the EPP's index: freshness, worker removal, replay of
an injected sequence gap."""

import signal
import time

import aiohttp
import orjson
import pytest

from dynamograph.protocol.hashing import block_hashes
from dynamograph.protocol.kv_events import LAYOUTS
from dynamograph.protocol.tokenization import get_tokenizer, request_tokens
from dynamograph.worker.testing import mock_worker, worker_process
from e2e.waiting import wait_for

from .conftest import MODEL, running_epp

pytestmark = pytest.mark.integration


def _chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2}


def _hashes(epp, body: dict) -> list[int]:
    tokens = request_tokens(get_tokenizer("qwen"), "/v1/chat/completions", body)
    return block_hashes(tokens, epp.router.block_size)


def _held(epp, worker_id: int, hashes: list[int]) -> int:
    matches = epp.router.index.find_matches(hashes)
    return max((n for (w, _), n in matches.items() if w == worker_id), default=0)


async def _complete(http, worker, body):
    async with http.post(worker.url + "/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


async def test_index_reflects_blocks_within_100ms():
    async with (
        mock_worker(model=MODEL, name="kv-fresh") as worker,
        running_epp([worker]) as epp,
        aiohttp.ClientSession() as http,
    ):
        wid = worker.config.instance_id
        for i in range(3):
            body = _chat(f"freshness probe {i}: " + "tokens " * 300)
            hashes = _hashes(epp, body)
            assert _held(epp, wid, hashes) == 0
            await _complete(http, worker, body)
            done = time.perf_counter()
            await wait_for(
                lambda h=hashes: _held(epp, wid, h) >= len(h) - 1,
                "the index to hold the prompt's blocks",
                within=5,
            )
            assert time.perf_counter() - done <= 0.1


async def test_killed_worker_is_removed_from_routing():
    async with (
        mock_worker(model=MODEL, name="kv-survivor") as survivor,
        worker_process("--model", MODEL, name="kv-victim") as victim,
        running_epp([survivor, victim]) as epp,
        aiohttp.ClientSession() as http,
    ):
        vid = victim.config.instance_id
        body = _chat("victim prefix " * 200)
        await _complete(http, victim, body)
        hashes = _hashes(epp, body)
        await wait_for(
            lambda: _held(epp, vid, hashes) > 0, "the index to hold the victim's blocks", within=20
        )
        victim.process.send_signal(signal.SIGKILL)
        await wait_for(
            lambda: vid not in epp.router.workers(),
            "the killed worker to leave the router",
            within=20,
        )
        assert vid not in epp.router.workers()
        assert all(w != vid for (w, _) in epp.router.index.find_matches(hashes))
        # Routing only ever picks the survivor now, even for the victim's prefix.
        for _ in range(5):
            route = await epp.service.picker.pick(
                "/v1/chat/completions", {}, orjson.dumps(body), None
            )
            assert route.worker_id == survivor.config.instance_id, (
                f"picked {route.worker_id}; router knows {list(epp.router.workers())}"
            )
            route.guard.free()


async def test_injected_sequence_gap_triggers_replay():
    async with (
        mock_worker(model=MODEL, name="kv-gap") as worker,
        running_epp([worker]) as epp,
        aiohttp.ClientSession() as http,
    ):
        wid = worker.config.instance_id
        (subscriber,) = epp.kv.subscribers[wid]
        original = subscriber.handle
        dropped: list[int] = []

        def lossy(seq, payload):  # live batches only: a replay applies what it fetched itself
            if not dropped:
                dropped.append(seq)  # this frame "never arrived"
                return True
            return original(seq, payload)

        subscriber.handle = lossy
        replays_before = subscriber.replays
        lost = _chat("this batch gets lost " * 100)
        await _complete(http, worker, lost)
        await wait_for(lambda: dropped, "a dropped event batch")
        assert _held(epp, wid, _hashes(epp, lost)) == 0
        # The next batch reveals the gap; the replay socket fills it.
        await _complete(http, worker, _chat("this one arrives " * 100))
        await wait_for(
            lambda: _held(epp, wid, _hashes(epp, lost)) > 0, "replay to restore the lost blocks"
        )
        assert subscriber.replays > replays_before
        assert epp.metrics.kv_ingest.kv_gaps._value.get() >= 1
        assert epp.metrics.kv_ingest.kv_replay_failures._value.get() == 0


async def test_each_data_parallel_rank_feeds_its_own_slot():
    async with (
        mock_worker(model=MODEL, name="kv-dp", data_parallel_size=2) as worker,
        running_epp([worker]) as epp,
        aiohttp.ClientSession() as http,
    ):
        wid = worker.config.instance_id
        assert [s.dp_rank for s in epp.kv.subscribers[wid]] == [0, 1]
        for rank in (0, 1):
            body = _chat(f"rank {rank} only " * 150)
            headers = {"X-data-parallel-rank": str(rank)}
            url = worker.url + "/v1/chat/completions"
            async with http.post(url, json=body, headers=headers) as response:
                assert response.status == 200
            hashes = _hashes(epp, body)
            await wait_for(
                lambda h=hashes, r=rank: epp.router.index.find_matches(h).get((wid, r), 0) > 0,
                "the rank's blocks in the index",
            )
            assert epp.router.index.find_matches(hashes).get((wid, 1 - rank), 0) == 0


async def test_late_joining_epp_gets_history_from_replay():
    async with mock_worker(model=MODEL, name="kv-late") as worker, aiohttp.ClientSession() as http:
        early = _chat("published before the EPP existed " * 100)
        await _complete(http, worker, early)  # its KV events went out to nobody
        async with running_epp([worker]) as epp:
            wid = worker.config.instance_id
            hashes = _hashes(epp, early)
            await wait_for(
                lambda: _held(epp, wid, hashes) >= len(hashes) - 1,
                "the index to hold the prompt's blocks",
            )
            assert epp.metrics.kv_ingest.kv_batches.labels("replay")._value.get() >= 1


async def test_joining_a_worker_whose_replay_lost_the_start_indexes_what_comes_next(caplog):
    """vLLM's replay keeps the last 10,000 batches: an EPP joining a worker that has run longer
    cannot get its whole history. It says so at info level (not a failure), starts the slot
    from what it can get, and indexes every batch after."""
    async with mock_worker(model=MODEL, name="kv-long") as worker, aiohttp.ClientSession() as http:
        old = _chat("cached long before the EPP started " * 100)
        await _complete(http, worker, old)
        for rank in worker.engine.ranks:  # a worker running for days: the first batches are gone
            rank.publisher.buffer.clear()
        async with running_epp([worker]) as epp:
            wid = worker.config.instance_id
            new = _chat("arrived after the EPP joined " * 100)
            with caplog.at_level("INFO", logger="dynamograph.router.kv_events"):
                await _complete(http, worker, new)
                hashes = _hashes(epp, new)
                await wait_for(
                    lambda: _held(epp, wid, hashes) >= len(hashes) - 1,
                    "the index to hold the prompt's blocks",
                )
            assert "joined worker" in caplog.text
            assert not [r for r in caplog.records if r.levelname == "WARNING"]
            assert _held(epp, wid, _hashes(epp, old)) == 0  # its history is unknown, not guessed


@pytest.mark.parametrize("layout", LAYOUTS)
async def test_every_layout_vllm_publishes_reaches_the_index(layout):
    """The mock publishing in each of vLLM's layouts (`protocol.kv_events.LAYOUTS`): what the
    EPP replays (a batch from before it joined) and what it gets live both land in the index."""
    async with (
        mock_worker(model=MODEL, name=f"kv-{layout}", kv_events_layout=layout) as worker,
        aiohttp.ClientSession() as http,
    ):
        early = _chat(f"{layout} layout, sent before the EPP joined " * 100)
        await _complete(http, worker, early)
        async with running_epp([worker]) as epp:
            wid = worker.config.instance_id
            live = epp.metrics.kv_ingest.kv_batches.labels("live")
            late: list[dict] = []

            async def arrived_live() -> bool:
                # the subscription reaches the PUB a moment after the connection: a batch sent
                # before then comes by the catch-up's replay only; send until one comes live
                if live._value.get() >= 1:
                    return True
                late.append(_chat(f"{layout} layout, sent live, {len(late)} " * 100))
                await _complete(http, worker, late[-1])
                return False

            await wait_for(arrived_live, "a batch to arrive live")
            for body in (early, *late):
                hashes = _hashes(epp, body)
                await wait_for(
                    lambda h=hashes: _held(epp, wid, h) >= len(h) - 1,
                    "the index to hold the prompt's blocks",
                )
            assert epp.metrics.kv_ingest.kv_batches.labels("replay")._value.get() >= 1
