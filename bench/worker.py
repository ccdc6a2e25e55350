"""`dynamograph bench worker`: how faithfully the mock engine's wall clock follows its simulation.

For each speedup the same closed-loop workload runs against an in-process MockEngine. Every
request's simulated TTFT and end-to-end latency (from the cost model) are compared with the
wall-clock ones the client measured, scaled by the speedup: error = wall × speedup − simulated.
Small relative errors mean benchmarks at high speedups still mean what they say; the error
grows with speedup because Python's per-step overhead is multiplied by it.
"""

import argparse
import asyncio
import time

import numpy as np

from dynamograph.bench.report import add_output_argument, print_table, write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speedups", default="1,10,100", help="comma-separated (default: 1,10,100)"
    )
    parser.add_argument("--requests", type=int, default=24, help="requests per speedup")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=32)
    add_output_argument(parser)


async def _measure(speedup: float, args: argparse.Namespace) -> dict:
    from dynamograph.worker.engine import GenerateRequest, RequestContext
    from dynamograph.worker.mock import MockConfig, MockEngine

    engine = MockEngine(MockConfig(kv_events=False, speedup=speedup, port=0))
    await engine.start(worker_id=1)
    rng = np.random.default_rng(0)
    samples: list[tuple[float, float, float, float]] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)

    async def client() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            tokens = rng.integers(1000, 50000, args.prompt_tokens).astype("<u4")
            req = GenerateRequest(f"b{i}", tokens, args.max_tokens)
            start = time.perf_counter()
            first = None
            async for out in engine.generate(req, RequestContext(req.request_id)):
                if first is None:
                    first = time.perf_counter()
                last = out
            end = time.perf_counter()
            t = last.timing if last is not None else None
            if first is None or t is None or t.ttft is None or t.e2e is None:
                raise RuntimeError(f"request b{i}: the engine finished it without a token")
            samples.append((t.ttft, (first - start) * speedup, t.e2e, (end - start) * speedup))

    try:
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        steps = sum(rank.steps for rank in engine.ranks)
        busy = sum(rank.busy_time for rank in engine.ranks)
    finally:
        await engine.cleanup()
    arr = np.asarray(samples)
    ttft_err = arr[:, 1] - arr[:, 0]
    e2e_err = arr[:, 3] - arr[:, 2]
    return {
        "speedup": speedup,
        "requests": len(samples),
        "wall_seconds": wall,
        "steps": steps,
        "cpu_ms_per_step": cpu / steps * 1e3,
        # The speedup one core could sustain: simulated step time over CPU cost per step.
        "sustainable_speedup": busy / cpu if cpu else float("inf"),
        "sim_ttft_ms_p50": float(np.median(arr[:, 0]) * 1e3),
        "ttft_error_ms_p50": float(np.median(ttft_err) * 1e3),
        "ttft_rel_error_p50": float(np.median(np.abs(ttft_err) / arr[:, 0])),
        "ttft_rel_error_p90": float(np.percentile(np.abs(ttft_err) / arr[:, 0], 90)),
        "sim_e2e_ms_p50": float(np.median(arr[:, 2]) * 1e3),
        "e2e_error_ms_p50": float(np.median(e2e_err) * 1e3),
        "e2e_rel_error_p50": float(np.median(np.abs(e2e_err) / arr[:, 2])),
        "e2e_rel_error_p90": float(np.percentile(np.abs(e2e_err) / arr[:, 2], 90)),
    }


def run(args: argparse.Namespace) -> int:
    speedups = [float(s) for s in args.speedups.split(",") if s.strip()]
    results = [asyncio.run(_measure(s, args)) for s in speedups]
    print_table(
        f"mock engine: wall × speedup vs simulated ({args.requests} req, {args.concurrency} "
        f"concurrent, {args.prompt_tokens}/{args.max_tokens} tokens)",
        ["speedup", "wall s", "CPU ms/step", "max speedup", "TTFT ms", "TTFT err p50/p90",
         "e2e err p50/p90"],
        [[f"{r['speedup']:g}", r["wall_seconds"], r["cpu_ms_per_step"],
          f"{r['sustainable_speedup']:.0f}", r["sim_ttft_ms_p50"],
          f"{r['ttft_rel_error_p50']:.0%}/{r['ttft_rel_error_p90']:.0%}",
          f"{r['e2e_rel_error_p50']:.0%}/{r['e2e_rel_error_p90']:.0%}"]
         for r in results],
    )  # fmt: skip
    write_json(args.out, "worker", {"config": {k: v for k, v in vars(args).items()
                                               if k in ("speedups", "requests", "concurrency",
                                                        "prompt_tokens", "max_tokens")},
                                    "results": results})  # fmt: skip
    return 0
