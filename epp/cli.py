"""`dynamograph epp`: the endpoint picker (Envoy ext_proc, KV-aware). See docs/epp.md.

Flags follow the cross-component contract; `--config` is a YAML `RouterConfig` that single
flags override. SIGTERM/SIGINT drain: readiness goes NOT_SERVING and streams in flight finish.
TLS flags carry GAIE's EPP names (`--secure-serving`, `--cert-path`, `--enable-cert-reload`);
unlike GAIE, secure serving is off unless asked for (or implied by `--cert-path`).
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from dynamograph.protocol.kv_curve import add_kv_curve_argument, kv_curve_from_args
from dynamograph.protocol.launch import EPP_REPLICA_PORT
from dynamograph.protocol.router_config import RouterConfig
from dynamograph.router.admission import add_admission_arguments, admission_limits
from dynamograph.router.discovery import add_discovery_arguments, source_from_args
from dynamograph.router.kv_events import INGEST_INTERVAL_S
from dynamograph.router.replicas import ReplicaSettings, add_replica_arguments, replica_settings

from .extproc import DEFAULT_MAX_BODY_BYTES
from .objectives import parse_objective_flag
from .processes import CHILD_METRICS_HOST, child_metrics_port, process_index, run_processes
from .server import Epp, EppSettings
from .tls import TlsError, TlsSettings, load_key_pair

log = logging.getLogger(__name__)

ENV_PREFIX = "DYNAMOGRAPH_EPP"


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_bool(text: str) -> bool:
    """Go's flag syntax GAIE users write: `--secure-serving=false`, `--enable-cert-reload`."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host",
        default=os.environ.get("DYNAMOGRAPH_EPP_HOST", "0.0.0.0"),
        help="address for every port (default 0.0.0.0)",
    )
    parser.add_argument(
        "--grpc-port",
        type=int,
        default=_env_int("DYNAMOGRAPH_EPP_GRPC_PORT", 9002),
        help="ext_proc gRPC port Envoy connects to (default 9002)",
    )
    parser.add_argument(
        "--health-port",
        "--grpc-health-port",  # GAIE's name
        type=int,
        default=_env_int("DYNAMOGRAPH_EPP_HEALTH_PORT", 9003),
        help="gRPC health port: liveness, readiness, the ext_proc service (default 9003)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("DYNAMOGRAPH_EPP_METRICS_PORT", 9090),
        help="Prometheus /metrics port (default 9090)",
    )
    tls = parser.add_argument_group("TLS on the ext_proc port (GAIE EPP flag names)")
    tls.add_argument(
        "--secure-serving",
        type=parse_bool,
        nargs="?",
        const=True,
        # A string default goes through parse_bool too: a bad env value is a usage error.
        default=os.environ.get("DYNAMOGRAPH_EPP_SECURE_SERVING") or None,
        metavar="BOOL",
        help="serve ext_proc over TLS: the --cert-path pair, else a self-signed certificate made "
        "at start (default: off, on when --cert-path is given; GAIE's default is on)",
    )
    tls.add_argument(
        "--cert-path",
        default=os.environ.get("DYNAMOGRAPH_EPP_CERT_PATH") or None,
        metavar="DIR",
        help="folder holding tls.crt and tls.key (a mounted kubernetes.io/tls Secret)",
    )
    tls.add_argument(
        "--enable-cert-reload",
        type=parse_bool,
        nargs="?",
        const=True,
        default=os.environ.get("DYNAMOGRAPH_EPP_CERT_RELOAD") or "false",
        metavar="BOOL",
        help="take up new files in --cert-path (cert-manager rotation) for new connections, "
        "without a restart",
    )
    add_discovery_arguments(parser)
    add_kv_curve_argument(parser)
    parser.add_argument(
        "--config",
        default=os.environ.get("DYNAMOGRAPH_EPP_CONFIG"),
        help="YAML router config (RouterConfig fields); the flags below override it",
    )
    parser.add_argument(
        "--overlap-weight", type=float, help="weight of prefill (uncached) blocks in the cost"
    )
    parser.add_argument(
        "--temperature", type=float, help="0 = lowest cost wins; > 0 = softmax sampling"
    )
    parser.add_argument(
        "--enforce-disagg",
        action="store_true",
        default=None,
        help="with prefill workers, never fall back to aggregated serving (503 instead)",
    )
    parser.add_argument(
        "--kv-events",
        choices=["on", "off"],
        # No default here: when neither the flag nor the environment says, --config decides.
        default=os.environ.get("DYNAMOGRAPH_EPP_KV_EVENTS") or None,
        help="index workers' KV events (on), or approximate from routed requests (off); "
        "default: the config's use_kv_events, else on",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=_env_int("DYNAMOGRAPH_EPP_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES),
        help=f"largest request body, else 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    add_admission_arguments(parser, who="the EPP", env_prefix=ENV_PREFIX)
    parser.add_argument(
        "--kv-ingest-interval",
        type=float,
        default=_env_float("DYNAMOGRAPH_EPP_KV_INGEST_INTERVAL", INGEST_INTERVAL_S),
        help="seconds between background reads of the KV-event sockets while batches keep "
        "coming and no request reads them (each routing decision reads what is queued first; "
        "a batch after a quiet spell is read at once): longer costs less CPU per batch, and "
        "without requests a batch waits up to that long; 0: every batch as it arrives "
        f"(default {INGEST_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--endpoint-picker",
        choices=["kv", "random"],
        default="kv",
        help="kv: KV-aware routing (default); random: any ready endpoint, body unread "
        "(the pure-protocol floor, for measurement)",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=_env_float("DYNAMOGRAPH_EPP_SCRAPE_INTERVAL", 0.5),
        help="seconds between /metrics scrapes of each worker (default 0.5)",
    )
    objectives = parser.add_argument_group(
        "GAIE InferenceObjective priorities: the x-gateway-inference-objective header names one"
    )
    objectives.add_argument(
        "--pool-name",
        default=os.environ.get("DYNAMOGRAPH_EPP_POOL_NAME") or None,
        help="the InferencePool this EPP serves: watch the InferenceObjectives whose "
        "spec.poolRef names it (Kubernetes API; none: no watch)",
    )
    objectives.add_argument(
        "--pool-namespace",
        help="namespace of the pool and its objectives (default: --namespace)",
    )
    objectives.add_argument(
        "--objective",
        action="append",
        default=[],
        metavar="NAME=PRIORITY",
        help="a static objective and its priority (repeat; runs without a cluster); a watched "
        "objective of the same name wins",
    )
    replicas = add_replica_arguments(
        parser, who="EPP", env_prefix=ENV_PREFIX, port=EPP_REPLICA_PORT
    )
    replicas.add_argument(
        "--processes",
        type=int,
        default=_env_int("DYNAMOGRAPH_EPP_PROCESSES", 1),
        help="EPP processes in this pod/host, all serving the gRPC and health ports "
        "(SO_REUSEPORT), sharing their bookings; --metrics-port shows them all, labelled "
        "process=i (default 1)",
    )
    parser.add_argument(
        "--drain-grace",
        type=float,
        default=float(os.environ.get("DYNAMOGRAPH_EPP_DRAIN_GRACE", 30)),
        help="seconds streams in flight may take to finish on SIGTERM (default 30)",
    )


def tls_from_args(args: argparse.Namespace) -> TlsSettings | None:
    """The TLS choice of the flags; ValueError for combinations that cannot mean anything."""
    cert_path = Path(args.cert_path) if args.cert_path else None
    secure = args.secure_serving if args.secure_serving is not None else cert_path is not None
    if not secure:
        if cert_path is not None:
            raise ValueError("--cert-path needs secure serving; drop --secure-serving=false")
        if args.enable_cert_reload:
            raise ValueError("--enable-cert-reload needs --cert-path (and secure serving)")
        return None
    if args.enable_cert_reload and cert_path is None:
        raise ValueError(
            "--enable-cert-reload needs --cert-path: a self-signed certificate is not reloaded"
        )
    if cert_path is not None:
        try:
            load_key_pair(cert_path)  # fail at start with the file's name, not on a connection
        except TlsError as exc:
            raise ValueError(str(exc)) from None
    return TlsSettings(cert_path=cert_path, reload=args.enable_cert_reload)


def settings_from_args(args: argparse.Namespace) -> EppSettings:
    if not args.kv_ingest_interval >= 0:  # NaN too
        raise ValueError(
            f"--kv-ingest-interval must be a number of seconds ≥ 0, not {args.kv_ingest_interval}"
        )
    admission = admission_limits(args, env_prefix=ENV_PREFIX)
    use_events = None if args.kv_events is None else args.kv_events == "on"
    router = RouterConfig.load(
        args.config,
        temperature=args.temperature,
        enforce_disagg=args.enforce_disagg,
        use_kv_events=use_events,
    )
    if args.overlap_weight is not None:
        router = router.with_overlap_weight(args.overlap_weight)
    index = process_index()
    child = index is not None and args.processes > 1
    metrics_port = args.metrics_port
    if index is not None and child and metrics_port:  # the parent serves the merged page
        metrics_port = child_metrics_port(metrics_port, index)
    return EppSettings(
        host=args.host,
        grpc_port=args.grpc_port,
        health_port=args.health_port,
        metrics_port=metrics_port,
        metrics_host=CHILD_METRICS_HOST if child else None,
        router=router,
        kv_events=router.use_kv_events,
        kv_curve=kv_curve_from_args(args),
        endpoint_picker=args.endpoint_picker,
        max_body_bytes=args.max_body_bytes,
        admission=admission,
        scrape_interval=args.scrape_interval,
        kv_ingest_interval=args.kv_ingest_interval,
        drain_grace=args.drain_grace,
        tls=tls_from_args(args),
        freeze_heap=True,  # this process is the EPP's own
        replicas=_replicas(args, index or 0),
        reuse_port=args.processes > 1,
        objectives=dict(parse_objective_flag(o) for o in args.objective),
        pool_name=args.pool_name,
        pool_namespace=args.pool_namespace or args.namespace,
    )


def _replicas(args: argparse.Namespace, index: int) -> ReplicaSettings | None:
    if args.processes < 1:
        raise ValueError("--processes must be at least 1")
    return replica_settings(args, processes=args.processes, index=index)


async def serve(epp: Epp) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await epp.start()
    try:
        await stop.wait()
        log.info("draining", extra={"grace_s": epp.settings.drain_grace})
    finally:
        await epp.drain()


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        source = source_from_args(args)
    except ValueError as exc:
        print(f"dynamograph epp: {exc}", file=sys.stderr)
        return 2
    if args.processes > 1 and process_index() is None:
        return run_processes(args.processes, args.host, args.metrics_port)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(Epp(settings, source)))
    return 0
