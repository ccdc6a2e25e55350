"""`dynamograph bench route`: routing quality on a real trace, ours against the routers people use.

Replays a Mooncake-format trace (default: the FAST'25 synthetic trace) open-loop against one
fleet of mock workers with finite KV caches, once per routing policy, with the same arrivals
and prompts each time, the fleet's KV caches reset (cold) before every policy. Arrivals are
compressed by `--compression` and the engines simulate their GPU that much faster, so the run
is the trace at its real pace, in less wall time; latencies are reported in trace seconds.

Prints a table, writes `route.json` and PNG plots under the results folder (`--out`).

`--workload fanout` replays groups of requests sent at once over one new long context
(`trace.fanout_trace`), the case for `RouterConfig.booked_prefix_hits`.
`--workload multiturn` replays our multi-turn chat generator (`bench/workload.py`) instead of
the trace, and `--sweep RATES|auto` runs every policy at each of several request rates on the
same fleet (`bench/route_sweep.py`); both write `route_sweep.json` and `route_sweep.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dynamograph.local.procs import PortPool
from dynamograph.protocol.tokenization import get_tokenizer

from .procstat import GroupUsage, Watch, total_usage
from .report import add_output_argument, print_table, write_json
from .route_client import completion_body, replay, warm_up
from .route_fleet import (
    LaunchError,
    WorkerSpec,
    reset_caches,
    running_fleet,
    scrape_workers,
    worker_spec,
)
from .route_metrics import (
    OK,
    OUTSIDE_PARTS,
    PolicyMetrics,
    gateway_phases,
    router_cost,
    summarize,
)
from .route_plots import write_plots
from .route_routers import DEFAULT_POLICIES, POLICIES, serve, unavailable
from .trace import (
    DEFAULT_TRACE,
    PromptSynthesizer,
    TraceError,
    compress,
    fanout_trace,
    inherent_reuse,
    load_trace,
    resolve_trace,
    sample_families,
)

log = logging.getLogger(__name__)

FULL = {"workers": 8, "families": 0.25, "compression": 6.0}
QUICK = {"workers": 4, "families": 0.1, "compression": 50.0}
# --workload multiturn: the window per rate in workload seconds, and a milder compression (its
# rates are already high; the wall rate is the workload rate × compression).
MULTITURN_FULL = {"workers": 8, "duration": 180.0, "compression": 2.0}
MULTITURN_QUICK = {"workers": 4, "duration": 60.0, "compression": 3.0}
# Seconds the router sits idle before a replay, to measure its background CPU.
ROUTER_IDLE_S = 3.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=["mooncake", "multiturn", "fanout"],
        default="mooncake",
        help="mooncake: replay the trace (default); multiturn: our multi-turn chat generator "
        "(bench/workload.py: sessions of 3-15 growing turns with think time, plus documents); "
        "fanout: every second 8 requests at once over one new 20k-token context "
        "(bench/trace.py fanout_trace)",
    )
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="RATES",
        help="run every policy at each request rate (requests/s, workload clock), e.g. 2,4,8,16, "
        "or 'auto': double from --rate until every policy saturates (sheds, or engine TTFT p50 "
        "over --ttft-bound); table, route_sweep.json and route_sweep.png",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="multiturn: requests/s (default 4); --sweep auto: the first rate (default 2)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="multiturn: arrival window per rate, workload seconds "
        f"(default {MULTITURN_FULL['duration']:g}, quick {MULTITURN_QUICK['duration']:g})",
    )
    parser.add_argument(
        "--think-time",
        type=float,
        default=2.0,
        help="multiturn: median user think time between turns, s (plus the answer's time)",
    )
    parser.add_argument(
        "--api",
        choices=["completions", "chat"],
        default="completions",
        help="multiturn: send each conversation as /v1/completions with the chat template "
        "applied (default; every router then passes the engine's timing back) or as "
        "/v1/chat/completions (sglang-router 0.3.2 drops nvext from chat requests: no engine "
        "TTFT for it)",
    )
    parser.add_argument("--seed", type=int, default=0, help="multiturn, fanout: workload seed")
    parser.add_argument(
        "--max-context",
        type=int,
        default=30_000,
        help="multiturn: no prompt + answer exceeds this many tokens (sessions end there, "
        "documents are cut to fit)",
    )
    parser.add_argument(
        "--ttft-bound",
        type=float,
        default=2.0,
        help="--sweep: a policy whose engine TTFT p50 exceeds this (simulated s) is saturated",
    )
    parser.add_argument(
        "--max-rate", type=float, default=256.0, help="--sweep auto: stop doubling past this"
    )
    parser.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help=f"Mooncake JSONL (default: {DEFAULT_TRACE})",
    )
    parser.add_argument("--workers", type=int, default=None, help="mock workers (default 8)")
    parser.add_argument(
        "--families",
        type=float,
        default=None,
        help="replay a seeded fraction of the trace's prefix families, whole "
        f"(default {FULL['families']:g}, quick {QUICK['families']:g}; 1 = the whole trace)",
    )
    parser.add_argument(
        "--limit", type=int, default=None, help="then keep only the first N requests"
    )
    parser.add_argument(
        "--compression",
        type=float,
        default=None,
        help="time compression: arrivals this many times faster, engines simulate this many "
        f"times faster (default {FULL['compression']:g}, quick {QUICK['compression']:g})",
    )
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=list(POLICIES),
        default=DEFAULT_POLICIES,
        metavar="POLICY",
        help=f"policies to compare, in order (default: {' '.join(DEFAULT_POLICIES)}; also "
        "gaie-epp, llmd-epp and llmd-precise, the field's EPPs: make counterparts, make "
        "control-plane; dynamo-kv: scripts/setup-dynamo.sh)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        # argparse expands `%` in help text: a literal percent sign is `%%`.
        help=f"a few minutes: {QUICK['workers']} workers, {QUICK['families'] * 100:.0f}%% of the "
        f"prefix families, compression {QUICK['compression']:g} (explicit flags win)",
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
        "--worker-nice",
        type=int,
        choices=range(20),
        default=spec.nice,
        metavar="0-19",
        help="run the mock workers this much nicer than the bench (nice -n): they stand for GPU "
        "engines on hosts of their own, so the routers under test and Envoy get this box's CPU "
        "first (default 0: every process equal)",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="stream answers (client-side TTFT too); every token then crosses the router, which "
        "costs this host CPU that the time compression multiplies",
    )
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
    families: float
    compression: float
    limit: int | None = None
    duration: float = MULTITURN_FULL["duration"]


def resolve(args: argparse.Namespace) -> Setup:
    base: dict[str, Any] = QUICK if args.quick else FULL
    if getattr(args, "workload", "mooncake") == "multiturn":
        multi = MULTITURN_QUICK if args.quick else MULTITURN_FULL
        base = {**base, **multi}
    setup = Setup(
        workers=args.workers if args.workers is not None else base["workers"],
        families=args.families if args.families is not None else base["families"],
        compression=args.compression if args.compression is not None else base["compression"],
        limit=args.limit,
        duration=args.duration if args.duration is not None else base.get("duration", 0.0) or 1.0,
    )
    if setup.workers < 1 or setup.compression <= 0 or not 0 < setup.families <= 1:
        raise ValueError("--workers must be ≥ 1, --compression > 0, --families in (0, 1]")
    if setup.duration <= 0:
        raise ValueError("--duration must be positive")
    return setup


async def _run_policy(name, workers, offsets, bodies, args, logs, time_scale):
    """One policy on the running fleet, its caches reset first, the router warmed up (not
    counted); counters are deltas from after the warm-up. A foreign EPP routes to twins of
    the fleet at pod IPs (bench/route_foreign_epp.py): those are reset and scraped instead."""
    await reset_caches(workers)
    ports = PortPool()
    async with serve(POLICIES[name], workers, ports, logs / name, model=args.model) as routed:
        url, workers = routed.url, routed.workers
        await warm_up(url, args.model)
        await _settle(routed)
        # The router's background work (metric scrapes, KV-event sockets) costs CPU per second,
        # not per request: measured idle first, so the per-request cost is also given net of it.
        idle_before, idle_start = _router_cpu(routed), time.monotonic()
        await asyncio.sleep(ROUTER_IDLE_S)
        idle_rate = (_router_cpu(routed) - idle_before) / (time.monotonic() - idle_start)
        before = await scrape_workers(workers)
        groups = {
            "router": routed.pids,
            "gateway": routed.gateway_pids,
            "workers": [w.proc.popen.pid for w in workers if w.proc.popen is not None],
        }
        if routed.relay_pids:
            groups["relays"] = routed.relay_pids
        watch = Watch(groups)
        replay_start = time.time()  # the gateway's access log counts from here (no warm-up)
        print(f"  {name}: replaying {len(offsets)} requests via {url} ...", flush=True)
        results, wall = await replay(
            url,
            offsets,
            bodies.__getitem__,
            max_in_flight=args.max_in_flight,
            timeout_s=args.timeout,
        )
        host = watch.read()
        after = await scrape_workers(workers)
        if routed.engine_view is not None:
            await routed.engine_view(results)
    _write_router_cpu(logs / name / "router_cpu.json", name, host, idle_rate, wall, results)
    if routed.access_log is not None:  # Envoy has stopped: its access log is complete
        _write_gateway_phases(
            logs / name / "gateway_phases.json",
            name,
            routed.access_log,
            replay_start,
            results,
            time_scale,
        )
    delta = {w: after[w].minus(before[w]) for w in after}
    queries = sum(s.prefix_queries for s in delta.values())
    hits = sum(s.prefix_hits for s in delta.values())
    return (
        results,
        wall,
        {w: int(s.requests) for w, s in delta.items()},
        (hits / queries if queries else None),
        host,
    )


async def _run(args, setup: Setup) -> int:
    if getattr(args, "workload", "mooncake") == "fanout":
        args.trace = "fan-out workload"  # groups share nothing: no families to sample
        requests = fanout_trace(seed=args.seed)
    else:
        args.trace = resolve_trace(args.trace)
        requests = load_trace(args.trace)
    if setup.families < 1 and args.trace != "fan-out workload":
        requests = sample_families(requests, setup.families)
    requests = requests[: setup.limit]
    reuse = inherent_reuse(requests)
    offsets = compress(requests, setup.compression)
    spec = worker_spec(args, setup.compression)
    span = offsets[-1] * setup.compression
    print(
        f"trace {args.trace}: {len(requests)} requests over {span:,.0f} s, inherent reuse "
        f"{reuse:.1%}; {setup.workers} workers × {spec.num_gpu_blocks} blocks of "
        f"{spec.block_size}; compression {setup.compression:g} (≈{offsets[-1]:.0f} s per policy)",
        flush=True,
    )
    # Prompts are synthesised once, before any replay: every policy gets the same bytes and
    # synthesis costs nothing on the clock.
    synth = PromptSynthesizer(get_tokenizer("qwen"))
    bodies = [
        completion_body(args.model, synth.text(r), r.output_length, stream=args.stream)
        for r in requests
    ]
    logs = args.out / "route-logs"
    metrics: list[PolicyMetrics] = []
    all_results = {}
    async with running_fleet(setup.workers, spec, logs / "fleet") as workers:
        for name in args.policies:
            m, results = await _measure(name, setup, workers, reuse, offsets, bodies, args, logs)
            metrics.append(m)
            all_results[name] = results
    _report(args, setup, spec, requests, reuse, metrics, all_results)
    return 0


async def _measure(name, setup, workers, reuse, offsets, bodies, args, logs):
    started = time.monotonic()
    results, wall, per_worker, worker_hits, host = await _run_policy(
        name, workers, offsets, bodies, args, logs, setup.compression
    )
    m = summarize(
        name,
        results,
        inherent_reuse=reuse,
        time_scale=setup.compression,
        wall_s=wall,
        per_worker_requests=per_worker,
        worker_hit_rate=worker_hits,
        host=host,
    )
    _write_requests(logs / name / "requests.jsonl", results)
    print(
        f"  {name}: done in {time.monotonic() - started:.0f} s; ok {m.ok}, shed {m.shed}, "
        f"errors {m.errors}" + (f" (first: {m.first_error})" if m.first_error else ""),
        flush=True,
    )
    return m, results


def _report(args, setup, spec, requests, reuse, metrics, all_results) -> None:
    rr = next((m for m in metrics if m.policy == "round-robin"), None)
    title = f"{len(requests)} requests, {setup.workers} workers, inherent reuse {reuse:.1%}"
    quality, latency = [], []
    for m in metrics:
        vs_rr = rr.ttft_p50_s / m.ttft_p50_s if rr and rr.ttft_p50_s and m.ttft_p50_s else None
        quality.append(
            [
                m.policy,
                _s(m.ttft_p50_s),
                _s(m.ttft_p90_s),
                _s(m.ttft_p99_s),
                f"{vs_rr:.2f}x" if vs_rr else "-",
                f"{m.hit_rate:.1%}",
                f"{m.reuse_captured:.1%}",
                f"{m.imbalance:.2f}" if m.imbalance else "-",
            ]
        )
        latency.append(
            [
                m.policy,
                _s(m.client_ttft_p50_s),
                _s(m.e2e_p50_s),
                _s(m.e2e_p99_s),
                _s(m.outside_engine_p50_s),
                f"{m.throughput_tok_s:,.0f}",
                f"{m.ok}/{m.requests}",
                str(m.shed),
                str(m.errors),
                _s(m.router_cpu_ms_per_request, 2),
                _s(m.router_cpu_wait_ms_per_request, 2),
                "-" if m.host_busy is None else f"{m.host_busy:.0%}",
            ]
        )
    print_table(
        f"routing quality: {title} (TTFT: engine-reported, simulated seconds)",
        ["policy", "TTFT p50", "p90", "p99", "p50 vs RR", "hit rate", "reuse capt.", "imbal."],
        quality,
    )
    print_table(
        f"client view (wall x {setup.compression:g} = trace seconds; the router's CPU and its "
        "wait for a CPU: wall ms per request; host: its CPUs busy)",
        [
            "policy",
            "TTFT p50",
            "e2e p50",
            "e2e p99",
            "outside",
            "out tok/s",
            "ok",
            "shed",
            "err",
            "CPU",
            "wait",
            "host",
        ],
        latency,
    )
    write_json(
        args.out,
        "route",
        {
            "trace": str(args.trace),
            "requests": len(requests),
            "inherent_reuse": reuse,
            "workers": setup.workers,
            "families": setup.families,
            "compression": setup.compression,
            "stream": args.stream,
            "worker_spec": spec.__dict__,
            "policies": {m.policy: m.as_dict() for m in metrics},
            "descriptions": {m.policy: POLICIES[m.policy].description for m in metrics},
        },
    )
    for path in write_plots(args.out, metrics, all_results, inherent_reuse=reuse, title=title):
        print(f"wrote {path}")


async def _settle(routed, within: float = 30.0) -> None:
    """Until the router's start-up work is done (a new EPP indexes the workers' KV-event history
    by replay: up to 10,000 batches a worker, seconds of a busy core that belong to no request):
    its CPU over half a second under a third of a core (GAIE's EPP idles at ~17 % scraping), or
    `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        before = _router_cpu(routed)
        await asyncio.sleep(0.5)
        if _router_cpu(routed) - before < 0.5 / 3:
            return


def _router_cpu(routed) -> float:
    return total_usage(routed.pids).cpu_s


def _write_router_cpu(
    path: Path, name: str, host: GroupUsage, idle_rate: float, wall_s: float, results
) -> None:
    """The router processes' CPU time over the replay (the EPPs, not Envoy), per request answered
    200, whole and net of the idle rate measured before, and what the host's CPUs did meanwhile
    (`host`: how busy, and how long the router, the gateway and the workers ran and waited for
    a CPU): printed and kept beside the logs. A router that waits for a CPU as long as it runs
    is measured on a box out of CPU, not on its own merit."""
    routed = sum(1 for r in results if r.status == OK)
    cpu_s = host.groups["router"].cpu_s
    net_s = max(0.0, cpu_s - idle_rate * wall_s)
    cost = router_cost(host, routed)
    per_request_ms = cost.get("router_cpu_ms_per_request")
    net_ms = net_s / routed * 1e3 if routed else None
    print(
        f"  {name}: router CPU {cpu_s:.2f} s over {wall_s:.0f} s wall (idle {idle_rate:.1%} of "
        "a core)"
        + (f", {per_request_ms:.2f} ms per routed request, {net_ms:.2f} net" if routed else ""),
        flush=True,
    )

    def ran_waited(who: str, u) -> str:
        return f"{who} {u.cpu_s / host.seconds:.2f} / {u.wait_s / host.seconds:.2f}"

    threads = sorted(host.threads["router"].items(), key=lambda kv: -kv[1].cpu_s)[:3]
    print(
        f"  {name}: host CPUs {host.host_busy:.0%} busy; cores' worth ran / waited for a CPU: "
        + ", ".join(ran_waited(g, u) for g, u in host.groups.items() if u.cpu_s > 0)
        + "; the router's busiest threads: "
        + ", ".join(ran_waited(t, u) for t, u in threads),
        flush=True,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(
        orjson.dumps(
            {
                "cpu_s": cpu_s,
                "idle_cpu_per_s": idle_rate,
                "wall_s": wall_s,
                "routed": routed,
                "cpu_ms_per_request": per_request_ms,
                "net_cpu_ms_per_request": net_ms,
                "cpu_wait_ms_per_request": cost.get("router_cpu_wait_ms_per_request"),
                "host": host.as_json(),
            }
        )
    )


def _write_gateway_phases(
    path: Path, name: str, access_log: Path, since: float, results, time_scale: float
) -> None:
    """Where the replay's requests (those that came at `since` or later) spent their time at
    the gateway, from its access log, and their time outside the engine in parts (joined with
    the client's `results`): printed and kept beside the logs."""
    with access_log.open("rb") as f:
        phases = gateway_phases(f, since, results, time_scale)

    def ms(p: dict) -> str:
        return "/".join("-" if p[q] is None else f"{p[q]:.1f}" for q in ("p50", "p99"))

    print(
        f"  {name}: gateway p50/p99 ms: request until it leaves for the worker "
        f"{ms(phases['request_ms'])}, response head held {ms(phases['response_hold_ms'])}, "
        f"worker {ms(phases['worker_ms'])}",
        flush=True,
    )
    parts = phases.get("outside_engine_parts")
    if parts and parts["joined"]:
        print(
            f"  {name}: outside the engine, p50/p99 ms of each part: "
            + ", ".join(f"{k.removesuffix('_ms')} {ms(parts[k])}" for k in OUTSIDE_PARTS),
            flush=True,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(phases))


def _write_requests(path: Path, results) -> None:
    """Every request's outcome, for digging into a run (not part of the summary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for r in results:
            f.write(orjson.dumps(r, option=orjson.OPT_SERIALIZE_DATACLASS) + b"\n")


def _s(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(args: argparse.Namespace) -> int:
    from . import route_sweep  # imports this module's _run_policy

    try:
        setup = resolve(args)
        sweep = route_sweep.parse_sweep(getattr(args, "sweep", None))
        if sweep is not None and getattr(args, "workload", "mooncake") == "fanout":
            raise ValueError(
                "--workload fanout runs at its own rate (a group a second): no --sweep"
            )
    except ValueError as exc:
        print(f"bench route: {exc}")
        return 2
    for name in list(args.policies):
        reason = unavailable(POLICIES[name])
        if reason:
            print(f"bench route: skipping {name}: {reason}", flush=True)
            args.policies.remove(name)
    if not args.policies:
        print("bench route: no policy can run")
        return 2
    if sweep is None and getattr(args, "workload", "mooncake") == "multiturn":
        sweep = [args.rate or 4.0]  # one rate: the sweep's table, JSON and plot
    try:
        if sweep is not None:
            return asyncio.run(route_sweep.run_sweep(args, setup, sweep))
        return asyncio.run(_run(args, setup))
    except (TraceError, LaunchError) as exc:
        print(f"bench route: {exc}")
        return 2
