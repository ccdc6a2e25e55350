"""Prometheus metrics of one frontend, in its own registry (several frontends share a test process).

Outcomes: `ok`, `shed` (429: kv mode refused it for load, or the engine did), `client_error`
(another 4xx the frontend or the engine answered), `upstream_error`
(engine unreachable, 5xx, broken hand-off), `unavailable` (503: unknown worker, none
discovered), `timeout`, `cancelled` (the client went away), `error` (a frontend bug). Latency
histograms are per mode and stream flag; the prefill leg has its own.

The five updates every request makes (in-flight up and down, the request counter, two latency
histograms) are plain numbers turned into metric families at scrape time (`_PerRequest`):
prometheus_client's Counter/Gauge/Histogram take a lock and some ten Python calls per update,
which was ~9% of the hop's instructions. The frontend updates them from its one event-loop
thread only. The rarer metrics stay prometheus_client objects.
"""

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
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
_LE = [str(b) for b in _BUCKETS] + ["+Inf"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

REQUESTS = "dynamograph_frontend_requests"
LATENCY = "dynamograph_frontend_request_duration_seconds"
TTFB = "dynamograph_frontend_time_to_first_byte_seconds"
INFLIGHT = "dynamograph_frontend_inflight_requests"


class _Histogram:
    """One label set's histogram: a count per bucket (the last is +Inf) and the sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(_BUCKETS, seconds)] += 1  # buckets are `le`: bound inclusive
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for le, count in zip(_LE, self.counts, strict=True):
            total += count
            out.append((le, total))
        return out


class _PerRequest:
    """The per-request metrics as plain numbers; a prometheus_client collector."""

    def __init__(self) -> None:
        self.inflight = 0
        self.requests: dict[tuple[str, str, str], int] = {}  # (mode, outcome, disagg)
        self.latency: dict[tuple[str, str], _Histogram] = {}  # (mode, stream)
        self.ttfb: dict[tuple[str, str], _Histogram] = {}

    def collect(self):
        requests = CounterMetricFamily(
            REQUESTS,
            "Requests handled, by routing mode, outcome and whether they were disaggregated",
            labels=["mode", "outcome", "disagg"],
        )
        for labels, value in self.requests.items():
            requests.add_metric(labels, value)
        yield requests
        for name, doc, series in (
            (LATENCY, "Arrival to last byte sent, by routing mode and stream flag", self.latency),
            (
                TTFB,
                "Arrival to the decode engine's first response byte (includes any prefill leg)",
                self.ttfb,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=["mode", "stream"])
            for labels, histogram in series.items():
                family.add_metric(labels, histogram.cumulative(), histogram.sum)
            yield family
        yield GaugeMetricFamily(INFLIGHT, "Requests in progress", value=self.inflight)


def _observe(series: dict[tuple[str, str], _Histogram], key: tuple[str, str], s: float) -> None:
    histogram = series.get(key)
    if histogram is None:
        histogram = series[key] = _Histogram()
    histogram.observe(s)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._per_request = _PerRequest()
        r.register(self._per_request)
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
        self.retries = Counter(
            "dynamograph_frontend_retries",
            "Requests sent to a second worker because the first never answered (connection "
            "refused, or no response head within --first-byte-timeout; kv and round-robin modes)",
            registry=r,
        )
        self.fallbacks = Counter(
            "dynamograph_frontend_disagg_fallbacks",
            "Disaggregated requests served aggregated on the decode worker after a prefill failure",
            registry=r,
        )
        self.speculative = Counter(
            "dynamograph_frontend_speculative_prefills",
            "Speculative prefills of a session's next turn (agent_hints.speculative_prefill), by "
            "outcome: done, cancelled (the next turn came first), failed",
            ["outcome"],
            registry=r,
        )
        self.workers = Gauge(
            "dynamograph_frontend_known_workers",
            "Engines this frontend may forward to, by role",
            ["role"],
            registry=r,
        )

    def started(self) -> None:
        self._per_request.inflight += 1

    def finished(self, mode: str, outcome: str, disagg: str, stream: bool, seconds: float) -> None:
        """A request that `started()` is done: counted, its duration observed."""
        counts = self._per_request
        counts.inflight -= 1
        key = (mode, outcome, disagg)
        counts.requests[key] = counts.requests.get(key, 0) + 1
        _observe(counts.latency, (mode, "true" if stream else "false"), seconds)

    def first_byte(self, mode: str, stream: bool, seconds: float) -> None:
        _observe(self._per_request.ttfb, (mode, "true" if stream else "false"), seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
