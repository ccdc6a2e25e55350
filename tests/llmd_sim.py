"""Unmodified llm-d-inference-sim processes (built by `make counterparts`) as engines we did not
write, for the tests of the routers in front of them (tests/epp, tests/frontend).

Each simulator gets its own loopback address (127.0.0.2, .3, .4) as its POD_IP and serving
address, as pods have; its KV-event publisher dials the router's bound SUB, one topic per
simulator (`kv@<POD_IP>@<model>`). Prompts are token ids (/v1/completions): offline the
simulator tokenizes text with its own simulated tokenizer, which no tokenizer of ours
reproduces, while token ids are taken as they are by both sides, so the blocks the simulator
reports are exactly the ones the router hashes.
"""

from pathlib import Path

from dynamograph.bench.route_fleet import OFFLINE_ENV, Proc
from dynamograph.protocol.identity import instance_id
from dynamograph.worker.testing import free_port
from e2e.waiting import wait_for

MODEL = "Qwen/Qwen3-0.6B"
BLOCK = 16
HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
PREFIX = list(range(1000, 1000 + 40 * BLOCK))  # 640 tokens: 40 blocks the simulator stores


def sim_argv(sim: Path, port: int, events: str) -> list[str]:
    return [
        str(sim),
        f"--port={port}",
        f"--model={MODEL}",
        "--enable-kvcache",
        f"--block-size={BLOCK}",
        "--kv-cache-size=4096",
        f"--zmq-endpoint={events}",
        # vLLM's own event layout (maps, parent_block_hash nil for a first block); the default
        # array layout writes parent 0 for "no parent", which vLLM never sends
        "--use-vllm-map-event-format",
        "--event-batch-size=1",
        # offline: never ask huggingface.co whether the model exists
        "--force-dummy-tokenizer",
        "--max-model-len=4096",
        "--time-to-first-token=0",
        "--inter-token-latency=0",
    ]


def engine_document(events: str) -> dict:
    """What the router is told about the simulators (the --engine-config YAML)."""
    return {
        "model": MODEL,
        "kv_cache_block_size": BLOCK,
        "total_kv_blocks": 4096,
        "context_length": 4096,
        "tokenizer": "qwen",
        "engine": "llm-d-inference-sim",
        "kv_events": {"endpoint": events, "bind": True, "topic": f"kv@{{host}}@{MODEL}"},
    }


def sim_procs(sim: Path, events: str, logs: Path) -> tuple[list[Proc], dict[int, str]]:
    """The simulators (not started) and their engine URLs by the instance id a router gives
    them (they are named by host:port, as an engine that does not name itself)."""
    ports = [free_port() for _ in HOSTS]
    procs = [
        Proc(
            f"sim-{i}",
            sim_argv(sim, port, events),
            logs / f"sim-{i}.log",
            env={**OFFLINE_ENV, "POD_IP": host},
        )
        for i, (host, port) in enumerate(zip(HOSTS, ports, strict=True))
    ]
    urls = {instance_id(f"{h}:{p}"): f"http://{h}:{p}" for h, p in zip(HOSTS, ports, strict=True)}
    return procs, urls


async def served(http, sims: dict[int, str]) -> dict[int, float]:
    """Requests each simulator says it finished (its own `vllm:request_success_total`)."""
    counts = {}
    for wid, url in sims.items():
        async with http.get(url + "/metrics") as response:
            text = await response.text()
        counts[wid] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total{")
        )
    return counts


async def complete(http, url: str, sims: dict[int, str], prompt: list[int]) -> tuple[int, dict]:
    """Send to the router at `url`; returns the simulator that served it (by its own count) and
    the response."""
    before = await served(http, sims)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with http.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, (await response.read())[:300]
        payload = await response.json()

    async def grown():  # the simulator counts a request a moment after answering it
        after = await served(http, sims)
        return [w for w in sims if after[w] > before[w]]

    (server,) = await wait_for(grown, "a simulator to count the request", within=10)
    return server, payload


def cached(payload: dict) -> int:
    """What the simulator itself says it found in its KV cache for this prompt."""
    return ((payload.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
