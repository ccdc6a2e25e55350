"""Routing-quality metrics from replay results: pure functions, no I/O.

Two clocks. The engines report each request's TTFT and end-to-end time in simulated GPU
seconds (`nvext.timing`): the routing-quality figures. The client measures wall seconds, reported
in trace seconds (wall × time scale, since the replay compresses arrivals by the factor the
engines speed up their simulated GPU); their gap to the engine's figures is what the router hop
and this host's CPU add, scaled up by the same factor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import orjson

from .procstat import GroupUsage

OK = "ok"
SHED = "shed"  # refused for load: the client's in-flight cap, or HTTP 429 / 503 from the router
ERROR = "error"


@dataclass(slots=True)
class RequestResult:
    index: int
    status: str = ERROR
    ttft_s: float | None = None  # wall, from send to the first generated token
    e2e_s: float | None = None  # wall, from send to the end of the stream
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    worker: str | None = None  # the engine's instance id (nvext.worker_id), when it says
    engine_ttft_s: float | None = None  # simulated, as the engine reports it (nvext.timing)
    engine_e2e_s: float | None = None
    sent_at: float | None = None  # Unix seconds the request was sent: joins the gateway's log
    response_id: str | None = None  # the answer's OpenAI `id`: joins a router's engine records


EngineFigures = tuple[float | None, float | None]  # simulated TTFT and duration, seconds


def set_engine_figures(
    results: Iterable[RequestResult], figures: Callable[[str], EngineFigures | None]
) -> None:
    """Each result's engine TTFT and duration from `figures(the answer's id)`, for a router that
    answers `nvext.timing` from its own clock: a result with no record gets none, never the
    router's wall clock."""
    for result in results:
        found = figures(result.response_id or "")
        result.engine_ttft_s, result.engine_e2e_s = found if found is not None else (None, None)


@dataclass
class PolicyMetrics:
    policy: str
    requests: int
    ok: int
    shed: int
    errors: int
    # Time to first token as the engines report it, in simulated GPU seconds (nvext.timing):
    # what routing decides (queueing and prefill of uncached tokens), free of this host's CPU
    # noise and of the router hop, which the wall-clock figures below multiply by time_scale.
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    # Measured by the client, wall seconds × time_scale (TTFT only when streaming).
    client_ttft_p50_s: float | None
    client_ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    engine_e2e_p50_s: float | None
    outside_engine_p50_s: float | None  # client e2e − engine e2e: router hop and host overhead
    throughput_tok_s: float  # output tokens per trace second
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float  # cached / prompt tokens of served requests (usage.cached_tokens)
    reuse_captured: float  # hit_rate / the trace's inherent reuse
    imbalance: float | None  # max / mean of requests per worker (1.0 = even)
    per_worker_requests: dict[str, int] = field(default_factory=dict)
    worker_hit_rate: float | None = None  # from the engines' prefix-cache counters
    outside_engine_p99_s: float | None = None
    wall_s: float = 0.0
    first_error: str | None = None
    # The router's processes over the replay (bench/procstat.py): CPU and run-queue wait per
    # request answered 200, and how busy the host's CPUs were meanwhile. A router that waits
    # for a CPU as long as it runs is measured on a box out of CPU.
    router_cpu_ms_per_request: float | None = None
    router_cpu_wait_ms_per_request: float | None = None
    host_busy: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def load_imbalance(per_worker: Mapping[str, float]) -> float | None:
    """max / mean over workers (1.0 = perfectly even); None without workers or load."""
    loads = np.asarray(list(per_worker.values()), dtype=float)
    if not len(loads) or loads.mean() == 0:
        return None
    return float(loads.max() / loads.mean())


def summarize(
    policy: str,
    results: Sequence[RequestResult],
    *,
    inherent_reuse: float,
    time_scale: float,
    wall_s: float,
    per_worker_requests: Mapping[str, int] | None = None,
    worker_hit_rate: float | None = None,
    host: GroupUsage | None = None,
) -> PolicyMetrics:
    served = [r for r in results if r.status == OK]
    ttft = [r.engine_ttft_s for r in served if r.engine_ttft_s is not None]
    client_ttft = [r.ttft_s * time_scale for r in served if r.ttft_s is not None]
    e2e = [r.e2e_s * time_scale for r in served if r.e2e_s is not None]
    engine_e2e = [r.engine_e2e_s for r in served if r.engine_e2e_s is not None]
    outside = [
        r.e2e_s * time_scale - r.engine_e2e_s
        for r in served
        if r.e2e_s is not None and r.engine_e2e_s is not None
    ]
    prompt = sum(r.prompt_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    hit_rate = cached / prompt if prompt else 0.0
    output = sum(r.output_tokens for r in served)
    errors = [r for r in results if r.status == ERROR]
    per_worker = dict(per_worker_requests or {})
    return PolicyMetrics(
        policy=policy,
        requests=len(results),
        ok=len(served),
        shed=sum(r.status == SHED for r in results),
        errors=len(errors),
        ttft_p50_s=percentile(ttft, 50),
        ttft_p90_s=percentile(ttft, 90),
        ttft_p99_s=percentile(ttft, 99),
        client_ttft_p50_s=percentile(client_ttft, 50),
        client_ttft_p99_s=percentile(client_ttft, 99),
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        engine_e2e_p50_s=percentile(engine_e2e, 50),
        outside_engine_p50_s=percentile(outside, 50),
        throughput_tok_s=output / (wall_s * time_scale) if wall_s > 0 else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=hit_rate,
        reuse_captured=hit_rate / inherent_reuse if inherent_reuse > 0 else 0.0,
        imbalance=load_imbalance(per_worker),
        per_worker_requests=per_worker,
        worker_hit_rate=worker_hit_rate,
        outside_engine_p99_s=percentile(outside, 99),
        wall_s=wall_s,
        first_error=errors[0].error if errors else None,
        **router_cost(host, len(served)),
    )


def router_cost(host: GroupUsage | None, served: int) -> dict[str, float | None]:
    """The router's CPU and run-queue wait per request served over a replay (`host`: what
    the processes did meanwhile), and the host's busy share: `PolicyMetrics`' fields."""
    if host is None:
        return {}
    router = host.groups.get("router")
    if router is None or not served:
        return {"host_busy": host.host_busy}
    return {
        "router_cpu_ms_per_request": router.cpu_s / served * 1e3,
        "router_cpu_wait_ms_per_request": router.wait_s / served * 1e3,
        "host_busy": host.host_busy,
    }


def split_metrics(
    results: Sequence[RequestResult],
    groups: Sequence[str],
    reusable: Sequence[int] | None = None,
) -> dict[str, dict[str, float | int | None]]:
    """Per group of requests (`groups[i]` names request i's, e.g. first turn / follow-up /
    document): how many, how many served, engine TTFT p50 / p99 and prefix hit rate. With
    `reusable` (per request, the prompt tokens an infinite prefix cache held: the workload's
    inherent reuse) also where reuse was lost: the served requests' reusable tokens, the
    share of them served from cache, and the reusable tokens their workers had to prefill."""
    members: dict[str, list[RequestResult]] = {}
    for result in results:
        members.setdefault(groups[result.index], []).append(result)
    out: dict[str, dict[str, float | int | None]] = {}
    for name, rs in members.items():
        served = [r for r in rs if r.status == OK]
        ttft = [r.engine_ttft_s for r in served if r.engine_ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in served)
        cached = sum(r.cached_tokens for r in served)
        out[name] = {
            "requests": len(rs),
            "ok": len(served),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "hit_rate": cached / prompt if prompt else None,
        }
        if reusable is not None:
            held = sum(reusable[r.index] for r in served)
            captured = sum(min(r.cached_tokens, reusable[r.index]) for r in served)
            out[name]["reusable_tokens"] = held
            out[name]["reuse_captured"] = captured / held if held else None
            out[name]["reuse_lost_tokens"] = held - captured
    return out


def follow_up_moves(
    results: Sequence[RequestResult], labels: Sequence[Mapping[str, Any]]
) -> dict[str, float | int] | None:
    """How often a conversation left the worker holding its history: of the follow-up turns
    served whose previous turn was served too, both by a worker that said its id, those served
    by another worker than that turn's. `labels[i]` is request i's (`session`, `turn`, `kind`
    as the multi-turn workload writes them); None without sessions (the Mooncake trace)."""
    if not labels or "session" not in labels[0]:
        return None
    served = {}
    for r in results:
        label = labels[r.index]
        if r.status == OK and r.worker is not None and label.get("kind") == "turn":
            served[label["session"], label["turn"]] = r.worker
    follow_ups = moved = 0
    for (session, turn), worker in served.items():
        previous = served.get((session, turn - 1))
        if previous is not None:
            follow_ups += 1
            moved += worker != previous
    return {
        "follow_ups": follow_ups,
        "moved": moved,
        "share": moved / follow_ups if follow_ups else 0.0,
    }


GATEWAY_PHASES = ("request_ms", "worker_ms", "response_hold_ms", "total_ms")
# A request's time outside the engine, in parts (`gateway_phases`): client send → the gateway's
# first byte; the gateway's request path (the EPP's pick); the gateway's worker phase beyond
# the engine's own time (the worker's HTTP and tokenizing, CPU waits); the response head held
# for the EPP; the rest (the response's transfer, the client reading it).
OUTSIDE_PARTS = ("to_gateway_ms", "request_ms", "worker_beyond_engine_ms", "response_hold_ms",
                 "after_gateway_ms")  # fmt: skip


def gateway_phases(
    lines: Iterable[bytes],
    since: float = 0.0,
    results: Iterable[RequestResult] = (),
    time_scale: float = 1.0,
) -> dict[str, Any]:
    """p50 / p90 / p99 of each phase, in ms (`local.envoy.ACCESS_LOG_FIELDS` logs them in µs),
    over the requests the gateway answered 200 that started at `since` (Unix seconds) or later,
    from its JSON access log lines; a phase Envoy could not time ("-": it never reached the
    worker) is left out of that phase. With the client's `results` (their `x-request-id` is
    `bench-<index>`), also the parts of each served request's time outside the engine
    (`OUTSIDE_PARTS`), joined by request id: the engine's time is simulated, `time_scale` times
    faster than the wall."""
    served = {f"bench-{r.index}": r for r in results if r.status == OK}
    phases: dict[str, list[float]] = {name: [] for name in GATEWAY_PHASES}
    parts: dict[str, list[float]] = {name: [] for name in OUTSIDE_PARTS}
    answered = 0
    for line in lines:
        if not line.strip():
            continue
        row = orjson.loads(line)
        if str(row.get("code")) != "200" or float(row.get("start", 0)) < since:
            continue
        answered += 1
        timed = {}
        for name, values in phases.items():
            value = row.get(name[: -len("_ms")] + "_us")  # logged in µs
            if value not in (None, "-", ""):
                timed[name] = float(value) / 1e3
                values.append(timed[name])
        result = served.get(row.get("request_id"))
        if result is not None and len(timed) == len(GATEWAY_PHASES):
            for name, value in _outside_parts(result, float(row["start"]), timed, time_scale):
                parts[name].append(value)
    out: dict[str, Any] = {
        "requests": answered,
        **{
            name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
            for name, values in phases.items()
        },
    }
    if served:
        out["outside_engine_parts"] = {
            "joined": len(parts["request_ms"]),
            **{
                name: {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
                for name, values in parts.items()
            },
        }
    return out


def _outside_parts(
    result: RequestResult, start: float, timed: dict[str, float], time_scale: float
) -> Iterator[tuple[str, float]]:
    if result.sent_at is None or result.e2e_s is None or result.engine_e2e_s is None:
        return
    to_gateway = (start - result.sent_at) * 1e3  # both clocks this host's: ms apart at worst
    yield "to_gateway_ms", to_gateway
    yield "request_ms", timed["request_ms"]
    yield "worker_beyond_engine_ms", timed["worker_ms"] - result.engine_e2e_s / time_scale * 1e3
    yield "response_hold_ms", timed["response_hold_ms"]
    yield "after_gateway_ms", result.e2e_s * 1e3 - to_gateway - timed["total_ms"]
