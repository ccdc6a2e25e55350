"""The EPP's Prometheus metrics, on a registry of its own (several EPPs may share a process).

Names are prefixed `dynamograph_epp_`. Per-worker load and the index size are read from the
router when scraped (a collector), so the hot path only touches counters and one histogram.
"""

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynamograph.protocol.tokenization import segment_caches
from dynamograph.router.kv_events import IngestMetrics

PREFIX = "dynamograph_epp_"
# Usage is read from response bodies: a gateway whose ext_proc response body mode is NONE (the
# config we generate) sends the EPP none, and these stay 0; the workers' own metrics have it.
FROM_RESPONSES = " (only where the gateway sends response bodies to the EPP)"

# Outcomes of a request on the request path (label `outcome` of requests_total).
ROUTED = "routed"
ROUTED_HEADER_ONLY = "routed_header_only"
QUERY_ANSWERED = "query_answered"  # a query-only request (`query_instance_id`), answered by us
OUTCOME_BY_STATUS = {
    400: "bad_request",
    404: "unknown_model",
    405: "bad_request",  # a method the API does not take (CONNECT, OPTIONS, TRACE, …)
    413: "too_large",
    429: "shed",
    501: "bad_request",  # a method no HTTP spec defines
    503: "no_endpoint",
}


class _RouterCollector(Collector):
    """Reads gauges from the router at scrape time: worker load, booked requests, index size."""

    def __init__(self, snapshot: Callable[[], dict]):
        self._snapshot = snapshot

    def collect(self) -> Iterable[GaugeMetricFamily]:
        snap = self._snapshot()
        families = {
            "waiting": GaugeMetricFamily(
                PREFIX + "worker_waiting_requests",
                "vllm:num_requests_waiting as last scraped",
                labels=["worker", "dp_rank"],
            ),
            "running": GaugeMetricFamily(
                PREFIX + "worker_running_requests",
                "vllm:num_requests_running as last scraped",
                labels=["worker", "dp_rank"],
            ),
            "kv_usage": GaugeMetricFamily(
                PREFIX + "worker_kv_usage",
                "vllm:kv_cache_usage_perc as last scraped (0..1)",
                labels=["worker", "dp_rank"],
            ),
            "booked": GaugeMetricFamily(
                PREFIX + "worker_booked_requests",
                "requests routed to this slot that have not finished (with replica sync: by any "
                "EPP replica)",
                labels=["worker", "dp_rank"],
            ),
        }
        for (worker, rank), values in snap.get("slots", {}).items():
            for key, family in families.items():
                if values.get(key) is not None:
                    family.add_metric([worker, str(rank)], values[key])
        yield from families.values()
        workers = GaugeMetricFamily(
            PREFIX + "workers", "workers known to the EPP", labels=["role", "ready"]
        )
        for (role, ready), count in snap.get("workers", {}).items():
            workers.add_metric([role, "true" if ready else "false"], count)
        yield workers
        if snap.get("index_blocks") is not None:
            yield GaugeMetricFamily(
                PREFIX + "index_blocks",
                "KV blocks in the index, summed over worker slots",
                value=snap["index_blocks"],
            )


class _SegmentCacheCollector(Collector):
    """The tokenizers' segment caches (`protocol.tokenization.SegmentCache`), read at scrape
    time: how much of the prompts' text was found tokenized already."""

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        hits = CounterMetricFamily(
            PREFIX + "tokenizer_segment_cache_hits",
            "prompt segments (text between special tokens, long text in chunks of ~8k characters) "
            "found tokenized",
            labels=["tokenizer"],
        )
        misses = CounterMetricFamily(
            PREFIX + "tokenizer_segment_cache_misses",
            "prompt segments tokenized (not in the cache)",
            labels=["tokenizer"],
        )
        size = GaugeMetricFamily(
            PREFIX + "tokenizer_segment_cache_bytes",
            "bytes the segment cache holds (texts and token ids)",
            labels=["tokenizer"],
        )
        for identity, cache in segment_caches().items():
            hits.add_metric([identity], cache.hits)
            misses.add_metric([identity], cache.misses)
            size.add_metric([identity], cache.bytes)
        yield from (hits, misses, size)


class EppMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        r.register(_SegmentCacheCollector())
        self.requests = Counter(
            PREFIX + "requests",
            "requests by outcome on the request path (routed, or the error answered)",
            ["outcome"],
            registry=r,
        )
        self.responses = Counter(
            PREFIX + "responses",
            "upstream responses seen by status class, and streams ended before the response did",
            ["status"],
            registry=r,
        )
        self.pick_seconds = Histogram(
            PREFIX + "pick_seconds",
            "time from the last request body chunk to the decision (parse, tokenize, hash, score)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "prompt tokens of routed requests (EPP's count)", registry=r
        )
        self.predicted_cached_tokens = Counter(
            PREFIX + "predicted_cached_tokens",
            "prompt tokens predicted cached on the chosen worker (stored there, or held by its "
            "live requests with booked_prefix_hits)",
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            PREFIX + "reported_cached_tokens",
            "usage.prompt_tokens_details.cached_tokens reported by workers" + FROM_RESPONSES,
            registry=r,
        )
        self.reported_prompt_tokens = Counter(
            PREFIX + "reported_prompt_tokens",
            "usage.prompt_tokens of responses that reported cached tokens" + FROM_RESPONSES,
            registry=r,
        )
        self.cached_prediction_error = Histogram(
            PREFIX + "cached_tokens_prediction_error",
            "reported minus predicted cached tokens per request (0 = the index was right)"
            + FROM_RESPONSES,
            buckets=(-4096, -1024, -256, -64, -16, -1, 0, 16, 64, 256, 1024, 4096),
            registry=r,
        )
        self.reuse_captured = Gauge(
            PREFIX + "reuse_captured_ratio",
            "reported cached tokens / reported prompt tokens since start" + FROM_RESPONSES,
            registry=r,
        )
        self.served_mismatch = Counter(
            PREFIX + "served_endpoint_mismatch",
            "responses whose x-gateway-destination-endpoint-served differs from the pick",
            registry=r,
        )
        self.active_streams = Gauge(
            PREFIX + "active_streams", "ext_proc streams in progress", registry=r
        )
        self.kv_ingest = IngestMetrics.create(PREFIX, r)
        self.scrape_failures = Counter(
            PREFIX + "scrape_failures", "failed /metrics scrapes of workers", registry=r
        )
        self.tokenizer_load_failures = Counter(
            PREFIX + "tokenizer_load_failures",
            "failed loads of a tokenizer workers publish (its workers are not routed to meanwhile)",
            ["tokenizer"],
            registry=r,
        )
        # Label children of the per-request counters, bound once: `labels()` costs a lock and
        # a dict lookup on every call.
        self.routed = self.requests.labels(ROUTED)
        self.routed_header_only = self.requests.labels(ROUTED_HEADER_ONLY)
        self.query_answered = self.requests.labels(QUERY_ANSWERED)
        self._responses_by_class = {
            code: self.responses.labels(f"{code}xx") for code in range(1, 6)
        }

    def response_status(self, status: int) -> None:
        """Count an upstream response by status class (2xx, 4xx, …)."""
        child = self._responses_by_class.get(status // 100)
        if child is None:
            child = self.responses.labels(f"{status // 100}xx")
        child.inc()

    def observe_usage(self, predicted: int, reported_cached: int, reported_prompt: int) -> None:
        self.reported_cached_tokens.inc(reported_cached)
        self.reported_prompt_tokens.inc(reported_prompt)
        self.cached_prediction_error.observe(reported_cached - predicted)
        total = self.reported_prompt_tokens._value.get()
        if total:
            self.reuse_captured.set(self.reported_cached_tokens._value.get() / total)

    def add_router_collector(self, snapshot: Callable[[], dict]) -> None:
        self.registry.register(_RouterCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
