"""`dynamograph bench route`: routing quality on a real trace, ours against the routers people use.

Replays a Mooncake-format trace (default: the FAST'25 synthetic trace) open-loop against one
fleet of mock workers with finite KV caches, once per routing policy, with the same arrivals
and prompts each time and a freshly started (cold) fleet for every policy. Arrivals are
compressed by `--compression` and the engines simulate their GPU that much faster, so the run
is the trace at its real pace, in less wall time; latencies are reported in trace seconds.

Prints a table, writes `route.json` and PNG plots under the results folder (`--out`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from dynamograph.local.procs import PortPool
from dynamograph.protocol.tokenization import get_tokenizer

from .report import add_output_argument, print_table, write_json
from .route_client import completion_body, replay
from .route_fleet import WorkerSpec, scrape_workers, stop_all, wait_http, worker_procs
from .route_metrics import PolicyMetrics, summarize
from .route_plots import write_plots
from .route_routers import DEFAULT_POLICIES, POLICIES, serve
from .trace import DEFAULT_TRACE, compress, inherent_reuse, load_trace

log = logging.getLogger(__name__)

QUICK = {"workers": 4, "limit": 600, "compression": 10.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help=f"Mooncake JSONL (default: {DEFAULT_TRACE})",
    )
    parser.add_argument("--workers", type=int, default=None, help="mock workers (default 8)")
    parser.add_argument(
        "--limit", type=int, default=None, help="replay only the first N requests (default: all)"
    )
    parser.add_argument(
        "--compression",
        type=float,
        default=None,
        help="time compression: arrivals this many times faster, engines simulate this many "
        "times faster (default 8)",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=list(POLICIES),
        default=DEFAULT_POLICIES,
        metavar="POLICY",
        help=f"policies to compare, in order (default: all: {' '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a few minutes: {QUICK['workers']} workers, the first {QUICK['limit']} requests, "
        f"compression {QUICK['compression']:g} (explicit flags win)",
    )
    spec = WorkerSpec()
    parser.add_argument("--model", default=spec.model, help="served model name of the fleet")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=spec.num_gpu_blocks,
        help="KV blocks per worker (default: an 8B model's KV cache on one 80 GB GPU)",
    )
    parser.add_argument("--block-size", type=int, default=spec.block_size)
    parser.add_argument(
        "--max-in-flight", type=int, default=1024, help="client cap; arrivals over it are shed"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="per-request timeout, wall seconds"
    )
    add_output_argument(parser)


@dataclass(frozen=True)
class Setup:
    workers: int
    limit: int | None
    compression: float


def resolve(args: argparse.Namespace) -> Setup:
    base = QUICK if args.quick else {"workers": 8, "limit": None, "compression": 8.0}
    setup = Setup(
        workers=args.workers if args.workers is not None else base["workers"],
        limit=args.limit if args.limit is not None else base["limit"],
        compression=args.compression if args.compression is not None else base["compression"],
    )
    if setup.workers < 1 or setup.compression <= 0:
        raise ValueError("--workers must be ≥ 1 and --compression > 0")
    return setup


async def _run_policy(name, setup, spec, offsets, bodies, args, logs):
    policy = POLICIES[name]
    ports = PortPool()
    workers = worker_procs(setup.workers, spec, logs / name, ports)
    ports.release()
    procs = [w.proc for w in workers]
    for p in procs:
        p.start()
    try:
        await asyncio.gather(*(wait_http(w.proc, w.url + "/health", within_s=120) for w in workers))
        async with serve(policy, workers, ports, logs / name) as url:
            print(f"  {name}: replaying {len(offsets)} requests via {url} ...", flush=True)
            results, wall = await replay(
                url,
                offsets,
                bodies.__getitem__,
                max_in_flight=args.max_in_flight,
                timeout_s=args.timeout,
            )
            stats = await scrape_workers(workers)
    finally:
        await asyncio.to_thread(stop_all, procs)
    queries = sum(s.prefix_queries for s in stats.values())
    hits = sum(s.prefix_hits for s in stats.values())
    return (
        results,
        wall,
        {w: int(s.requests) for w, s in stats.items()},
        (hits / queries if queries else None),
    )


async def _run(args, setup: Setup) -> int:
    requests = load_trace(args.trace, setup.limit)
    reuse = inherent_reuse(requests)
    offsets = compress(requests, setup.compression)
    spec = WorkerSpec(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        speedup=setup.compression,
    )
    span = offsets[-1] * setup.compression
    print(
        f"trace {args.trace}: {len(requests)} requests over {span:,.0f} s, inherent reuse "
        f"{reuse:.1%}; {setup.workers} workers × {spec.num_gpu_blocks} blocks of "
        f"{spec.block_size}; compression {setup.compression:g} (≈{offsets[-1]:.0f} s per policy)",
        flush=True,
    )
    # Prompts are synthesised once, before any replay: every policy gets the same bytes and
    # synthesis costs nothing on the clock.
    from .trace import PromptSynthesizer

    synth = PromptSynthesizer(get_tokenizer("qwen"))
    bodies = [completion_body(args.model, synth.text(r), r.output_length) for r in requests]
    logs = args.out / "route-logs"
    metrics: list[PolicyMetrics] = []
    all_results = {}
    for name in args.policies:
        started = time.monotonic()
        results, wall, per_worker, worker_hits = await _run_policy(
            name, setup, spec, offsets, bodies, args, logs
        )
        m = summarize(
            name,
            results,
            inherent_reuse=reuse,
            time_scale=setup.compression,
            wall_s=wall,
            per_worker_requests=per_worker,
            worker_hit_rate=worker_hits,
        )
        metrics.append(m)
        all_results[name] = results
        print(
            f"  {name}: done in {time.monotonic() - started:.0f} s; ok {m.ok}, shed {m.shed}, "
            f"errors {m.errors}" + (f" (first: {m.first_error})" if m.first_error else ""),
            flush=True,
        )
    _report(args, setup, spec, requests, reuse, metrics, all_results)
    return 0


def _report(args, setup, spec, requests, reuse, metrics, all_results) -> None:
    rr = next((m for m in metrics if m.policy == "round-robin"), None)
    rows = []
    for m in metrics:
        speedup = rr.ttft_p50_s / m.ttft_p50_s if rr and rr.ttft_p50_s and m.ttft_p50_s else None
        rows.append(
            [
                m.policy,
                _s(m.ttft_p50_s),
                _s(m.ttft_p90_s),
                _s(m.ttft_p99_s),
                _s(m.e2e_p50_s),
                _s(m.e2e_p99_s),
                f"{m.throughput_tok_s:,.0f}",
                f"{m.hit_rate:.1%}",
                f"{m.reuse_captured:.1%}",
                f"{m.imbalance:.2f}" if m.imbalance else "-",
                str(m.shed),
                str(m.errors),
                f"{speedup:.2f}×" if speedup else "-",
            ]
        )
    title = f"{len(requests)} requests, {setup.workers} workers, inherent reuse {reuse:.1%}"
    print_table(
        f"routing quality ({title}; latencies in trace seconds)",
        [
            "policy",
            "TTFT p50",
            "p90",
            "p99",
            "e2e p50",
            "e2e p99",
            "out tok/s",
            "hit rate",
            "reuse captured",
            "imbalance",
            "shed",
            "errors",
            "p50 vs RR",
        ],
        rows,
    )
    write_json(
        args.out,
        "route",
        {
            "trace": str(args.trace),
            "requests": len(requests),
            "inherent_reuse": reuse,
            "workers": setup.workers,
            "compression": setup.compression,
            "worker_spec": spec.__dict__,
            "policies": {m.policy: m.as_dict() for m in metrics},
            "descriptions": {m.policy: POLICIES[m.policy].description for m in metrics},
        },
    )
    for path in write_plots(
        args.out,
        metrics,
        all_results,
        inherent_reuse=reuse,
        time_scale=setup.compression,
        title=title,
    ):
        print(f"wrote {path}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def run(args: argparse.Namespace) -> int:
    try:
        setup = resolve(args)
    except ValueError as exc:
        print(f"bench route: {exc}")
        return 2
    return asyncio.run(_run(args, setup))
