"""Routing-quality metrics from replay results: pure functions, no I/O.

Latencies are measured in wall seconds and reported in trace seconds (wall × time scale): the
replay compresses arrivals by the same factor the mock engines speed up their simulated GPU,
so trace seconds are what the same fleet would show at the trace's real pace.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

OK = "ok"
SHED = "shed"  # refused for load: the client's in-flight cap, or HTTP 429 / 503 from the router
ERROR = "error"


@dataclass(slots=True)
class RequestResult:
    index: int
    arrival_s: float  # scheduled offset from the start of the replay (wall)
    status: str = ERROR
    http_status: int | None = None
    ttft_s: float | None = None  # wall, from send to the first generated token
    e2e_s: float | None = None  # wall, from send to the end of the stream
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


@dataclass
class PolicyMetrics:
    policy: str
    requests: int
    ok: int
    shed: int
    errors: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    throughput_tok_s: float  # output tokens per trace second
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float  # cached / prompt tokens of served requests (usage.cached_tokens)
    reuse_captured: float  # hit_rate / the trace's inherent reuse
    imbalance: float | None  # max / mean of requests per worker (1.0 = even)
    per_worker_requests: dict[str, int] = field(default_factory=dict)
    worker_hit_rate: float | None = None  # from the engines' prefix-cache counters
    wall_s: float = 0.0
    first_error: str | None = None

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
) -> PolicyMetrics:
    served = [r for r in results if r.status == OK]
    ttft = [r.ttft_s * time_scale for r in served if r.ttft_s is not None]
    e2e = [r.e2e_s * time_scale for r in served if r.e2e_s is not None]
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
        e2e_p50_s=percentile(e2e, 50),
        e2e_p99_s=percentile(e2e, 99),
        throughput_tok_s=output / (wall_s * time_scale) if wall_s > 0 else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        hit_rate=hit_rate,
        reuse_captured=hit_rate / inherent_reuse if inherent_reuse > 0 else 0.0,
        imbalance=load_imbalance(per_worker),
        per_worker_requests=per_worker,
        worker_hit_rate=worker_hit_rate,
        wall_s=wall_s,
        first_error=errors[0].error if errors else None,
    )
