"""`dynamograph bench frontend`: the latency the frontend hop adds, against calling the engine.

One mock worker and one frontend (direct mode, its sidecar) run as real processes on 127.0.0.1.
The same request goes alternately straight to the engine and through the frontend (with the
routing header the endpoint picker would set), round by round, so machine noise hits both
paths alike; at concurrency c, c clients send in parallel. Reported per (c, stream): p50/p99 of
both paths and the added p50 (frontend − direct), time to first byte for streams, and the
frontend process's CPU time per request (from /proc: the hop's own cost, without the waiting for
a CPU that dominates wall-clock latency on a busy machine; it still scales with the core's speed,
so the machine's load and Python speed are recorded too). Target: ≤ 0.5 ms added at p50, c=1.

Two estimates of the added latency: `added p50` = p50(frontend) − p50(direct) over all samples,
and `paired` = the median over rounds of each round's p50 difference — rounds are adjacent in
time, so a load change between rounds drops out of the paired figure. `--baseline-tree DIR`
runs a second frontend from another source tree (`git archive <commit> | tar -x -C DIR`) in
the same rotation, for a before/after in one run. `--kv` adds a standalone frontend in kv mode
(the gateway-less router: it tokenizes, scores and books each request itself, with the engine's
KV events) to the rotation, sent the same request without a routing header: what routing in the
frontend adds to the hop, in latency and in CPU per request.
"""

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson

from dynamograph.local.procs import PortPool

from .procstat import cpu_seconds
from .report import add_output_argument, print_table, write_json
from .route_fleet import DYNAMOGRAPH, Proc, WorkerSpec, stop_all, wait_http, worker_procs
from .timing import percentiles

TARGET_ADDED_P50_MS = 0.5
# (p99s are in the JSON: at a few hundred samples they mostly show the machine's hiccups)
COLUMNS = ["c", "stream", "direct p50", "fe p50", "added p50", "paired", "added TTFB"]
COLUMNS += ["fe CPU µs/req"]
BASELINE_COLUMNS = ["c", "stream", "baseline: added p50", "paired", "CPU µs/req"]
BASELINE_COLUMNS += ["this: added p50", "paired", "CPU µs/req"]
KV_COLUMNS = ["c", "stream", "kv: added p50", "paired", "CPU µs/req", "direct mode: CPU µs/req"]
# The top-level folders the package maps into the `dynamograph` namespace (pyproject.toml).
PACKAGE_FOLDERS = ("protocol", "epp", "frontend", "worker", "operator", "local", "bench", "cli")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rounds",
        type=int,
        default=80,
        help="alternations per configuration (default 80; short rounds, so that a change in the "
        "machine's load between them hits every path alike)",
    )
    parser.add_argument(
        "--per-round", type=int, default=3, help="requests per client per round (default 3)"
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16], help="client counts (default 1 16)"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=4, help="tokens generated per request (default 4)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="16 rounds of 2 requests per client (a smoke run)"
    )
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="source tree of another dynamograph version (e.g. `git archive <commit> | tar -x "
        "-C DIR`): its frontend runs too, in the same rotation, for a same-run before/after",
    )
    parser.add_argument(
        "--kv",
        action="store_true",
        help="a standalone kv-mode frontend too, in the same rotation (the router in the hop)",
    )
    add_output_argument(parser)


def _body(stream: bool, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": WorkerSpec.model,
            "prompt": "The frontend hop should cost less than half a millisecond.",
            "max_tokens": max_tokens,
            "stream": stream,
            "ignore_eos": True,
        }
    )


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[float, float]:
    """(total, first byte) seconds of one request, reading the whole answer."""
    start = time.perf_counter()
    async with session.post(url, data=body, headers=headers) as response:
        first = None
        async for _ in response.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}")
    total = time.perf_counter() - start
    return total, first if first is not None else total


async def _phase(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    clients: int,
    per_client: int,
    out: list[tuple[float, float]],
) -> None:
    async def client() -> None:
        for _ in range(per_client):
            out.append(await _one(session, url, body, headers))

    await asyncio.gather(*(client() for _ in range(clients)))


async def _measure(args, engine: str, frontends: dict[str, tuple[str, int]], worker_id: int):
    """`frontends`: name → (url, pid). Rounds rotate the order of the paths, so none always
    runs first (warmest caches, right after the client's own work)."""
    paths = {"direct": (engine + "/v1/completions", {"Content-Type": "application/json"})}
    for name, (url, _) in frontends.items():
        headers = {"Content-Type": "application/json"}
        if name != "kv":  # direct mode follows the endpoint picker's header; kv mode picks
            headers["x-worker-instance-id"] = str(worker_id)
        paths[name] = (url + "/v1/completions", headers)
    names = list(paths)
    results = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for clients in args.concurrency:
            for stream in (False, True):
                body = _body(stream, args.max_tokens)
                rounds: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in names}
                cpu = dict.fromkeys(frontends, 0.0)
                for url, headers in paths.values():  # warm connections and caches
                    await _phase(session, url, body, headers, clients, 4, [])
                for r in range(args.rounds):
                    for name in names[r % len(names) :] + names[: r % len(names)]:
                        url, headers = paths[name]
                        pid = frontends[name][1] if name in frontends else None
                        before = cpu_seconds(pid) if pid else 0.0
                        samples: list[tuple[float, float]] = []
                        await _phase(session, url, body, headers, clients, args.per_round, samples)
                        rounds[name].append(samples)
                        if pid:
                            cpu[name] += cpu_seconds(pid) - before
                results.append(_summarise(clients, stream, rounds, cpu))
    return results


def _summarise(
    clients: int, stream: bool, rounds: dict[str, list[list]], cpu: dict[str, float]
) -> dict:
    row: dict = {"concurrency": clients, "stream": stream}
    for name, per_round in rounds.items():
        arr = np.asarray([s for samples in per_round for s in samples])
        row[name] = {
            "requests": len(arr),
            "total_ms": percentiles(arr[:, 0], 1e3),
            "first_byte_ms": percentiles(arr[:, 1], 1e3),
        }
        if name in cpu:
            row[name]["cpu_us_per_request"] = cpu[name] / len(arr) * 1e6
    direct = row["direct"]
    direct_rounds = np.array([np.median([s[0] for s in r]) for r in rounds["direct"]])
    for name in cpu:
        fe = row[name]
        fe["added_p50_ms"] = fe["total_ms"]["p50"] - direct["total_ms"]["p50"]
        fe["added_first_byte_p50_ms"] = fe["first_byte_ms"]["p50"] - direct["first_byte_ms"]["p50"]
        fe_rounds = np.array([np.median([s[0] for s in r]) for r in rounds[name]])
        diff = (fe_rounds - direct_rounds) * 1e3
        fe["added_paired_ms"] = float(np.median(diff))
        fe["added_paired_iqr_ms"] = [float(np.percentile(diff, 25)), float(np.percentile(diff, 75))]
    # The frontend under test, flat (what `bench all` and earlier runs read).
    row["added_p50_ms"] = row["frontend"]["added_p50_ms"]
    row["added_paired_ms"] = row["frontend"]["added_paired_ms"]
    row["added_first_byte_p50_ms"] = row["frontend"]["added_first_byte_p50_ms"]
    row["frontend_cpu_us_per_request"] = row["frontend"]["cpu_us_per_request"]
    return row


def _baseline_path(tree: Path, where: Path) -> Path:
    """A PYTHONPATH entry under which `dynamograph.*` imports come from `tree` (a namespace
    folder of links to its top-level folders; it shadows the installed editable package)."""
    root = where / "baseline-path"
    package = root / "dynamograph"
    package.mkdir(parents=True)
    for folder in PACKAGE_FOLDERS:
        if not (tree / folder).is_dir():
            raise SystemExit(f"--baseline-tree {tree}: no {folder}/ folder (not a source tree?)")
        (package / folder).symlink_to((tree / folder).resolve())
    return root


def _frontend_proc(
    name: str, url: str, engine_url: str, log: Path, env=None, *, kv: bool = False
) -> Proc:
    port = url.rsplit(":", 1)[1]
    argv = [*DYNAMOGRAPH, "frontend", "--host=127.0.0.1", f"--port={port}"]
    if kv:  # standalone: the engine is a discovered worker, routed to by the kv router
        return Proc(name, [*argv, "--mode=kv", f"--worker={engine_url}"], log, env or {})
    return Proc(name, [*argv, f"--engine-url={engine_url}"], log, env or {})


async def _bench(args) -> dict:
    ports = PortPool()
    logs = Path(tempfile.mkdtemp(prefix="bench-frontend-"))
    # A fast simulated GPU: the engine's own time is small, so the hop's share is visible.
    (worker,) = worker_procs(1, WorkerSpec(speedup=1000.0), logs, ports)
    urls = {"frontend": f"http://127.0.0.1:{ports.take()}"}
    procs = {"frontend": _frontend_proc("frontend", urls["frontend"], worker.url, logs / "fe.log")}
    if args.baseline_tree is not None:
        urls["baseline"] = f"http://127.0.0.1:{ports.take()}"
        env = {"PYTHONPATH": str(_baseline_path(args.baseline_tree, logs))}
        procs["baseline"] = _frontend_proc(
            "baseline", urls["baseline"], worker.url, logs / "baseline.log", env
        )
    if args.kv:
        urls["kv"] = f"http://127.0.0.1:{ports.take()}"
        procs["kv"] = _frontend_proc("kv", urls["kv"], worker.url, logs / "kv.log", kv=True)
    ports.release()
    try:
        worker.proc.start()
        for proc in procs.values():
            proc.start()
        await wait_http(worker.proc, worker.url + "/health")
        for name, proc in procs.items():
            await wait_http(proc, urls[name] + "/health")
        async with (
            aiohttp.ClientSession() as session,
            session.get(worker.url + "/v1/engine") as response,
        ):
            worker_id = (await response.json())["instance_id"]
        frontends = {}
        for name, proc in procs.items():
            assert proc.popen is not None
            frontends[name] = (urls[name], proc.popen.pid)
        rows = await _measure(args, worker.url, frontends, worker_id)
    finally:
        stop_all([worker.proc, *procs.values()])
    return {"rows": rows, "logs": str(logs)}


def _summary(rows: list[dict], verdict: bool | None) -> dict:
    """The headline numbers (`bench all` shows them)."""
    out: dict = {"target_met_c1": verdict}
    for r in rows:
        key = f"c{r['concurrency']}{'_stream' if r['stream'] else ''}"
        out[f"added_p50_ms_{key}"] = round(r["added_p50_ms"], 3)
        out[f"added_paired_ms_{key}"] = round(r["added_paired_ms"], 3)
        out[f"fe_cpu_us_{key}"] = round(r["frontend_cpu_us_per_request"])
    return out


def _python_loop_ns(n: int = 1_000_000) -> float:
    """CPU ns per empty Python loop iteration: how fast (or how contended) this machine is."""
    start = time.process_time()
    for _ in range(n):
        pass
    return (time.process_time() - start) / n * 1e9


def run(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    if args.quick:
        args.rounds, args.per_round = 16, 2
    machine = {"load_before": os.getloadavg()[0], "python_loop_ns": _python_loop_ns()}
    result = asyncio.run(_bench(args))
    machine["load_after"] = os.getloadavg()[0]
    rows = result["rows"]
    print_table(
        "frontend hop: added latency vs calling the engine directly (ms)",
        COLUMNS,
        [
            [
                r["concurrency"],
                "yes" if r["stream"] else "no",
                r["direct"]["total_ms"]["p50"],
                r["frontend"]["total_ms"]["p50"],
                r["added_p50_ms"],
                r["added_paired_ms"],
                r["added_first_byte_p50_ms"] if r["stream"] else "",
                r["frontend_cpu_us_per_request"],
            ]
            for r in rows
        ],
    )
    if args.baseline_tree is not None:
        print_table(
            f"same run: baseline ({args.baseline_tree}) and this frontend, added ms vs direct",
            BASELINE_COLUMNS,
            [
                [r["concurrency"], "yes" if r["stream"] else "no"]
                + [
                    value
                    for name in ("baseline", "frontend")
                    for value in (
                        r[name]["added_p50_ms"],
                        r[name]["added_paired_ms"],
                        r[name]["cpu_us_per_request"],
                    )
                ]
                for r in rows
            ],
        )
    if args.kv:
        print_table(
            "same run: the kv-mode frontend (routing in the hop), added ms vs direct",
            KV_COLUMNS,
            [
                [
                    r["concurrency"],
                    "yes" if r["stream"] else "no",
                    r["kv"]["added_p50_ms"],
                    r["kv"]["added_paired_ms"],
                    r["kv"]["cpu_us_per_request"],
                    r["frontend"]["cpu_us_per_request"],
                ]
                for r in rows
            ],
        )
    c1 = [r["added_p50_ms"] for r in rows if r["concurrency"] == 1]
    verdict = max(c1) <= TARGET_ADDED_P50_MS if c1 else None
    if c1:
        print(
            f"target ≤ {TARGET_ADDED_P50_MS} ms added p50 at c=1: "
            f"{'met' if verdict else 'NOT met'} (worst {max(c1):.3f} ms)"
        )
    print(
        f"machine: load average {machine['load_before']:.1f} → {machine['load_after']:.1f} on "
        f"{os.cpu_count()} CPUs; {machine['python_loop_ns']:.0f} ns per empty Python loop "
        "iteration (wall-clock numbers include waiting for a CPU; CPU µs/req does not)"
    )
    write_json(
        args.out,
        "frontend",
        {
            "rows": rows,
            "summary": _summary(rows, verdict),
            "load": machine,
            "target_added_p50_ms": TARGET_ADDED_P50_MS,
            "target_met_c1": verdict,
            "config": vars(args)
            | {"out": str(args.out), "baseline_tree": str(args.baseline_tree or "")},
        },
    )
    return 0
