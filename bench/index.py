"""`dynamograph bench index`: our KV index against Dynamo's RadixTree, alternately, same workload.

Workload (seeded): 64 workers × 2,000 blocks. Every worker caches sequences that start with
one of 8 shared prefix families (64–512 blocks of the family) and go on privately; engine
block hashes are a function of the prefix (as vLLM's with a fixed hash seed, what Dynamo's
tree expects). Measured, ours and Dynamo's turn by turn:
- ingest: every worker's blocks as BlockStored events of 1, 16 and 128 blocks (blocks/s, and
  µs per event). Dynamo's `apply_event` gets its RouterEvent JSON with the per-block hashes
  precomputed, so our like-for-like row is `KvIndex.store` with the hashes precomputed too; the
  extra "from vLLM event" row is our real path, hashing the token ids (16 per block) itself.
- find_matches: 1,024-block queries, each a random prefix of a cached sequence (so the matched
  depth is spread from 0 to the whole sequence) followed by unseen blocks; both get a Python
  list of hashes, and who goes first alternates (the first caller reads the list's ints from
  memory, the second from cache). Every answer is checked equal.
- removal: every worker's blocks, leaves first, in events of 16 blocks.
Then the memory of our index holding 256 workers × 100k blocks.
"""

import argparse
import gc
import json
import resource
import time

import numpy as np

from dynamograph.router.index import KvIndex

from .report import add_output_argument, print_table, write_json
from .timing import percentiles

BLOCK_SIZE = 16
_U63 = (1 << 63) - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=2000, help="blocks cached per worker")
    parser.add_argument("--families", type=int, default=8)
    parser.add_argument("--query-blocks", type=int, default=1024)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--event-sizes", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--memory-workers", type=int, default=256)
    parser.add_argument("--memory-blocks", type=int, default=100_000)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    add_output_argument(parser)


class Workload:
    """Sequences of per-block hashes per worker; engine hash = a function of the prefix."""

    def __init__(self, rng: np.random.Generator, workers: int, blocks: int, families: int) -> None:
        self.rng = rng
        self.families = [rng.integers(1, _U63, 512, dtype=np.uint64) for _ in range(families)]
        self.sequences: list[list[np.ndarray]] = []  # per worker: the sequences it caches
        self.stores: list[list[tuple[int | None, np.ndarray, np.ndarray]]] = []
        for _ in range(workers):
            seqs, stores, held = [], [], 0
            fam_done: dict[int, int] = {}
            while held < blocks:
                f = int(rng.integers(families))
                shared = int(rng.integers(64, 513))
                private = int(rng.integers(32, 1024))
                seq = np.concatenate(
                    [self.families[f][:shared], rng.integers(1, _U63, private, dtype=np.uint64)]
                )
                # the worker already holds the family prefix up to `fam_done[f]` blocks
                start = min(fam_done.get(f, 0), shared)
                new = min(seq.size - start, blocks - held)
                if new <= 0:
                    continue
                fam_done[f] = max(fam_done.get(f, 0), shared)
                engine = self.engine_hashes(seq[: start + new])
                parent = int(engine[start - 1]) if start else None
                stores.append((parent, engine[start:], seq[start : start + new]))
                seqs.append(seq[: start + new])
                held += new
            self.sequences.append(seqs)
            self.stores.append(stores)

    @staticmethod
    def engine_hashes(seq: np.ndarray) -> np.ndarray:
        # any deterministic function of the prefix: a different odd multiplier than the index's
        mult = np.uint64(0x9E3779B97F4A7C15)
        keys = np.cumsum(seq * mult, dtype=np.uint64)
        return (keys >> np.uint64(1)) | np.uint64(2)

    def events(self, worker: int, size: int):
        """(parent, engine hashes, local hashes) per event of at most `size` blocks."""
        for parent, engine, local in self.stores[worker]:
            for i in range(0, engine.size, size):
                p = parent if i == 0 else int(engine[i - 1])
                yield p, engine[i : i + size], local[i : i + size]

    def query(self, length: int) -> list[int]:
        w = int(self.rng.integers(len(self.sequences)))
        seq = self.sequences[w][int(self.rng.integers(len(self.sequences[w])))]
        depth = int(self.rng.integers(0, min(seq.size, length) + 1))
        tail = self.rng.integers(1, _U63, length - depth, dtype=np.uint64)
        return np.concatenate([seq[:depth], tail]).tolist()


def dynamo_stored(event_id: int, parent, engine: np.ndarray, local: np.ndarray) -> bytes:
    blocks = [
        {"block_hash": e, "tokens_hash": t}
        for e, t in zip(engine.tolist(), local.tolist(), strict=True)
    ]
    data = {"stored": {"parent_hash": parent, "blocks": blocks}}
    return json.dumps({"event_id": event_id, "dp_rank": 0, "data": data}).encode()


def dynamo_removed(event_id: int, engine: np.ndarray) -> bytes:
    data = {"removed": {"block_hashes": engine.tolist()}}
    return json.dumps({"event_id": event_id, "dp_rank": 0, "data": data}).encode()


def _events_as_vllm(events, rng):
    """The same events with token ids (random; our hashes of them replace the precomputed)."""
    from dynamograph.protocol.kv_events import BlockStored

    out = []
    for parent, engine, local in events:
        tokens = rng.integers(0, 150_000, local.size * BLOCK_SIZE).tolist()
        out.append(BlockStored(engine.tolist(), parent, tokens, BLOCK_SIZE))
    return out


def _rates(seconds: np.ndarray, blocks: int) -> dict:
    return {"blocks_per_s": blocks / seconds.sum(), "event_us": percentiles(seconds)}


def bench_ingest(wl: Workload, size: int, rng) -> tuple[dict, KvIndex, object]:
    """Every event goes to ours, then to Dynamo's, then to ours from the vLLM event: turn by
    turn, each timed on its own, so load on the machine hits all three alike."""
    from dynamo._core import RadixTree

    ours, theirs, vllm_index = KvIndex(), RadixTree(), KvIndex()
    t_ours, t_theirs, t_vllm, n_blocks = [], [], [], 0
    event_id = 0
    clock = time.perf_counter
    for w in range(len(wl.stores)):
        events = list(wl.events(w, size))
        lists = [(p, e.tolist(), loc.tolist()) for p, e, loc in events]
        payloads = []
        for p, e, loc in events:
            event_id += 1
            payloads.append(dynamo_stored(event_id, p, e, loc))
        vllm = _events_as_vllm(events, rng)
        slot = (w, 0)
        gc.disable()
        for (p, e, loc), payload, event in zip(lists, payloads, vllm, strict=True):
            start = clock()
            ours.store(slot, e, p, loc)
            mid = clock()
            theirs.apply_event(w, payload)
            end = clock()
            vllm_index.apply_events(slot, [event])
            t_vllm.append(clock() - end)
            t_ours.append(mid - start)
            t_theirs.append(end - mid)
            n_blocks += len(e)
        gc.enable()
    result = {
        "event_blocks": size,
        "events": len(t_ours),
        "blocks": n_blocks,
        "dynamo": _rates(np.array(t_theirs), n_blocks),
        "ours": _rates(np.array(t_ours), n_blocks),
        "ours_from_vllm_event": _rates(np.array(t_vllm), n_blocks),
    }
    return result, ours, theirs


def bench_find(wl: Workload, ours: KvIndex, theirs, queries: int, length: int) -> dict:
    qs = [wl.query(length) for _ in range(queries)]
    t_ours, t_theirs, depths = np.empty(queries), np.empty(queries), []
    for q in qs[:20]:  # warm-up
        ours.find_matches(q)
        theirs.find_matches(q)
    gc.disable()
    clock = time.perf_counter
    for i, q in enumerate(qs):
        # who goes first alternates: the first to read a query's ints pays their cache misses
        if i % 2:
            start = clock()
            b = theirs.find_matches(q)
            mid = clock()
            a = ours.find_matches(q)
            t_ours[i], t_theirs[i] = clock() - mid, mid - start
        else:
            start = clock()
            a = ours.find_matches(q)
            mid = clock()
            b = theirs.find_matches(q)
            t_ours[i], t_theirs[i] = mid - start, clock() - mid
        b = {k: v for k, v in b.scores.items() if v}
        if a != b:
            raise AssertionError(f"query {i}: ours {a} != dynamo {b}")
        depths.append(max(a.values(), default=0))
    gc.enable()
    return {
        "queries": queries,
        "query_blocks": length,
        "matched_depth": percentiles(np.array(depths, float), scale=1),
        "dynamo_us": percentiles(t_theirs),
        "ours_us": percentiles(t_ours),
    }


def bench_remove(wl: Workload, ours: KvIndex, theirs, size: int = 16) -> dict:
    t_ours, t_theirs, n_blocks = [], [], 0
    event_id = 10**9
    clock = time.perf_counter
    for w in range(len(wl.stores)):
        engine = np.concatenate([e for _, e, _ in wl.stores[w]])[::-1]  # leaves first
        chunks = [engine[i : i + size] for i in range(0, engine.size, size)]
        payloads = []
        for c in chunks:
            event_id += 1
            payloads.append(dynamo_removed(event_id, c))
        lists = [c.tolist() for c in chunks]
        slot = (w, 0)
        gc.disable()
        for hashes, payload in zip(lists, payloads, strict=True):
            start = clock()
            ours.remove(slot, hashes)
            mid = clock()
            theirs.apply_event(w, payload)
            t_theirs.append(clock() - mid)
            t_ours.append(mid - start)
        gc.enable()
        n_blocks += engine.size
    assert ours.total_blocks() == 0 and ours.distinct_blocks() == 0
    return {
        "event_blocks": size,
        "blocks": n_blocks,
        "dynamo": _rates(np.array(t_theirs), n_blocks),
        "ours": _rates(np.array(t_ours), n_blocks),
    }


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_memory(workers: int, blocks: int, families: int, seed: int) -> dict:
    """Our index holding `workers` × `blocks`: sequences of 64–512 shared family blocks followed
    by private blocks, stored in events of 128 blocks."""
    rng = np.random.default_rng(seed)
    fams = [rng.integers(1, _U63, 512, dtype=np.uint64) for _ in range(families)]
    gc.collect()
    before = _rss_bytes()
    index = KvIndex()
    start = time.perf_counter()
    for w in range(workers):
        held, fam_done = 0, dict[int, int]()
        while held < blocks:
            f = int(rng.integers(families))
            shared = int(rng.integers(64, 513))
            seq = np.concatenate([fams[f][:shared], rng.integers(1, _U63, 2048, dtype=np.uint64)])
            begin = min(fam_done.get(f, 0), shared)
            fam_done[f] = max(fam_done.get(f, 0), shared)
            new = min(seq.size - begin, blocks - held)
            engine = Workload.engine_hashes(seq[: begin + new]) ^ np.uint64(w << 20)
            for i in range(begin, begin + new, 128):
                parent = int(engine[i - 1]) if i else None
                index.store((w, 0), engine[i : i + 128], parent, seq[i : min(i + 128, begin + new)])
            held += new
    elapsed = time.perf_counter() - start
    gc.collect()
    after = _rss_bytes()
    return {
        "workers": workers,
        "blocks_per_worker": blocks,
        "pairs": index.total_blocks(),
        "distinct_blocks": index.distinct_blocks(),
        "array_bytes": index.nbytes,
        "rss_delta_bytes": after - before,
        "peak_rss_bytes": _peak_rss_bytes(),
        "bytes_per_pair": (after - before) / max(index.total_blocks(), 1),
        "build_s": elapsed,
    }


def run(args: argparse.Namespace) -> int:
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        print("bench index needs PyPI ai-dynamo-runtime (the dev extra) for the comparison")
        return 2
    from dynamograph.router.kernels import warm_up

    start = time.perf_counter()
    warm_up()  # what the EPP pays once at startup (numba's cache loaded, or a compile)
    warm_up_s = time.perf_counter() - start
    print(f"index kernels ready in {warm_up_s:.2f} s")
    rng = np.random.default_rng(args.seed)
    wl = Workload(rng, args.workers, args.blocks, args.families)
    ingest, built = [], {}
    for size in args.event_sizes:
        result, ours, theirs = bench_ingest(wl, size, rng)
        ingest.append(result)
        built[size] = (ours, theirs)
    # query and remove on one pair of identical indexes (the 16-block run when there is one)
    ours, theirs = built.get(16) or built[args.event_sizes[-1]]
    built.clear()
    find = bench_find(wl, ours, theirs, args.queries, args.query_blocks)
    remove = bench_remove(wl, ours, theirs)
    rows = []
    for r in ingest:
        d, o, v = r["dynamo"], r["ours"], r["ours_from_vllm_event"]
        r["ratio_blocks_per_s"] = o["blocks_per_s"] / d["blocks_per_s"]
        r["ratio_from_vllm_event"] = v["blocks_per_s"] / d["blocks_per_s"]
        # the typical event, robust to the machine's load: Dynamo's p50 over ours
        r["ratio_p50_speed"] = d["event_us"]["p50"] / o["event_us"]["p50"]
        rows.append(
            [
                f"{r['event_blocks']}-block events",
                d["blocks_per_s"],
                o["blocks_per_s"],
                v["blocks_per_s"],
                r["ratio_blocks_per_s"],
                d["event_us"]["p50"],
                o["event_us"]["p50"],
                v["event_us"]["p50"],
                r["ratio_p50_speed"],
            ]
        )
    print_table(
        f"KV index ingest, {args.workers} workers × {args.blocks} blocks (ratios > 1: ours faster)",
        [
            "events",
            "dynamo blocks/s",
            "ours blocks/s",
            "ours from vLLM event",
            "ratio blocks/s",
            "dynamo p50 µs/event",
            "ours p50 µs/event",
            "ours vLLM p50 µs",
            "ratio p50",
        ],
        rows,
    )
    d_us, o_us = find["dynamo_us"], find["ours_us"]
    find["ratio_p50"] = o_us["p50"] / d_us["p50"]
    find["ratio_p99"] = o_us["p99"] / d_us["p99"]
    d_rm, o_rm = remove["dynamo"], remove["ours"]
    remove["ratio_blocks_per_s"] = o_rm["blocks_per_s"] / d_rm["blocks_per_s"]
    remove["ratio_p50_speed"] = d_rm["event_us"]["p50"] / o_rm["event_us"]["p50"]
    print_table(
        "KV index latency (µs, lower is better; ratio = ours/dynamo)",
        ["operation", "dynamo p50", "dynamo p99", "ours p50", "ours p99", "ratio p50", "ratio p99"],
        [
            [
                f"find_matches, {args.query_blocks}-block query",
                d_us["p50"],
                d_us["p99"],
                o_us["p50"],
                o_us["p99"],
                find["ratio_p50"],
                find["ratio_p99"],
            ],
            [
                f"removal, {remove['event_blocks']}-block event",
                d_rm["event_us"]["p50"],
                d_rm["event_us"]["p99"],
                o_rm["event_us"]["p50"],
                o_rm["event_us"]["p99"],
                o_rm["event_us"]["p50"] / d_rm["event_us"]["p50"],
                o_rm["event_us"]["p99"] / d_rm["event_us"]["p99"],
            ],
        ],
    )
    print(
        f"removal: dynamo {d_rm['blocks_per_s']:,.0f} blocks/s, ours {o_rm['blocks_per_s']:,.0f} "
        f"blocks/s (ratio {remove['ratio_blocks_per_s']:.2f}); find_matches matched depth p50 "
        f"{find['matched_depth']['p50']:.0f} blocks"
    )
    memory = None
    if not args.skip_memory:
        memory = bench_memory(args.memory_workers, args.memory_blocks, args.families, args.seed)
        print_table(
            f"our index holding {args.memory_workers} workers × {args.memory_blocks:,} blocks",
            [
                "pairs",
                "distinct",
                "array MiB",
                "RSS delta MiB",
                "peak RSS MiB",
                "B/pair",
                "build s",
            ],
            [
                [
                    memory["pairs"],
                    memory["distinct_blocks"],
                    memory["array_bytes"] / 2**20,
                    memory["rss_delta_bytes"] / 2**20,
                    memory["peak_rss_bytes"] / 2**20,
                    memory["bytes_per_pair"],
                    memory["build_s"],
                ]
            ],
        )
    write_json(
        args.out,
        "index",
        {
            "workload": {
                "workers": args.workers,
                "blocks_per_worker": args.blocks,
                "families": args.families,
                "query_blocks": args.query_blocks,
                "queries": args.queries,
                "seed": args.seed,
            },
            "kernels_warm_up_s": warm_up_s,
            "ingest": ingest,
            "find_matches": find,
            "removal": remove,
            "memory": memory,
            "targets": {"find_matches_ratio_p50_max": 1.0, "ingest_ratio_min": 1.0},
        },
    )
    return 0
