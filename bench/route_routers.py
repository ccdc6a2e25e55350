"""The routers a routing benchmark compares, each started in front of the same worker fleet.

Ours run as in production: the EPP (`dynamograph epp`, static discovery, a router YAML that
selects the policy) behind a real Envoy configured as a GAIE gateway, so every one of our
policies pays the same Envoy + ext_proc hop and differs only in the decision; `frontend-kv` is
the one without a gateway: our frontend's kv mode, the router core inside the relay. The foreign
anchors are the routers people pick instead, started from their PyPI wheels on 127.0.0.1 with
the Hugging Face hub unreachable, and the field's own EPPs (GAIE's reference EPP, llm-d's
scheduler) behind the same Envoy, with a control plane to watch (bench/route_foreign_epp.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import yaml

from dynamograph.local.procs import PortPool
from dynamograph.protocol.router_config import (
    HOME_MARGIN,
    PREFILL_WORK_WEIGHT,
    dynamo_scorers,
    ttft_scorers,
)

from .route_fleet import (
    DYNAMOGRAPH,
    OFFLINE_ENV,
    LaunchError,
    Proc,
    Worker,
    join_worker_records,
    stop_all,
    wait_http,
)
from .route_metrics import RequestResult

# The llm-d policy run with its precise prefix-cache scorer (bench/route_foreign_epp.py)
PRECISE = "precise-prefix-cache"


@dataclass(frozen=True)
class Policy:
    name: str
    kind: str  # "epp" | "frontend" | "sglang-router" | "vllm-router" | "foreign-epp" | "dynamo"
    description: str
    router_config: dict = field(default_factory=dict)  # RouterConfig fields ("epp", "frontend")
    # --policy of a foreign router; for llm-d's scheduler, PRECISE: its precise prefix-cache
    # scorer configuration (else its shipped default)
    foreign_policy: str | None = None
    epps: int = 1  # EPP replicas behind the gateway, sharing their bookings (kind "epp")
    epp_flags: tuple[str, ...] = ()  # more `dynamograph epp` flags (kind "epp")
    counterpart: str | None = None  # bench/counterparts.py name of a foreign EPP's binary


@dataclass(frozen=True)
class Routed:
    """A started router: where to send requests, the workers it routes to (the fleet, or the
    fleet's twins at pod IPs for a foreign EPP), and its own processes (for their CPU time)."""

    url: str
    workers: Sequence[Worker]
    pids: Sequence[int]
    metrics_url: str | None = None  # a foreign EPP's Prometheus page (its picks per pod)
    access_log: Path | None = None  # the gateway's per-request timings (EPPs behind our Envoy)
    gateway_pids: Sequence[int] = ()  # the Envoy in front of an EPP
    # processes between the router and the workers that a real deployment runs inside its
    # engines (Dynamo's per-worker runtime): their CPU is measured as a group of its own
    relay_pids: Sequence[int] = ()
    # a router that answers `nvext.timing` from its own clock (Dynamo's frontend): sets each
    # result's engine figures from what its engines reported instead (`route_dynamo`)
    engine_view: Callable[[Sequence[RequestResult]], Awaitable[None]] | None = None


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in [
        Policy("round-robin", "epp", "EPP, round-robin", {"picker": {"type": "round-robin"}}),
        Policy("random", "epp", "EPP, uniform random", {"picker": {"type": "random"}, "seed": 0}),
        Policy(
            "least-loaded", "epp", "EPP, fewest active blocks", {"picker": {"type": "least-loaded"}}
        ),
        Policy(
            "epp-floor",
            "epp",
            "EPP answering with any ready worker, body unread, no KV events (--endpoint-picker "
            "random): the gateway and ext_proc path alone, what the routing policies add to",
            epp_flags=("--endpoint-picker=random", "--kv-events=off"),
        ),
        Policy(
            "approx-kv",
            "epp",
            "EPP, KV cost from its own routing history (no KV events, TTL 120 s)",
            {"use_kv_events": False},
        ),
        Policy(
            "kv",
            "epp",
            "EPP, KV cost from the engines' KV events, Dynamo's (overlap weight 1: a block to "
            "prefill weighs as much as an active block; the lowest cost wins)",
            {
                "scorers": [s.model_dump() for s in dynamo_scorers()],
                "picker": {"type": "kv"},
                "booked_prefix_hits": False,
            },
        ),
        Policy(
            "kv-2epp",
            "epp",
            "2 EPP replicas (active-active, bookings shared), KV events, our default cost "
            "(kv-ttft's)",
            {"scorers": [s.model_dump() for s in ttft_scorers()]},
            epps=2,
        ),
        Policy(
            "kv-w4",
            "epp",
            "EPP, KV events, overlap weight 4 (prefill blocks count 4x against active blocks)",
            {
                "scorers": [s.model_dump() for s in dynamo_scorers(overlap_weight=4.0)],
                "picker": {"type": "kv"},
                "booked_prefix_hits": False,
            },
        ),
        Policy(
            "kv-ttft",
            "epp",
            "EPP, KV events, our default cost: the TTFT estimate in blocks to prefill (queued "
            "prefill + uncached blocks, active blocks at 0.0025 each, blocks over free KV, uncached "
            "blocks × requests waiting there) + 8 × uncached blocks (the fleet's prefill work); "
            "a request leaves the worker holding the most of its prompt only for one costing "
            "over 25 % less (the kv picker's home_margin)",
            {"scorers": [s.model_dump() for s in ttft_scorers()]},
        ),
        Policy(
            "frontend-kv",
            "frontend",
            "our frontend with --mode kv, kv-ttft's cost and KV events, no gateway and no EPP: "
            "the router core in the process that relays the request (the topology of "
            "sglang-router and Dynamo's frontend)",
            {"scorers": [s.model_dump() for s in ttft_scorers()]},
        ),
        Policy(
            "kv-ttft-greedy",
            "epp",
            "EPP, KV events, kv-ttft without its queue-delay and prefill-work terms: each "
            "request's own TTFT estimate only (an ablation)",
            {
                "scorers": [
                    s.model_dump() for s in ttft_scorers(work_weight=0) if s.type != "queue-delay"
                ]
            },
        ),
        *(
            Policy(
                f"kv-ttft-work{w:g}",
                "epp",
                f"kv-ttft with its prefill-work term at weight {w:g} (the default: "
                f"{PREFILL_WORK_WEIGHT:g}): a request leaves its prefix's worker only to save over "
                f"{1 + w:g}× the blocks it recomputes (an ablation)",
                {"scorers": [s.model_dump() for s in ttft_scorers(work_weight=w)]},
            )
            for w in (0.0, 1.0, 3.0, 16.0, 32.0)
        ),
        *(
            Policy(
                f"kv-ttft-home{percent}",
                "epp",
                f"kv-ttft with the kv picker's home_margin at {percent / 100:g} (the default: "
                f"{HOME_MARGIN:g}): a request leaves the worker holding the most of its prompt "
                f"only for one that costs under {1 - percent / 100:g}× as much (an ablation)",
                {
                    "scorers": [s.model_dump() for s in ttft_scorers()],
                    "picker": {"type": "kv", "parameters": {"home_margin": percent / 100}},
                },
            )
            for percent in (0, 50)
        ),
        Policy(
            "kv-ttft-stored",
            "epp",
            "kv-ttft counting as computed only the blocks the engines' KV events reported "
            "stored, not those a prefill under way on the worker holds (booked_prefix_hits "
            "off: Dynamo's overlap; an ablation)",
            {"scorers": [s.model_dump() for s in ttft_scorers()], "booked_prefix_hits": False},
        ),
        Policy(
            "kv-ttft-i0",
            "epp",
            "kv-ttft with every KV-event batch read as it arrives (the EPP's "
            "--kv-ingest-interval=0: the freshest prefill-done marks, a wake-up per batch)",
            {"scorers": [s.model_dump() for s in ttft_scorers()]},
            epp_flags=("--kv-ingest-interval=0",),
        ),
        Policy(
            "kv-ttft-i50",
            "epp",
            "kv-ttft with the KV-event sockets read every 50 ms instead of 20 (the EPP's "
            "--kv-ingest-interval: less CPU per batch, batches and prefill-done marks up to 50 ms "
            "later)",
            {"scorers": [s.model_dump() for s in ttft_scorers()]},
            epp_flags=("--kv-ingest-interval=0.05",),
        ),
        Policy(
            "sglang-cache-aware",
            "sglang-router",
            "sglang-router 0.3.2 --policy cache_aware (text radix tree)",
            foreign_policy="cache_aware",
        ),
        Policy(
            "vllm-cache-aware",
            "vllm-router",
            "vllm-router 0.1.17 --policy cache_aware",
            foreign_policy="cache_aware",
        ),
        Policy(
            "gaie-epp",
            "foreign-epp",
            "GAIE reference EPP v1.5.0, default scorers (queue 2, KV-cache use 2, prefix 3)",
            counterpart="gaie-epp",
        ),
        Policy(
            "llmd-epp",
            "foreign-epp",
            "llm-d inference scheduler, its shipped epp-config.yaml (decode filter, prefix 2)",
            counterpart="llmd-epp",
        ),
        Policy(
            "llmd-precise",
            "foreign-epp",
            "llm-d inference scheduler, its shipped precise prefix-cache configuration (KV "
            "events, prefix 2, KV-cache use 1, queue 1), tokenizing through llm-d's tokenizer "
            "service contract (bench/llmd_tokenizer.py)",
            counterpart="llmd-epp",
            foreign_policy=PRECISE,
        ),
        Policy(
            "dynamo-kv",
            "dynamo",
            "Dynamo 1.6.1 frontend, KV router with its defaults, KV events relayed by a Dynamo "
            "worker per mock (bench/route_dynamo.py)",
        ),
    ]
}
# The foreign EPPs each need a Kubernetes control plane and a Go build, Dynamo its own venv
# (scripts/setup-dynamo.sh): asked for by name only.
DEFAULT_POLICIES = [name for name, p in POLICIES.items() if p.kind not in ("foreign-epp", "dynamo")]


def foreign_binary(name: str) -> str:
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        raise LaunchError(
            f"{name} is not installed: pip install {name} (the benchmark's foreign anchor)"
        )
    return found


def unavailable(policy: Policy) -> str | None:
    """Why `policy` cannot run on this machine (a counterpart not built), else None."""
    if policy.kind == "dynamo":
        from .route_dynamo import unavailable as dynamo_unavailable

        return dynamo_unavailable()
    if policy.kind != "foreign-epp":
        return None
    from .route_foreign_epp import unavailable as counterpart_unavailable

    assert policy.counterpart is not None
    return counterpart_unavailable(policy.counterpart, precise=policy.foreign_policy == PRECISE)


@contextlib.asynccontextmanager
async def serve(
    policy: Policy, workers: Sequence[Worker], ports: PortPool, logs: Path, *, model: str
) -> AsyncIterator[Routed]:
    """Start the router for `policy` in front of `workers`; yield it (`Routed`); stop it."""
    ctx: contextlib.AbstractAsyncContextManager[Routed]
    if policy.kind == "epp":
        ctx = _serve_epp(policy, workers, ports, logs)
    elif policy.kind == "foreign-epp":
        from .route_foreign_epp import serve_foreign_epp  # its control plane loads by path

        assert policy.counterpart is not None
        ctx = serve_foreign_epp(
            policy.name,
            policy.counterpart,
            workers,
            ports,
            logs,
            model=model,
            precise=policy.foreign_policy == PRECISE,
        )
    elif policy.kind == "dynamo":
        from .route_dynamo import serve as serve_dynamo  # runs Dynamo from its own venv

        ctx = serve_dynamo(workers, ports, logs, model=model)
    elif policy.kind == "frontend":
        ctx = _serve_frontend(policy, workers, ports, logs)
    else:
        ctx = _serve_foreign(policy, workers, ports, logs)
    async with ctx as routed:
        yield routed


@contextlib.asynccontextmanager
async def _serve_foreign(
    policy: Policy, workers: Sequence[Worker], ports: PortPool, logs: Path
) -> AsyncIterator[Routed]:
    port, metrics = ports.take(), ports.take()
    argv = [foreign_binary(policy.kind)]
    if policy.kind == "sglang-router":
        argv.append("launch")
    argv += [
        "--host=127.0.0.1",
        f"--port={port}",
        "--prometheus-host=127.0.0.1",
        f"--prometheus-port={metrics}",
        f"--policy={policy.foreign_policy}",
        "--log-level=warn" if policy.kind == "sglang-router" else "--log-level=warning",
        "--worker-urls",
        *(w.url for w in workers),
    ]
    proc = Proc(f"{policy.name}-router", argv, logs / f"{policy.name}-router.log", OFFLINE_ENV)
    async with _one_process(proc, ports, port, workers, within_s=90) as routed:
        yield routed


@contextlib.asynccontextmanager
async def _serve_frontend(
    policy: Policy, workers: Sequence[Worker], ports: PortPool, logs: Path
) -> AsyncIterator[Routed]:
    """`dynamograph frontend --mode kv` in front of the workers, its router config the policy's."""
    port = ports.take()
    argv = [
        *DYNAMOGRAPH,
        "frontend",
        "--host=127.0.0.1",
        f"--port={port}",
        "--mode=kv",
        "--discovery=static",
        f"--router-config={_router_yaml(policy, logs)}",
    ]
    for w in workers:
        argv += ["--worker", w.url]
    proc = Proc(f"{policy.name}-router", argv, logs / f"{policy.name}-router.log")
    # The frontend answers `nvext.timing` from its own clock (as Dynamo's does): the engines'
    # simulated figures come from the workers' request records instead.
    view = partial(join_worker_records, workers)
    async with _one_process(proc, ports, port, workers, within_s=60, engine_view=view) as routed:
        yield routed


@contextlib.asynccontextmanager
async def _one_process(
    proc: Proc,
    ports: PortPool,
    port: int,
    workers: Sequence[Worker],
    *,
    within_s: float,
    engine_view: Callable[[Sequence[RequestResult]], Awaitable[None]] | None = None,
) -> AsyncIterator[Routed]:
    """A router that is one process serving on `port`: started, yielded once its /v1/models
    answers, stopped on exit."""
    ports.release()
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        await wait_http(proc, url + "/v1/models", within_s=within_s)
        assert proc.popen is not None
        yield Routed(url, workers, [proc.popen.pid], engine_view=engine_view)
    finally:
        await asyncio.to_thread(stop_all, [proc])


def _router_yaml(policy: Policy, logs: Path) -> Path:
    """The policy's RouterConfig as the YAML file our routers read (`--config`)."""
    config = logs / f"{policy.name}-router.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(policy.router_config))
    return config


@contextlib.asynccontextmanager
async def _serve_epp(
    policy: Policy, workers: Sequence[Worker], ports: PortPool, logs: Path
) -> AsyncIterator[Routed]:
    """The EPP (`policy.epps` of them, each a replica of the others: replica sync over
    127.0.0.1) behind one Envoy that balances its ext_proc streams over them."""
    from dynamograph.local.envoy import envoy_config, run_envoy  # only our policies need Envoy

    listen_port, admin_port = ports.take(), ports.take()
    config = _router_yaml(policy, logs)
    replica_ports = [ports.take() for _ in range(policy.epps)]
    epps, grpc_ports, metrics_ports = [], [], []
    for i in range(policy.epps):
        grpc_port, health_port, metrics_port = ports.take(), ports.take(), ports.take()
        argv = [
            *DYNAMOGRAPH,
            "epp",
            "--host=127.0.0.1",
            f"--grpc-port={grpc_port}",
            f"--health-port={health_port}",
            f"--metrics-port={metrics_port}",
            "--discovery=static",
            f"--config={config}",
            *policy.epp_flags,
        ]
        if policy.epps > 1:
            peers = ",".join(f"127.0.0.1:{p}" for j, p in enumerate(replica_ports) if j != i)
            argv += [f"--replica-port={replica_ports[i]}", f"--replica-peers={peers}"]
        for w in workers:
            argv += ["--worker", f"{w.url}=127.0.0.1:{w.port}"]
        suffix = f"-{i}" if policy.epps > 1 else ""
        epps.append(
            Proc(f"{policy.name}-epp{suffix}", argv, logs / f"{policy.name}-epp{suffix}.log")
        )
        grpc_ports.append(grpc_port)
        metrics_ports.append(metrics_port)
    ports.release()
    for epp in epps:
        epp.start()
    try:
        for epp, metrics_port in zip(epps, metrics_ports, strict=True):
            await wait_http(epp, f"http://127.0.0.1:{metrics_port}/metrics", within_s=60)
        access_log = logs / f"{policy.name}-envoy" / "access.log"
        gateway = envoy_config(
            listen_port,
            admin_port,
            f"127.0.0.1:{grpc_ports[0]}",
            epp_replicas=[f"127.0.0.1:{p}" for p in grpc_ports[1:]],
            access_log=str(access_log),
        )
        async with run_envoy(gateway, workdir=access_log.parent) as envoy:
            url = f"http://127.0.0.1:{listen_port}"
            await wait_http(epps[0], url + "/v1/models", within_s=60)
            pids = [e.popen.pid for e in epps if e.popen is not None]
            yield Routed(
                url, workers, pids, access_log=access_log, gateway_pids=[envoy.process.pid]
            )
    finally:
        await asyncio.to_thread(stop_all, epps)
