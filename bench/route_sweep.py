"""`dynamograph bench route --sweep`: every policy at rising request rates, on one fleet.

For each rate (requests per second on the workload's clock; the wall rate is that × the time
compression) the workload is built once — the multi-turn generator (`bench/workload.py`) at
that rate, or the Mooncake trace with its time axis scaled to that mean rate — and every
policy replays it in turn against the same mock workers, their KV caches reset before each
run, exactly as a single `bench route` run does. `--sweep 2,4,8` runs each listed rate;
`--sweep auto` starts at `--rate` and doubles while any policy is below saturation (a policy
that shed a request — HTTP 429/503 or the client's in-flight cap — or whose engine TTFT p50
exceeded `--ttft-bound` is saturated and sits out the higher rates), up to `--max-rate`.

Per rate and policy: shed, time outside the engine p50/p99 (client wall time − the engine's
own e2e ÷ the speedup: the router hop and this host, in real milliseconds), engine TTFT
p50/p99 (simulated seconds), the same split into first turns / follow-ups / documents, prefix
hit rate and reuse captured (hit rate ÷ the requests' inherent reuse). Prints a table, writes
`route_sweep.json`, `route_sweep.png` and per run `route-logs/rate-R/<policy>/requests.jsonl`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from dynamograph.protocol.tokenization import get_tokenizer

from .report import print_table, write_json
from .route_client import chat_body, completion_body
from .route_fleet import running_fleet, worker_spec
from .route_metrics import PolicyMetrics, follow_up_moves, split_metrics, summarize
from .route_plots import write_sweep_plot
from .route_routers import POLICIES
from .trace import (
    PromptSynthesizer,
    compress,
    inherent_reuse,
    load_trace,
    resolve_trace,
    sample_families,
)
from .workload import DOCUMENT, WorkloadBuilder, WorkloadConfig, generate, session_stats

AUTO = "auto"


def parse_sweep(text: str | None) -> list[float] | str | None:
    """`--sweep`: None, "auto", or a comma-separated list of positive rates (kept in order)."""
    if text is None:
        return None
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep takes 'auto' or rates like 2,4,8; got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"--sweep rates must be positive; got {text!r}")
    return rates


@dataclass
class Load:
    """One rate's requests, ready to replay: the same bytes for every policy."""

    rate: float
    offsets: list[float]  # wall seconds
    bodies: list[bytes]
    groups: list[str]  # per request: "first turn", "follow-up", "document" or "trace"
    labels: list[dict]  # per request, for requests.jsonl
    inherent_reuse: float
    # per request, the prompt tokens an infinite prefix cache held (where reuse is lost, by
    # group); None for the Mooncake trace
    reusable: list[int] | None = None
    stats: dict = field(default_factory=dict)


class MultiTurnSource:
    def __init__(self, args: argparse.Namespace, setup):
        self.args, self.setup = args, setup
        self.builder = WorkloadBuilder(get_tokenizer("qwen"))

    def describe(self) -> str:
        return (
            f"multi-turn workload (seed {self.args.seed}, {self.setup.duration:g} s per rate, "
            f"/v1/{'chat/' if self.args.api == 'chat' else ''}completions, "
            f"think time median {self.args.think_time:g} s, context ≤ {self.args.max_context})"
        )

    def load(self, rate: float) -> Load:
        config = WorkloadConfig(
            rate=rate,
            duration_s=self.setup.duration,
            seed=self.args.seed,
            think_median_s=self.args.think_time,
            max_context=self.args.max_context,
        )
        requests = generate(config, self.builder, block_size=self.args.block_size)
        reuse = sum(r.reusable_tokens for r in requests) / max(
            1, sum(r.prompt_tokens for r in requests)
        )
        return Load(
            rate=rate,
            offsets=[r.arrival_s / self.setup.compression for r in requests],
            bodies=[self._body(r) for r in requests],
            groups=[
                "document" if r.kind == DOCUMENT else "first turn" if r.turn == 1 else "follow-up"
                for r in requests
            ],
            labels=[r.label() for r in requests],
            inherent_reuse=reuse,
            reusable=[r.reusable_tokens for r in requests],
            stats=session_stats(requests),
        )

    def _body(self, r) -> bytes:
        args = self.args
        if args.api == "chat":
            return chat_body(args.model, r.messages, r.output_tokens, stream=args.stream)
        # The conversation through Qwen's chat template: the text the engine would render,
        # which tokenizes to the same ids (special tokens written in a prompt are honoured).
        text = self.builder.tokenizer.render_chat(list(r.messages), add_generation_prompt=True)
        return completion_body(args.model, text, r.output_tokens, stream=args.stream)


class TraceSource:
    """The Mooncake trace (sampled as `bench route` does), its time axis scaled to a rate."""

    def __init__(self, args: argparse.Namespace, setup):
        self.args, self.setup = args, setup
        args.trace = resolve_trace(args.trace)
        requests = load_trace(args.trace)
        if setup.families < 1:
            requests = sample_families(requests, setup.families)
        self.requests = requests[: setup.limit]
        self.reuse = inherent_reuse(self.requests)
        self.trace_offsets = compress(self.requests, 1.0)
        span = self.trace_offsets[-1]
        self.natural_rate = len(self.requests) / span if span > 0 else float(len(self.requests))
        synth = PromptSynthesizer(get_tokenizer("qwen"))
        self.bodies = [
            completion_body(args.model, synth.text(r), r.output_length, stream=args.stream)
            for r in self.requests
        ]

    def describe(self) -> str:
        return (
            f"trace {self.args.trace} ({len(self.requests)} requests, "
            f"natural rate {self.natural_rate:.2f}/s)"
        )

    def load(self, rate: float) -> Load:
        scale = self.natural_rate / rate / self.setup.compression
        return Load(
            rate=rate,
            offsets=[t * scale for t in self.trace_offsets],
            bodies=self.bodies,
            groups=["trace"] * len(self.requests),
            labels=[{"hash_ids": len(r.hash_ids)} for r in self.requests],
            inherent_reuse=self.reuse,
            stats={"requests": len(self.requests), "offered_rate": rate},
        )


@dataclass
class Point:
    rate: float
    policy: str
    metrics: PolicyMetrics
    groups: dict
    moves: dict | None  # follow-up turns served elsewhere than their previous turn
    outside_p50_ms: float | None
    outside_p99_ms: float | None
    saturated: bool
    reason: str | None

    def as_dict(self) -> dict:
        return {
            "rate": self.rate,
            "policy": self.policy,
            "outside_p50_ms": self.outside_p50_ms,
            "outside_p99_ms": self.outside_p99_ms,
            "saturated": self.saturated,
            "saturation": self.reason,
            "groups": self.groups,
            "follow_up_moves": self.moves,
            "metrics": self.metrics.as_dict(),
        }


def saturation(m: PolicyMetrics, ttft_bound_s: float) -> str | None:
    """Why a policy counts as saturated at a rate (None: it is not)."""
    if m.shed:
        return f"shed {m.shed}"
    if m.ok == 0:
        return "nothing served"
    if m.ttft_p50_s is not None and m.ttft_p50_s > ttft_bound_s:
        return f"TTFT p50 {m.ttft_p50_s:.3f} s > {ttft_bound_s:g} s"
    return None


def make_point(
    rate: float, policy: str, results, load: Load, compression: float, ttft_bound_s: float, **kw
) -> Point:
    m = summarize(policy, results, inherent_reuse=load.inherent_reuse, time_scale=compression, **kw)
    reason = saturation(m, ttft_bound_s)

    def ms(trace_s):
        return None if trace_s is None else trace_s / compression * 1000.0

    return Point(
        rate=rate,
        policy=policy,
        metrics=m,
        groups=split_metrics(results, load.groups, load.reusable),
        moves=follow_up_moves(results, load.labels),
        outside_p50_ms=ms(m.outside_engine_p50_s),
        outside_p99_ms=ms(m.outside_engine_p99_s),
        saturated=reason is not None,
        reason=reason,
    )


def next_rates(sweep, done: list[float], args) -> float | None:
    """The next rate to run: the listed ones in turn, or (auto) double the last."""
    if sweep == AUTO:
        if not done:
            return args.rate or 2.0
        nxt = done[-1] * 2
        return nxt if nxt <= args.max_rate else None
    return sweep[len(done)] if len(done) < len(sweep) else None


async def run_sweep(args: argparse.Namespace, setup, sweep) -> int:
    from .route import _run_policy  # route imports this module lazily

    source = (
        MultiTurnSource(args, setup) if args.workload == "multiturn" else TraceSource(args, setup)
    )
    spec = worker_spec(args, setup.compression)
    label = "auto (doubling)" if sweep == AUTO else ", ".join(f"{r:g}" for r in sweep)
    print(
        f"sweep {label} requests/s over {source.describe()}; {setup.workers} workers × "
        f"{spec.num_gpu_blocks} blocks of {spec.block_size}; compression {setup.compression:g}; "
        f"policies {' '.join(args.policies)}",
        flush=True,
    )
    logs = args.out / "route-logs"
    points: list[Point] = []
    loads: dict[float, dict] = {}
    active = list(args.policies)
    done: list[float] = []
    async with running_fleet(setup.workers, spec, logs / "fleet") as workers:
        while active and (rate := next_rates(sweep, done, args)) is not None:
            started = time.monotonic()
            load = await asyncio.to_thread(source.load, rate)
            loads[rate] = {"inherent_reuse": load.inherent_reuse, **load.stats}
            print(
                f"rate {rate:g}/s (wall {rate * setup.compression:g}/s): {len(load.offsets)} "
                f"requests over {load.offsets[-1]:.0f} wall s, inherent reuse "
                f"{load.inherent_reuse:.1%} (built in {time.monotonic() - started:.0f} s)",
                flush=True,
            )
            for name in list(active):
                run_logs = logs / f"rate-{rate:g}"
                results, wall, per_worker, worker_hits, host = await _run_policy(
                    name, workers, load.offsets, load.bodies, args, run_logs, setup.compression
                )
                point = make_point(
                    rate,
                    name,
                    results,
                    load,
                    setup.compression,
                    args.ttft_bound,
                    wall_s=wall,
                    per_worker_requests=per_worker,
                    worker_hit_rate=worker_hits,
                    host=host,
                )
                points.append(point)
                _write_labelled(run_logs / name / "requests.jsonl", results, load.labels)
                m = point.metrics
                print(
                    f"  {name}: ok {m.ok}, shed {m.shed}, errors {m.errors}; TTFT p50 "
                    f"{_f(m.ttft_p50_s)} s; outside p50 {_f(point.outside_p50_ms, 1)} ms"
                    + (f"; saturated ({point.reason})" if point.saturated else "")
                    + (f"; first error: {m.first_error}" if m.first_error else ""),
                    flush=True,
                )
                if sweep == AUTO and point.saturated:
                    active.remove(name)
            done.append(rate)
    _report(args, setup, spec, source, points, loads)
    return 0


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def _write_labelled(path: Path, results, labels: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for r in results:
            row = orjson.loads(orjson.dumps(r, option=orjson.OPT_SERIALIZE_DATACLASS))
            f.write(orjson.dumps({**row, **labels[r.index]}) + b"\n")


def _report(args, setup, spec, source, points: list[Point], loads: dict) -> None:
    load_rows, quality_rows = [], []
    for p in points:
        m = p.metrics
        group = {name: p.groups.get(name, {}) for name in ("first turn", "follow-up", "document")}
        load_rows.append(
            [
                f"{p.rate:g}",
                p.policy,
                f"{m.ok}/{m.requests}",
                str(m.shed),
                str(m.errors),
                _f(p.outside_p50_ms, 1),
                _f(p.outside_p99_ms, 1),
                _f(m.router_cpu_ms_per_request, 2),
                _f(m.router_cpu_wait_ms_per_request, 2),
                "-" if m.host_busy is None else f"{m.host_busy:.0%}",
                p.reason or "",
            ]
        )
        quality_rows.append(
            [
                f"{p.rate:g}",
                p.policy,
                _f(m.ttft_p50_s),
                _f(m.ttft_p99_s),
                _f(group["first turn"].get("ttft_p50_s")),
                _f(group["follow-up"].get("ttft_p50_s")),
                _f(group["document"].get("ttft_p50_s")),
                f"{m.hit_rate:.1%}",
                f"{m.reuse_captured:.1%}",
                " / ".join(_pct(group[g].get("reuse_captured")) for g in group),
                "-" if p.moves is None else f"{p.moves['share']:.1%}",
                f"{m.imbalance:.2f}" if m.imbalance else "-",
            ]
        )
    print_table(
        f"sweep, {setup.workers} workers: load (rate: requests/s on the workload clock; the "
        f"wall rate is {setup.compression:g}x that; outside the engine: wall ms; the router's "
        "CPU and its wait for a CPU: ms per request; host: its CPUs busy)",
        [
            "rate",
            "policy",
            "ok",
            "shed",
            "err",
            "out p50",
            "out p99",
            "CPU",
            "wait",
            "host",
            "saturated",
        ],
        load_rows,
        width=120,
    )
    print_table(
        "sweep: routing quality (TTFT engine-reported, simulated s; by first turn, follow-up, "
        "document; reuse captured, and by first turn / follow-up / document; moved: follow-up "
        "turns served by another worker than their previous turn)",
        [
            "rate",
            "policy",
            "TTFT p50",
            "p99",
            "1st",
            "follow",
            "doc",
            "hit",
            "reuse",
            "1st / fu / doc",
            "moved",
            "imbal.",
        ],
        quality_rows,
        width=120,
    )
    saturated_at: dict[str, float | None] = {}
    for name in args.policies:
        hits = [p.rate for p in points if p.policy == name and p.saturated]
        saturated_at[name] = min(hits) if hits else None
    write_json(
        args.out,
        "route_sweep",
        {
            "workload": args.workload,
            "source": source.describe(),
            "workers": setup.workers,
            "compression": setup.compression,
            "duration_s": getattr(setup, "duration", None),
            "ttft_bound_s": args.ttft_bound,
            "stream": args.stream,
            "worker_spec": spec.__dict__,
            "rates": loads,
            "saturated_at": saturated_at,
            "points": [p.as_dict() for p in points],
            "descriptions": {n: POLICIES[n].description for n in args.policies},
        },
    )
    title = f"{args.workload}, {setup.workers} workers"
    path = write_sweep_plot(args.out, [p.as_dict() for p in points], title=title)
    print(f"wrote {path}")


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
