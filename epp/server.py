"""The endpoint picker process: discovery → router ← KV events + load, behind ext_proc gRPC.

`Epp(settings)` wires the parts and runs them on one event loop:
- `Discovery` feeds worker add/remove into the router core, the KV event subscribers
  (`kv_events.KvEventIngest`), the load scraper (`load.LoadScraper`) and the pickers' view;
- the ext_proc service (`extproc.ExtProcService`) on the gRPC port, plaintext or, with
  `settings.tls`, TLS (`tls.server_credentials`: a certificate folder, optionally reloaded, or a
  self-signed one) like GAIE's `--secure-serving`;
- gRPC health on the health port: `liveness`, `readiness` (ready once a worker is known and the
  tokenizers the workers name are loaded) and
  `envoy.service.ext_proc.v3.ExternalProcessor`;
- Prometheus metrics on the metrics port (`/metrics`);
- with `settings.pool_name`, a watch of that InferencePool's InferenceObjectives
  (`objectives`), whose priorities order the router queue;
- with `settings.replicas`, replica sync (`replicas.ReplicaSync`): the other EPP replicas'
  in-flight bookings counted in this one's load and their sticky-session bindings held in
  this one's, and this one's published to them.
`drain()` (SIGTERM) turns readiness NOT_SERVING, lets streams in flight finish for `grace`
seconds, then stops everything.
"""

import asyncio
import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from dynamograph.protocol.kv_curve import CurveKeys
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.admission import AdmissionLimits, LoopLag, export_admission
from dynamograph.router.discovery import Discovery, KubernetesSource, StaticSource, WorkerRecord
from dynamograph.router.kv_events import INGEST_INTERVAL_S, KvEventIngest
from dynamograph.router.load import LoadScraper
from dynamograph.router.pipeline import RequestPipeline
from dynamograph.router.replicas import ReplicaCollector, ReplicaSettings, ReplicaSync
from dynamograph.router.scheduler import Router
from dynamograph.router.tasks import cancel_all
from dynamograph.router.waiting import QueueCollector

from .extproc import (
    DEFAULT_MAX_BODY_BYTES,
    SERVICE_NAME,
    ExtProcService,
)
from .metrics import PREFIX, EppMetrics
from .objectives import ObjectiveTable, objective_watch
from .picker import EndpointView, KvEndpointPicker, RandomEndpointPicker
from .tls import CertificateSource, TlsSettings, server_credentials

log = logging.getLogger(__name__)

LIVENESS = "liveness"
READINESS = "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class EppSettings:
    host: str = "0.0.0.0"
    grpc_port: int = 9002
    health_port: int = 9003
    metrics_port: int = 9090
    metrics_host: str | None = None  # default: host (`--processes` children: loopback)
    router: RouterConfig = field(default_factory=RouterConfig)
    kv_events: bool = True
    kv_curve: CurveKeys | None = None  # CURVE on the KV-event subscriptions (protocol.kv_curve)
    endpoint_picker: str = "kv"  # kv | random (no body parsing: the protocol floor)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # past either limit a new request gets 429 at once (router.admission)
    admission: AdmissionLimits = field(default_factory=AdmissionLimits)
    scrape_interval: float = 0.5
    # KV-event sockets are read in rounds at most this often while batches keep coming
    # (router.kv_events.Ticker): longer saves CPU, and each batch waits up to that long
    kv_ingest_interval: float = INGEST_INTERVAL_S
    drain_grace: float = 30.0
    # TLS on the ext_proc port (None: plaintext h2c). Health and metrics stay plaintext, as in
    # GAIE: kubelet probes and Prometheus scrapes reach them directly.
    tls: TlsSettings | None = None
    # Move the long-lived heap (modules, tokenizers, the router) out of the cyclic GC's reach
    # once started (gc.freeze): only for a process of its own (`dynamograph epp`), since it
    # is process-wide. Measured in `bench epp`: a single full collection of the ~160k startup
    # objects cost up to 0.45 s of CPU (and that long a pause) every ~1,500 requests, which
    # was ~0.3 ms per routed request; with the heap frozen, collections only see new objects.
    freeze_heap: bool = False
    # Active-active: share in-flight bookings with peer EPPs (router/replicas.py; docs/epp.md)
    replicas: ReplicaSettings | None = None
    # Several EPP processes on the same ports (`--processes`): the kernel spreads connections
    reuse_port: bool = False
    # GAIE InferenceObjective priorities (epp/objectives.py): a static name → priority mapping,
    # and with `pool_name`, a watch of the objectives of that InferencePool in
    # `pool_namespace` (`kube_api`: a kubernetes_asyncio Configuration; None: in-cluster or
    # $KUBECONFIG)
    objectives: dict[str, int] = field(default_factory=dict)
    pool_name: str | None = None
    pool_namespace: str = "default"
    kube_api: Any = None


class Epp:
    def __init__(self, settings: EppSettings, source: StaticSource | KubernetesSource):
        self.settings = settings
        self.metrics = EppMetrics()
        self.router = Router(settings.router)
        self.pipeline = RequestPipeline(self.router)
        self.discovery = Discovery(source)
        self.view = EndpointView()
        self.objectives = ObjectiveTable(settings.objectives)
        self._objective_watch: asyncio.Task | None = None
        self.load = LoadScraper(
            self.router,
            interval=settings.scrape_interval,
            on_unreachable=self.discovery.mark_unreachable,
            metrics=self.metrics,
        )
        self.kv = (
            KvEventIngest(
                self.router,
                self.metrics.kv_ingest,
                interval_s=settings.kv_ingest_interval,
                on_disconnect=self.load.probe_now,
                curve=settings.kv_curve,
            )
            if settings.kv_events
            else None
        )
        if self.kv is not None:
            self.pipeline.read_events = self.kv.read_queued
        self.picker = (
            RandomEndpointPicker(self.view, self.router)
            if settings.endpoint_picker == "random"
            else KvEndpointPicker(self.pipeline, self.view, self.objectives)
        )
        self.loop_lag = LoopLag()
        self.service = ExtProcService(
            self.picker,
            self.metrics,
            max_body_bytes=settings.max_body_bytes,
            admission=settings.admission,
            retry_after_s=settings.router.retry_after_s,
            loop_lag=self.loop_lag,
        )
        export_admission(self.service.admission, self.loop_lag, PREFIX, self.metrics.registry)
        self.replicas = (
            ReplicaSync(self.router.active, settings.replicas, sessions=self.router.sessions)
            if settings.replicas
            else None
        )
        if self.replicas is not None:
            self.metrics.registry.register(ReplicaCollector(self.replicas, PREFIX + "replica"))
        self.health = HealthServicer()
        self.metrics.add_router_collector(self._snapshot)
        if self.pipeline.queue is not None:  # the router queue's flow control, user-visible
            self.metrics.registry.register(
                QueueCollector(self.pipeline.queue, prefix=PREFIX + "queue")
            )
        self._grpc: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._background: set[asyncio.Task] = set()
        self.tokenizers = self.pipeline.tokenizers
        self.tokenizers.on_change = self._tokenizers_changed
        self.tokenizers.on_failure = lambda spec: self.metrics.tokenizer_load_failures.labels(
            spec
        ).inc()
        self._draining = False  # once draining, nothing turns readiness back on
        self._freeze: asyncio.TimerHandle | None = None
        self.certificates: CertificateSource | None = None  # the pair served, with tls
        self.grpc_port = settings.grpc_port
        self.health_port = settings.health_port
        self.metrics_port = settings.metrics_port

    # -- discovery listeners --
    def _added(self, record: WorkerRecord) -> None:
        config = record.config
        if not self.pipeline.add_engine(config):
            return
        self.view.added(record)
        if isinstance(self.picker, KvEndpointPicker):
            self.tokenizers.added(config.instance_id, config.tokenizer)
        self.load.add(record)
        if self.kv is not None:
            self.kv.add(record)
        self._update_readiness()

    def _removed(self, record: WorkerRecord) -> None:
        self.tokenizers.removed(record.instance_id)
        self.view.removed(record)
        self.load.remove(record)
        if self.kv is not None:
            self.kv.remove(record)
        self.pipeline.remove_engine(record.instance_id)
        self._update_readiness()

    def _update_readiness(self) -> None:
        # A vocabulary still loading would make the first requests wait seconds for it; a worker
        # whose tokenizer cannot be loaded serves nothing.
        held = self.tokenizers.held_workers()
        routable = any(worker not in held for worker in self.view.endpoints)
        ready = not self._draining and not self.tokenizers.loading and routable
        status = _SERVING if ready else _NOT_SERVING
        self._spawn(self.health.set(READINESS, status))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)  # keep a reference until it ran
        task.add_done_callback(self._background.discard)

    def _tokenizers_changed(self) -> None:
        self._update_readiness()
        self._schedule_freeze()  # a vocabulary is a large long-lived heap of its own

    def _schedule_freeze(self, delay: float = 1.0) -> None:
        """Freeze the heap once things settle (one freeze for a burst of discoveries)."""
        if not self.settings.freeze_heap or self._freeze is not None:
            return
        self._freeze = asyncio.get_running_loop().call_later(delay, self._freeze_heap)

    def _freeze_heap(self) -> None:
        self._freeze = None
        gc.collect()  # don't freeze garbage: only what is alive now
        gc.freeze()

    def _snapshot(self) -> dict:
        names = {r.instance_id: r.name for r in self.discovery.records.values()}
        slots: dict = {}
        workers: dict = {}
        for wid, state in self.router.workers().items():
            name = names.get(wid, str(wid))
            key = (state.role.value, state.ready)
            workers[key] = workers.get(key, 0) + 1
            for rank in range(state.dp_size):
                slots[(name, rank)] = {
                    "waiting": _at(state.waiting, rank),
                    "running": _at(state.running, rank),
                    "kv_usage": _at(state.kv_usage, rank),
                    "booked": self.router.active.load((wid, rank)).requests,
                }
        return {"slots": slots, "workers": workers, "index_blocks": _index_blocks(self.router)}

    # -- lifecycle --
    async def start(self) -> None:
        s = self.settings
        credentials = None
        if s.tls is not None:  # first: bad files raise TlsError before anything is bound
            credentials, self.certificates = server_credentials(s.tls)
        # No SO_REUSEPORT unless asked (`--processes`): a stray second process on our port must
        # fail to start, not take a share of the traffic.
        options = [("grpc.so_reuseport", 1 if s.reuse_port else 0)]
        self._grpc = grpc.aio.server(
            options=[*options, ("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, self._grpc)
        address = f"{s.host}:{s.grpc_port}"
        if credentials is None:
            self.grpc_port = self._grpc.add_insecure_port(address)
        else:
            self.grpc_port = self._grpc.add_secure_port(address, credentials)
        self._health_server = grpc.aio.server(options=options)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(f"{s.host}:{s.health_port}")
        await self.health.set(LIVENESS, _SERVING)
        await self.health.set(READINESS, _NOT_SERVING)
        await self.health.set(SERVICE_NAME, _SERVING)
        await self.health.set("", _SERVING)
        await self._grpc.start()
        await self._health_server.start()
        self.loop_lag.start()
        app = web.Application()
        app.router.add_get("/metrics", self._serve_metrics)
        self._metrics_runner = web.AppRunner(app, access_log=None)
        await self._metrics_runner.setup()
        site = web.TCPSite(self._metrics_runner, s.metrics_host or s.host, s.metrics_port)
        await site.start()
        self.metrics_port = self._metrics_runner.addresses[0][1]  # port 0 → the bound one
        if self.replicas is not None:  # peers' bookings before our first request
            await self.replicas.start()
        if s.pool_name:  # the pool's InferenceObjectives, as they change
            watch = objective_watch(s.pool_namespace, s.pool_name, s.kube_api)
            self._objective_watch = asyncio.get_running_loop().create_task(
                watch.run(self.objectives), name="inferenceobjective-watch"
            )
        self.discovery.add_listener(self._added, self._removed)
        await self.discovery.start()
        self._schedule_freeze(0.0)
        log.info(
            "endpoint picker listening",
            extra={
                "grpc": self.grpc_port,
                "tls": _describe_tls(s.tls),
                "health": self.health_port,
                "metrics": self.metrics_port,
            },
        )

    async def _serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    async def drain(self, grace: float | None = None) -> None:
        """Stop taking streams (readiness NOT_SERVING), let the ones in flight finish, stop."""
        grace = self.settings.drain_grace if grace is None else grace
        self._draining = True
        await self.health.set(READINESS, _NOT_SERVING)
        await self.health.set(SERVICE_NAME, _NOT_SERVING)
        if self._grpc is not None:
            await self._grpc.stop(grace)
        await self.stop()

    async def stop(self) -> None:
        if self._freeze is not None:
            self._freeze.cancel()
            self._freeze = None
        if self._grpc is not None:
            await self._grpc.stop(0)
            self._grpc = None
        await self.discovery.stop()
        await self.loop_lag.close()
        await self.tokenizers.close()
        if self._objective_watch is not None:
            await cancel_all([self._objective_watch])
            self._objective_watch = None
        self.pipeline.close()
        await self.load.close()
        if self.kv is not None:
            await self.kv.close()
        if self.replicas is not None:
            await self.replicas.close()
        if self._health_server is not None:
            await self._health_server.stop(0)
            self._health_server = None
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
            self._metrics_runner = None


def _describe_tls(tls: TlsSettings | None) -> str:
    if tls is None:
        return "off"
    if tls.cert_path is None:
        return "self-signed"
    return f"{tls.cert_path}" + (" (reloaded on change)" if tls.reload else "")


def _at(values: list, index: int):
    return values[index] if index < len(values) else None


def _index_blocks(router: Router) -> int:
    return router.index.total_blocks()
