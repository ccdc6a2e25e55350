"""`--mode kv`: the frontend picks workers with the router core itself (no gateway in front).

For users without an Envoy gateway and endpoint picker: the frontend runs the router core
(`router.scheduler.Router`) fed by the same discovery, load scraping (`router.load`) and, unless
`--kv-events off`, KV-event ingestion (`router.kv_events`) as the EPP, and routes each request
through the same request pipeline (`router.pipeline.RequestPipeline`): model and LoRA adapter
check, tokenization with the workers' tokenizer, block hashing, scheduling. The booking is
released when the request ends. With replica settings, the frontend's replicas share their
in-flight bookings and session bindings as the EPP's do (`router.replicas.ReplicaSync`).
Overload is answered as the EPP answers it (`router.admission`): past `--max-pending-picks`
requests being routed, or with the event loop past `--max-loop-lag` behind, 429 at once.
"""

import itertools
from typing import Any

from prometheus_client import CollectorRegistry

from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.nvext import NvExt
from dynamograph.protocol.openai import OpenAIError
from dynamograph.protocol.pins import RoutePins
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.admission import Admission, AdmissionLimits, LoopLag, export_admission
from dynamograph.router.discovery import WorkerRecord
from dynamograph.router.kv_events import IngestMetrics, KvEventIngest
from dynamograph.router.load import LoadScraper
from dynamograph.router.pipeline import RequestPipeline, query_answer
from dynamograph.router.replicas import ReplicaSettings, ReplicaSync
from dynamograph.router.scheduler import Router

from .directory import WorkerDirectory
from .modes import Route
from .routing import Mode, Pins, Target


class KvMode:
    mode = Mode.KV

    def __init__(
        self,
        directory: WorkerDirectory,
        *,
        enforce_disagg: bool,
        kv_events: bool,
        config: RouterConfig | None = None,
        kv_curve: CurveKeys | None = None,
        replicas: ReplicaSettings | None = None,
        registry: CollectorRegistry | None = None,
        admission: AdmissionLimits | None = None,
    ):
        self.directory = directory
        self.kv_curve = kv_curve
        base = config or RouterConfig()
        # The frontend's own flags can only tighten what the router config file says.
        self.config = base.model_copy(
            update={
                "enforce_disagg": enforce_disagg or base.enforce_disagg,
                "use_kv_events": kv_events and base.use_kv_events,
            }
        )
        self.router = Router(self.config)
        # ingestion's series (`dynamograph_frontend_kv_event_*`) on the frontend's /metrics
        self.ingest_metrics = (
            IngestMetrics.create("dynamograph_frontend_", registry)
            if registry is not None and self.config.use_kv_events
            else None
        )
        self.replicas = (
            ReplicaSync(self.router.active, replicas, sessions=self.router.sessions)
            if replicas is not None
            else None
        )
        self.pipeline = RequestPipeline(self.router)
        self._ids = itertools.count()
        # Overload is a fast answer (the EPP's rule): past the limits a new pick is refused at
        # once with 429 and Retry-After instead of queueing on the loop.
        self.loop_lag = LoopLag()
        self.admission = Admission(
            admission or AdmissionLimits(),
            self.config.retry_after_s,
            self.loop_lag,
            who="the frontend's router",
        )
        if registry is not None:
            export_admission(self.admission, self.loop_lag, "dynamograph_frontend_", registry)
        self.load: LoadScraper | None = None
        self.events: KvEventIngest | None = None
        self.tokenizers = self.pipeline.tokenizers

    async def start(self) -> None:
        self.loop_lag.start()
        # Created here: they bind to the running event loop.
        self.load = LoadScraper(self.router, on_unreachable=self.directory.mark_unreachable)
        if self.config.use_kv_events:
            self.events = KvEventIngest(
                self.router,
                self.ingest_metrics,
                on_disconnect=self.load.probe_now,
                curve=self.kv_curve,
            )
            self.pipeline.read_events = self.events.read_queued
        self.directory.add_listener(self._added, self._removed)
        if self.replicas is not None:  # the peers' bookings before our first request
            await self.replicas.start()

    async def stop(self) -> None:
        await self.loop_lag.close()
        if self.replicas is not None:
            await self.replicas.close()
        await self.tokenizers.close()
        self.pipeline.close()
        if self.events is not None:
            self.pipeline.read_events = None
            await self.events.close()
            self.events = None
        if self.load is not None:
            await self.load.close()
            self.load = None

    def _added(self, record: WorkerRecord) -> None:
        if not self.pipeline.add_engine(record.config):
            return
        if self.load is not None:
            self.load.add(record)
        if self.events is not None:
            self.events.add(record)
        self.tokenizers.added(record.instance_id, record.config.tokenizer)

    def _removed(self, record: WorkerRecord) -> None:
        if self.directory.get(record.instance_id) is not None:
            return  # still known through the other discovery (local engine and graph)
        if self.load is not None:
            self.load.remove(record)
        if self.events is not None:
            self.events.remove(record)
        self.tokenizers.removed(record.instance_id)
        self.pipeline.remove_engine(record.instance_id)

    def refresh(self) -> None:
        self.pipeline.refresh()

    async def pick(self, pins: Pins, nvext: NvExt | None, path: str, body: dict[str, Any]) -> Route:
        self.admission.enter()  # 429 at once when saturated
        try:
            routed = await self.pipeline.decide(
                path,
                body,
                request_id=f"frontend-{next(self._ids)}",
                nvext=nvext,
                # from the header-merged nvext when there is one: it also keeps a DP rank pinned
                # without its worker, which `Pins` (engines to call) cannot name
                pins=RoutePins.from_nvext(nvext)
                if nvext is not None
                else RoutePins(
                    pins.decode.worker_id if pins.decode else None,
                    pins.decode.dp_rank if pins.decode else None,
                    pins.prefill.worker_id if pins.prefill else None,
                    pins.prefill.dp_rank if pins.prefill else None,
                ),
            )
        finally:
            self.admission.leave()
        decision = routed.decision
        try:
            decode = _target(decision.decode.worker_id, decision.decode.dp_rank, self.directory)
            route = Route(self.directory.resolve(decode, "decode"), decode, booking=decision.guard)
            if decision.prefill is not None:
                prefill = _target(
                    decision.prefill.worker_id, decision.prefill.dp_rank, self.directory
                )
                route.prefill = self.directory.resolve(prefill, "prefill")
                route.prefill_target = prefill
        except OpenAIError:
            if decision.guard is not None:
                decision.guard.free()
            raise
        if routed.token_ids is not None:  # query-only: the workers' ids and the prompt's tokens
            route.query_answer = query_answer(path, body, routed, stream=body.get("stream") is True)
        return route


def _target(worker_id: int, dp_rank: int, directory: WorkerDirectory) -> Target:
    """Send the DP rank header only to data-parallel engines."""
    record = directory.get(worker_id)
    multi = record is not None and record.config.data_parallel_size > 1
    return Target(worker_id, dp_rank if multi else None)
