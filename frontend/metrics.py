"""Prometheus metrics of one frontend, in its own registry (several frontends share a test process).

Outcomes: `ok`, `client_error` (4xx the frontend or the engine answered), `upstream_error`
(engine unreachable, 5xx, broken hand-off), `unavailable` (503: unknown worker, none
discovered), `timeout`, `cancelled` (the client went away), `error` (a frontend bug). Latency
histograms are per mode and stream flag; the prefill leg has its own.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Proxy overhead lives in the sub-millisecond range, generation in seconds: cover both.
_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "dynamograph_frontend_requests",
            "Requests handled, by routing mode, outcome and whether they were disaggregated",
            ["mode", "outcome", "disagg"],
            registry=r,
        )
        self.latency = Histogram(
            "dynamograph_frontend_request_duration_seconds",
            "Arrival to last byte sent, by routing mode and stream flag",
            ["mode", "stream"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "dynamograph_frontend_time_to_first_byte_seconds",
            "Arrival to the decode engine's first response byte (includes any prefill leg)",
            ["mode", "stream"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.prefill = Histogram(
            "dynamograph_frontend_prefill_duration_seconds",
            "Duration of the prefill leg of disaggregated requests",
            buckets=_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "dynamograph_frontend_upstream_errors",
            "Engine calls that failed, by leg (prefill, decode) and kind",
            ["leg", "kind"],
            registry=r,
        )
        self.fallbacks = Counter(
            "dynamograph_frontend_disagg_fallbacks",
            "Disaggregated requests served aggregated on the decode worker after a prefill failure",
            registry=r,
        )
        self.inflight = Gauge(
            "dynamograph_frontend_inflight_requests", "Requests in progress", registry=r
        )
        self.workers = Gauge(
            "dynamograph_frontend_known_workers",
            "Engines this frontend may forward to, by role",
            ["role"],
            registry=r,
        )

        # Labelled children looked up once: `labels()` costs more than the increment itself.
        self._done: dict[tuple[str, str, str, bool], tuple[Counter, Histogram]] = {}
        self._first: dict[tuple[str, bool], Histogram] = {}

    def finished(self, mode: str, outcome: str, disagg: str, stream: bool, seconds: float) -> None:
        key = (mode, outcome, disagg, stream)
        children = self._done.get(key)
        if children is None:
            flag = "true" if stream else "false"
            children = self._done[key] = (
                self.requests.labels(mode, outcome, disagg),
                self.latency.labels(mode, flag),
            )
        children[0].inc()
        children[1].observe(seconds)

    def first_byte(self, mode: str, stream: bool, seconds: float) -> None:
        child = self._first.get((mode, stream))
        if child is None:
            child = self._first[(mode, stream)] = self.ttft.labels(
                mode, "true" if stream else "false"
            )
        child.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
