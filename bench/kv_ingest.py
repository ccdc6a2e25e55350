"""KV-event ingestion, as the EPP runs it: `router.kv_events.KvEventIngest` in a process of its
own (uvloop, like the EPP), one SUB per worker, fed by PUB sockets in this process.

Engines publish a batch per engine step and rank. The stream here is shaped like the one
captured from `bench route --workload multiturn` (4 workers, rate 8): each batch stores 1–63
blocks (mean 32) of 16 unique tokens continuing the worker's chain, and once a worker holds
its cache's worth, removes its oldest blocks as it stores, as an engine evicts. Measured:
- paced: `rate` batches/s spread over the workers for `seconds`: the ingest process's CPU
  per batch and the lag from a batch's timestamp to its application (p50/p99);
- flat out: `burst` batches sent at once: how many batches (and blocks) per second one
  process applies (wall, first to last applied) and its CPU per batch meanwhile.
No request is routed here, so every batch is read by the ticker's background rounds (in the
EPP, each routing decision first reads what is queued, awake anyway). For the round interval
as shipped (`INGEST_INTERVAL_S`: rounds at most every 50 ms while batches keep coming), 0 (a
round per loop turn: every batch read as it arrives, the way a per-socket reader would), 20
and 100 ms (what the EPP's `--kv-ingest-interval` trades: less CPU per batch, more lag), in the
same run.

`decode_costs` (also alone: `python -m dynamograph.bench.kv_ingest [--shape decode]`, which
prints its table and writes results/kv_decode_<shape>.json) times decoding a batch of that
stream (or of one shaped like vLLM's decode steps: many one-block events, `_Stream`) in this
process, the pure-Python `decode_batch` against the compiled parser the subscribers use
(`decode_batch_arrays`), batch by batch in turns: decoding alone (the compiled parser's events
are objects only once asked for); decoding plus the events and the arrays
`KvIndex.apply_events` makes of them (block hashes of the tokens, engine hashes as u64);
decoding plus applying the events to an index one by one (`KvIndex.apply_events`); decoding
plus applying as the EPP does (`KvIndex.apply_batch`: the compiled parser's rows in one kernel
call, the decoder's events one by one), with the stored blocks' keys returned (a prefill on the
slot waits for them) and without (none does: `want_stored=False`). Every stage that applies has
its own index per decoder,
each fed the whole stream. The same stream is encoded in vLLM's array layout (up to 0.23) and
its map layout (0.24 on: events as `type`-tagged maps, `kv_events.MAP`), and the four (layout,
decoder) pairs take turns.
"""

import argparse
import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from dynamograph.protocol.engine import EngineConfig, KvEventsEndpoint
from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import (
    ARRAY,
    MAP,
    Batch,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
    decode_batch,
    decode_batch_arrays,
    encode_batch,
    parse_batch,
)
from dynamograph.protocol.kv_events import encode_seq as _seq
from dynamograph.router import kernels
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.index import KvIndex, engine_keys
from dynamograph.router.kv_events import INGEST_INTERVAL_S, KvEventIngest
from dynamograph.router.scheduler import GapInfo, Router

from .report import add_output_argument, print_table, write_json
from .timing import percentiles

BLOCK_SIZE = 16
CACHE_BLOCKS = 4000  # per worker: past it, every batch also evicts


class _TimedRouter(Router):
    """Notes when each batch is applied, against the timestamp its publisher gave it."""

    def __init__(self) -> None:
        super().__init__()
        self.lags: list[float] = []
        self.first_at = self.last_at = 0.0
        self.expected = 0
        self.all_applied = asyncio.Event()  # `expected` batches applied (no polling: no wake-ups)

    def apply_kv_batch(self, worker_id: int, seq: int, batch: Batch) -> GapInfo | None:
        now = time.time()
        if not self.lags:
            self.first_at = now
        self.last_at = now
        self.lags.append(now - batch.ts)
        if len(self.lags) >= self.expected:
            self.all_applied.set()
        return super().apply_kv_batch(worker_id, seq, batch)


def _ingest_main(endpoints: list[str], interval_s: float, conn: Connection) -> None:
    import uvloop

    uvloop.install()
    asyncio.run(_ingest(endpoints, interval_s, conn))


async def _ingest(endpoints: list[str], interval_s: float, conn: Connection) -> None:
    router = _TimedRouter()
    ingest = KvEventIngest(router, interval_s=interval_s)
    for wid, endpoint in enumerate(endpoints, 1):
        router.add_worker(wid, block_size=BLOCK_SIZE, total_blocks=1 << 20)
        config = EngineConfig(
            model="m", served_model_name="m", tokenizer="qwen", name=f"w{wid}", instance_id=wid,
            kv_cache_block_size=BLOCK_SIZE, kv_events=KvEventsEndpoint(endpoint=endpoint),
        )  # fmt: skip
        ingest.add(WorkerRecord(f"w{wid}", wid, f"http://127.0.0.1:{wid}", None, config))
    loop = asyncio.get_running_loop()
    try:
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                return
            expected, within = command.split()  # the next phase's batches, the wait for them
            router.expected = int(expected)
            router.lags.clear()
            router.all_applied.clear()
            conn.send("ready")
            cpu = time.process_time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(router.all_applied.wait(), float(within))
            conn.send(
                {
                    "cpu_s": time.process_time() - cpu,
                    "applied": len(router.lags),
                    "span_s": router.last_at - router.first_at,
                    "lags": router.lags[:],
                }
            )
    finally:
        await ingest.close()


PREFILL, DECODE = "prefill", "decode"  # the streams' shapes (`_Stream`)
DECODE_EVENTS = 8  # requests completing a block in one decode step


class _Stream:
    """One worker's batches: its chain of blocks, its oldest blocks evicted once full. Shaped
    `PREFILL` (as captured from `bench route`): a batch stores 1–63 blocks in one event and
    evicts as many in one. Or `DECODE`, as vLLM's steps look with many requests decoding: 8
    requests each completing one block (an event each), and once full, 8 blocks evicted one
    event each (vLLM evicts block by block)."""

    def __init__(self, rng: np.random.Generator, worker: int, shape: str = PREFILL) -> None:
        self.rng = rng
        self.shape = shape
        self.next_hash = worker << 40
        self.held: list[EngineHash] = []
        self.seq = 0

    def _store(self, n: int) -> BlockStored:
        hashes: list[EngineHash] = list(range(self.next_hash, self.next_hash + n))
        parent = self.held[-1] if self.held else None
        tokens = self.rng.integers(0, 150_000, n * BLOCK_SIZE).tolist()
        self.next_hash += n
        self.held.extend(hashes)
        return BlockStored(hashes, parent, tokens, BLOCK_SIZE)

    def frame(self, layout: str = ARRAY) -> list[bytes]:
        if self.shape == DECODE:
            events: list[Any] = [self._store(1) for _ in range(DECODE_EVENTS)]
            n = DECODE_EVENTS
        else:
            n = int(self.rng.integers(1, 64))
            events = [self._store(n)]
        if len(self.held) > CACHE_BLOCKS:
            evicted, self.held = self.held[:n], self.held[n:]
            if self.shape == DECODE:
                events += [BlockRemoved([h]) for h in evicted]
            else:
                events.append(BlockRemoved(evicted))
        self.seq += 1
        batch = EventBatch(time.time(), events, 0)
        return [b"", _seq(self.seq), encode_batch(batch, layout=layout)]


def _run_phase(
    conn: Connection, pubs: list[zmq.Socket[bytes]], streams: list[_Stream], frames: list[int],
    rate: float | None, within: float = 60.0,
) -> dict[str, Any]:  # fmt: skip
    """Send the batches (worker per batch in `frames`), paced at `rate`/s (each encoded as it is
    sent, with its timestamp) or flat out (all encoded first: the publisher must not be what
    limits the rate)."""
    conn.send(f"{len(frames)} {within}")
    assert conn.recv() == "ready"
    if rate is None:
        encoded = [(worker, streams[worker].frame()) for worker in frames]
        for worker, frame in encoded:
            pubs[worker].send_multipart(frame)
    else:
        start = time.monotonic()
        for i, worker in enumerate(frames):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pubs[worker].send_multipart(streams[worker].frame())
    result: dict[str, Any] = conn.recv()
    return result


def measure(
    interval_s: float, *, workers: int, rate: float, seconds: float, burst: int, seed: int
) -> dict[str, Any]:
    """Paced and flat-out phases against one ingest process using `interval_s`."""
    rng = np.random.default_rng(seed)
    context = zmq.Context()
    pubs, endpoints = [], []
    for _ in range(workers):
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind("tcp://127.0.0.1:*")  # the kernel's pick, bound at once: no port to lose
        endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        pubs.append(pub)
        endpoints.append(endpoint)
    streams = [_Stream(rng, w) for w in range(workers)]
    spawn = multiprocessing.get_context("spawn")
    parent, child = spawn.Pipe()
    process = spawn.Process(target=_ingest_main, args=(endpoints, interval_s, child), daemon=True)
    process.start()
    try:
        # subscriptions reach the PUBs a while after the SUBs connect: a batch to every worker
        # until all arrive
        warm = list(range(workers))
        for _ in range(100):
            if _run_phase(parent, pubs, streams, warm, None, within=0.2)["applied"] == workers:
                break
        paced_frames = [int(w) for w in rng.integers(0, workers, int(rate * seconds))]
        paced = _run_phase(parent, pubs, streams, paced_frames, rate)
        burst_frames = [i % workers for i in range(burst)]
        flat = _run_phase(parent, pubs, streams, burst_frames, None)
        parent.send("stop")
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
        context.destroy(linger=0)
    lags = np.array(paced["lags"]) * 1e3
    blocks_per_batch = 32.0  # the mean of 1..63
    return {
        "interval_ms": interval_s * 1e3,
        "paced_batches_per_s": rate,
        "paced_applied": paced["applied"],
        "cpu_us_per_batch": paced["cpu_s"] / max(paced["applied"], 1) * 1e6,
        "lag_p50_ms": float(np.percentile(lags, 50)) if lags.size else None,
        "lag_p99_ms": float(np.percentile(lags, 99)) if lags.size else None,
        "burst_applied": flat["applied"],
        "burst_cpu_us_per_batch": flat["cpu_s"] / max(flat["applied"], 1) * 1e6,
        "max_batches_per_s": flat["applied"] / flat["span_s"] if flat["span_s"] else None,
        "max_blocks_per_s": flat["applied"] * blocks_per_batch / flat["span_s"]
        if flat["span_s"]
        else None,
    }


# per-batch reading (0), a shorter interval, the shipped one, a longer one (--kv-ingest-interval)
INTERVALS_S = (0.0, 0.02, INGEST_INTERVAL_S, 0.1)


def run(*, workers: int, rate: float, seconds: float, burst: int, seed: int) -> list[dict]:
    """One row per interval of `INTERVALS_S`, in that order."""
    return [
        measure(interval, workers=workers, rate=rate, seconds=seconds, burst=burst, seed=seed)
        for interval in INTERVALS_S
    ]


DECODERS: dict[str, Callable[[bytes], Batch]] = {
    "decode_batch (msgpack → lists)": decode_batch,
    "decode_batch_arrays (compiled)": decode_batch_arrays,
}


def _index_arrays(batch: Batch) -> None:
    """What `KvIndex.apply_events` makes of a batch's events before its kernels run."""
    for event in batch.events:
        if isinstance(event, BlockStored):
            block_hash_array(event.token_ids, event.block_size)
            engine_keys(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            engine_keys(event.block_hashes)


def decode_costs(
    *,
    batches: int,
    workers: int = 4,
    seed: int = 0,
    layouts: tuple[str, ...] = (ARRAY, MAP),
    shape: str = PREFILL,
) -> dict[str, Any]:
    """µs per batch of each decoder in each stage (module docstring), on `batches` of the
    stream (`shape`) in each of `layouts` (the same batches), every (layout, decoder) pair
    taking its turn batch by batch (who goes first alternates)."""
    kernels.warm_up()  # the index's kernels, the block hasher and the parser, as in the EPP
    frames: dict[str, list[tuple[int, bytes]]] = {}
    for layout in layouts:
        rng = np.random.default_rng(seed)
        streams = [_Stream(rng, w, shape) for w in range(workers)]
        frames[layout] = [
            (w % workers, streams[w % workers].frame(layout)[2]) for w in range(batches)
        ]
    names = list(DECODERS)
    pairs = [(layout, name) for layout in layouts for name in names]
    whole, unawaited, one_by_one = ({pair: KvIndex() for pair in pairs} for _ in range(3))
    stages: dict[str, Callable[[str, str, int, bytes], object]] = {
        "decode": lambda _l, name, _w, payload: DECODERS[name](payload),
        "decode + the index's arrays": lambda _l, name, _w, payload: _index_arrays(
            DECODERS[name](payload)
        ),
        "decode + apply to an index, event by event": lambda layout, name, w, payload: one_by_one[
            layout, name
        ].apply_events((w, 0), DECODERS[name](payload).events),
        "decode + apply to an index": lambda layout, name, w, payload: whole[
            layout, name
        ].apply_batch((w, 0), DECODERS[name](payload), BLOCK_SIZE),
        # what the router does while no prefill on the slot waits for stored blocks
        "decode + apply to an index, stored keys unwanted": lambda layout, name, w, payload: (
            unawaited[layout, name].apply_batch(
                (w, 0), DECODERS[name](payload), BLOCK_SIZE, want_stored=False
            )
        ),
    }
    samples = {(stage, *pair): np.empty(batches) for stage in stages for pair in pairs}
    for i in range(batches):
        for stage, fn in stages.items():
            for layout, name in pairs if i % 2 else pairs[::-1]:
                worker, payload = frames[layout][i]
                start = time.perf_counter()
                fn(layout, name, worker, payload)
                samples[stage, layout, name][i] = time.perf_counter() - start
    old, new = names
    rows = []
    for stage in stages:
        for layout in layouts:
            a = percentiles(samples[stage, layout, old])
            b = percentiles(samples[stage, layout, new])
            rows.append(
                {
                    "stage": stage, "layout": layout,
                    "old_p50_us": a["p50"], "new_p50_us": b["p50"],
                    "old_mean_us": a["mean"], "new_mean_us": b["mean"],
                    "old_p99_us": a["p99"], "new_p99_us": b["p99"],
                    "speedup_mean": a["mean"] / b["mean"],
                }
            )  # fmt: skip
    return {
        "batches": batches,
        "shape": shape,
        "workers": workers,
        "old": old,
        "new": new,
        "layouts": list(layouts),
        "mean_payload_bytes": {
            layout: float(np.mean([len(p) for _, p in frames[layout]])) for layout in layouts
        },
        "parsed_by_the_compiled_parser": {
            layout: sum(parse_batch(p) is not None for _, p in frames[layout]) for layout in layouts
        },
        "rows": rows,
    }


def print_decode_costs(costs: dict[str, Any]) -> None:
    per_layout = "; ".join(
        f"{layout}: mean {costs['mean_payload_bytes'][layout]:,.0f} bytes, "
        f"{costs['parsed_by_the_compiled_parser'][layout]:,} read by the compiled parser"
        for layout in costs["layouts"]
    )
    print_table(
        f"KV-event batch decoding, µs per batch: {costs['old']} against {costs['new']}, in turns "
        f"on {costs['batches']:,} batches of the {costs['shape']} stream in each of vLLM's "
        f"layouts ({per_layout})",
        ["stage", "layout", "old p50", "new p50", "old mean", "new mean", "old p99", "new p99",
         "old / new (mean)"],
        [
            [r["stage"], r["layout"], r["old_p50_us"], r["new_p50_us"], r["old_mean_us"],
             r["new_mean_us"], r["old_p99_us"], r["new_p99_us"], r["speedup_mean"]]
            for r in costs["rows"]
        ],
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description="KV-event batch decoding: old vs compiled")
    parser.add_argument("--batches", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shape",
        choices=(PREFILL, DECODE),
        default=PREFILL,
        help="the batches: one event of 1-63 blocks stored (and evicted), as in bench route; or "
        "8 one-block events, and 8 one-block evictions, as vLLM's decode steps",
    )
    add_output_argument(parser)
    args = parser.parse_args()
    costs = decode_costs(batches=args.batches, seed=args.seed, shape=args.shape)
    print_decode_costs(costs)
    write_json(Path(args.out), f"kv_decode_{args.shape}", costs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
