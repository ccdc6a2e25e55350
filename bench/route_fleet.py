"""Processes of a routing benchmark: the mock-worker fleet and the routers in front of it.

Each process leads its own process group and logs to a file under the results folder, so a
failure names the log to read and a stop takes down anything the process spawned. Waits are
bounded polls that give up early when the process has already died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from dynamograph.local.procs import PortPool, log_tail, spawn, stop_groups
from dynamograph.protocol.engine import DEBUG_REQUESTS_PATH

from .route_metrics import OK, EngineFigures, RequestResult, set_engine_figures

DYNAMOGRAPH = [sys.executable, "-m", "dynamograph.cli"]
# Foreign routers must never reach the Hugging Face hub (no internet here, and a benchmark must
# not depend on it): offline mode, and the endpoint pointed at a closed local port.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9", "NO_PROXY": "*"}


class LaunchError(RuntimeError):
    pass


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: Mapping[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        # its own process group: stop_all reaches its children
        self.popen = spawn(self.argv, self.log, {**os.environ, **self.env})
        return self

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def failure(self, what: str) -> LaunchError:
        state = "exited" if not self.alive() else "still running"
        tail = log_tail(self.log, 15) or "(no log)"
        return LaunchError(f"{self.name} {what} ({state}); last lines of {self.log}:\n{tail}")


def stop_all(procs: Sequence[Proc], grace: float = 10.0) -> None:
    groups = [p.popen.pid for p in procs if p.popen is not None and p.alive()]
    stop_groups(groups, grace=grace)
    for p in procs:
        if p.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)


async def wait_http(
    proc: Proc, url: str, *, within_s: float = 60.0, accept: Sequence[int] = (200,)
) -> None:
    """Poll `url` until it answers with an accepted status; fail fast if `proc` dies."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while loop.time() < deadline:
            if not proc.alive():
                raise proc.failure(f"exited before {url} answered")
            try:
                async with session.get(url) as resp:
                    if resp.status in accept:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.2)
    raise proc.failure(f"did not answer {url} within {within_s:.0f} s")


@dataclass(frozen=True)
class WorkerSpec:
    model: str = "Qwen/Qwen3-8B"
    block_size: int = 16
    num_gpu_blocks: int = 27_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    context_length: int = 262_144
    speedup: float = 1.0
    # how much nicer than the bench the workers run (nice -n): they stand for GPU engines on
    # hosts of their own, so at a positive value the routers under test (and Envoy) get this
    # shared box's CPU first
    nice: int = 0


@dataclass
class Worker:
    name: str
    port: int
    kv_events_port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def worker_spec(args: argparse.Namespace, compression: float) -> WorkerSpec:
    """The fleet `bench route` asks for (its --model, --block-size, --num-gpu-blocks and
    --worker-nice), its clock sped up by the time compression."""
    return WorkerSpec(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        speedup=compression,
        nice=args.worker_nice,
    )


def worker_procs(count: int, spec: WorkerSpec, logs: Path, ports: PortPool) -> list[Worker]:
    """Commands for `count` mock workers on 127.0.0.1 (not started)."""
    workers = []
    for i in range(count):
        name = f"bench-worker-{i}"
        port, events = ports.take(), ports.take(2)
        argv = [
            *(["nice", "-n", str(spec.nice)] if spec.nice else []),
            *DYNAMOGRAPH,
            "worker",
            "--engine=mock",
            f"--model={spec.model}",
            "--role=aggregated",
            f"--name={name}",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--kv-events-port={events}",
            f"--kv-replay-port={events + 1}",
            f"--block-size={spec.block_size}",
            f"--num-gpu-blocks={spec.num_gpu_blocks}",
            f"--max-num-seqs={spec.max_num_seqs}",
            f"--max-num-batched-tokens={spec.max_num_batched_tokens}",
            f"--context-length={spec.context_length}",
            f"--speedup={spec.speedup}",
            f"--seed={i}",
            "--debug-endpoints",  # reset_caches empties their prefix caches between runs
            # Every policy meets workers already encoding at full speed: otherwise the fleet
            # switches to fastokens (and builds it, ~1.5 s of CPU per worker) during whichever
            # policy runs first, and that one pays for it.
            "--fast-tokenizer",
        ]
        workers.append(Worker(name, port, events, Proc(name, argv, logs / f"{name}.log")))
    return workers


@dataclass
class WorkerStats:
    requests: float = 0.0
    prefix_queries: float = 0.0
    prefix_hits: float = 0.0

    def minus(self, earlier: WorkerStats) -> WorkerStats:
        return WorkerStats(
            self.requests - earlier.requests,
            self.prefix_queries - earlier.prefix_queries,
            self.prefix_hits - earlier.prefix_hits,
        )


def parse_worker_metrics(text: str) -> WorkerStats:
    """Served requests and prefix-cache counters (tokens) from a vLLM-style /metrics page."""
    stats = WorkerStats()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                stats.requests += sample.value
            elif sample.name == "vllm:prefix_cache_queries_total":
                stats.prefix_queries += sample.value
            elif sample.name == "vllm:prefix_cache_hits_total":
                stats.prefix_hits += sample.value
    return stats


async def scrape_workers(workers: Sequence[Worker]) -> dict[str, WorkerStats]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def one(w: Worker) -> WorkerStats:
            async with session.get(w.url + "/metrics") as resp:
                return parse_worker_metrics(await resp.text())

        stats = await asyncio.gather(*(one(w) for w in workers))
    return {w.name: s for w, s in zip(workers, stats, strict=True)}


@contextlib.asynccontextmanager
async def running_fleet(
    count: int, spec: WorkerSpec, logs: Path, *, within_s: float = 120.0
) -> AsyncIterator[list[Worker]]:
    """`count` mock workers (`worker_procs`) started and healthy; stopped on exit."""
    ports = PortPool()
    workers = worker_procs(count, spec, logs, ports)
    ports.release()
    try:
        for w in workers:
            w.proc.start()
        await asyncio.gather(
            *(wait_http(w.proc, w.url + "/health", within_s=within_s) for w in workers)
        )
        yield workers
    finally:
        await asyncio.to_thread(stop_all, [w.proc for w in workers])


async def join_worker_records(workers: Sequence[Worker], results: Sequence[RequestResult]) -> None:
    """Each result's engine TTFT and duration as its worker recorded them (`/debug/requests`:
    the simulated figures it would have put in `nvext.timing`), found by the answer's id, which
    a relaying router passes through. A worker keeps its last 1,000 requests: the results of
    older ones get no engine figures, and the count is printed."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        pages = await asyncio.gather(
            *(_get_json(session, w.url + DEBUG_REQUESTS_PATH) for w in workers)
        )
    # The fleet serves every policy in turn under the same ids (`bench-<index>`): the latest
    # record of an id is this replay's.
    rows: dict[str, dict] = {}
    for row in sorted((r for page in pages for r in page.get("recent", [])), key=_received):
        rows[row["request_id"]] = row

    def figures(answer: str) -> EngineFigures | None:
        # A request the client named (x-request-id, as the bench's are) is answered as
        # `cmpl-<name>` and recorded as `<name>`; an unnamed one under its answer's id.
        row = rows.get(answer) or rows.get(answer.partition("-")[2])
        return None if row is None else (row.get("ttft_s"), row.get("e2e_s"))

    set_engine_figures(results, figures)
    missing = sum(1 for r in results if r.status == OK and r.engine_ttft_s is None)
    if missing:
        print(f"  {missing} answers have no worker record (older than a worker keeps)", flush=True)


def _received(row: dict) -> float:
    return row.get("received") or 0.0


async def _get_json(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url) as resp:
        if resp.status != 200:
            raise LaunchError(f"GET {url}: HTTP {resp.status} {(await resp.text())[:200]}")
        return await resp.json()


async def reset_caches(workers: Sequence[Worker], within_s: float = 60.0) -> None:
    """Empty every worker's prefix cache (vLLM's `POST /reset_prefix_cache`), waiting while a
    worker still finishes requests (it refuses while blocks are in use)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    pending = list(workers)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while pending:
            refused = []
            for w in pending:
                async with session.post(w.url + "/reset_prefix_cache") as resp:
                    if resp.status != 200:
                        refused.append((w, resp.status, (await resp.text())[:200]))
            pending = [w for w, _, _ in refused]
            if pending and loop.time() > deadline:
                w, status, text = refused[0]
                raise LaunchError(f"{w.name} refused to reset its prefix cache: {status} {text}")
            if pending:
                await asyncio.sleep(0.5)
