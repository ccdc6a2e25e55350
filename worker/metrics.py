"""`/metrics` with vLLM V1's metric names and labels (`model_name`, `engine` = DP rank).

Routers and dashboards written for vLLM read these unchanged. Gauges are computed from the
engine's state at scrape time; counters and histograms are fed as requests progress. Latency
histograms record *simulated* seconds (what the modelled GPU would show), not wall-clock.
"""

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(slots=True)
class RankGauges:
    running: int
    waiting: int
    kv_cache_usage: float
    running_loras: set[str] = field(default_factory=set)
    waiting_loras: set[str] = field(default_factory=set)


class _StateCollector(Collector):
    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int, ranks,
                 max_loras: int | None):  # fmt: skip
        self._model = model_name
        self._max_loras = max_loras
        self._block_size = block_size
        self._num_gpu_blocks = num_gpu_blocks
        self._ranks: Callable[[], Iterable[tuple[int, RankGauges]]] = ranks

    def collect(self):
        labels = ["model_name", "engine"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            labels=labels,
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels=labels
        )
        running_loras: set[str] = set()
        waiting_loras: set[str] = set()
        for rank, g in self._ranks():
            values = [self._model, str(rank)]
            running.add_metric(values, g.running)
            waiting.add_metric(values, g.waiting)
            usage.add_metric(values, g.kv_cache_usage)
            running_loras |= g.running_loras
            waiting_loras |= g.waiting_loras
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching", "cache_dtype"],
        )
        info.add_metric([str(self._block_size), str(self._num_gpu_blocks), "True", "auto"], 1.0)
        yield from (running, waiting, usage, info)
        if self._max_loras is not None:
            # vLLM's shape (GAIE reads it): adapters as comma-joined labels, value = update time
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora.add_metric(
                [str(self._max_loras), ",".join(sorted(waiting_loras)),
                 ",".join(sorted(running_loras))],
                time.time(),
            )  # fmt: skip
            yield lora


class WorkerMetrics:
    """`max_loras`: set when the engine serves LoRA adapters (adds `vllm:lora_requests_info`)."""

    def __init__(self, model_name: str, block_size: int, num_gpu_blocks: int, ranks,
                 max_loras: int | None = None):  # fmt: skip
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.registry.register(
            _StateCollector(model_name, block_size, num_gpu_blocks, ranks, max_loras)
        )
        labels = ["model_name", "engine"]
        r = self.registry
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=r
        )
        self.preemptions = Counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            labels,
            registry=r,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            labels,
            registry=r,
        )
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            labels,
            registry=r,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", labels, buckets=REQUEST_BUCKETS, registry=r)  # fmt: skip

    def for_rank(self, rank: int) -> "RankMetrics":
        return RankMetrics(self, (self.model_name, str(rank)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RankMetrics:
    """One rank's labelled children, bound once (label lookups cost more than the increments)."""

    def __init__(self, m: WorkerMetrics, labels: tuple[str, str]):
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.preemptions = m.preemptions.labels(*labels)
        self.prefix_queries = m.prefix_queries.labels(*labels)
        self.prefix_hits = m.prefix_hits.labels(*labels)
        self.ttft = m.ttft.labels(*labels)
        self.itl = m.itl.labels(*labels)
        self.e2e = m.e2e.labels(*labels)
        self.queue_time = m.queue_time.labels(*labels)
        self.prefill_time = m.prefill_time.labels(*labels)
        self._success = m.success
        self._labels = labels

    def success(self, reason: str):
        return self._success.labels(*self._labels, reason)
