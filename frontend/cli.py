"""`dynamograph frontend`: the direct-routing OpenAI frontend (the worker pods' sidecar).

Flags follow the cross-component contract; discovery flags are the EPP's own (`epp.discovery`).
"""

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys

from dynamograph.protocol.kv_curve import add_kv_curve_argument, kv_curve_from_args
from dynamograph.protocol.launch import FRONTEND_REPLICA_PORT
from dynamograph.router.admission import (
    add_admission_arguments,
    admission_given,
    admission_limits,
)
from dynamograph.router.discovery import Discovery, add_discovery_arguments, source_from_args
from dynamograph.router.replicas import add_replica_arguments, replica_settings

from .http_server import BODY_TIMEOUT_S, HEAD_TIMEOUT_S
from .routing import Mode
from .server import DEFAULT_MAX_BODY_BYTES, Frontend, FrontendConfig

log = logging.getLogger(__name__)

ENV_PREFIX = "DYNAMOGRAPH_FRONTEND"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8080, help="HTTP port (default 8080)")
    parser.add_argument(
        "--engine-url",
        default=os.environ.get("DYNAMOGRAPH_ENGINE_URL"),
        help="this pod's own engine, e.g. http://127.0.0.1:8000; its /v1/engine gives the "
        "frontend its instance id (optional for a standalone kv/round-robin frontend)",
    )
    parser.add_argument(
        "--mode",
        choices=[m.value for m in Mode],
        default=Mode.DIRECT.value,
        help="direct: forward where the endpoint picker's headers say (default); kv: pick with "
        "the KV-aware router core (no gateway); round-robin: cycle through the workers",
    )
    add_discovery_arguments(parser)
    add_kv_curve_argument(parser)
    parser.add_argument(
        "--enforce-disagg",
        action="store_true",
        help="refuse requests without a prefill worker (x-prefill-instance-id)",
    )
    parser.add_argument(
        "--disagg-fallback",
        action="store_true",
        help="when the prefill leg fails, serve the request aggregated on the decode worker",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body accepted, else 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="seconds an engine may stay silent before the request fails with 504 (default 600)",
    )
    parser.add_argument(
        "--first-byte-timeout",
        type=float,
        default=300.0,
        help="seconds an engine has to send its response head (a streamed answer's start, all "
        "of a non-streamed one) before the request fails with 504; in kv and round-robin modes "
        "a request the client has had nothing of then goes to another worker once (default 300)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to open a connection to an engine (default 5)",
    )
    parser.add_argument(
        "--head-timeout",
        type=float,
        default=HEAD_TIMEOUT_S,
        help="seconds a client has to send a request head, from its first byte, else 408 "
        f"(default {HEAD_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help="seconds a client has to send a request body, from the end of its head, else 408 "
        f"(default {BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--kv-events",
        choices=["on", "off"],
        help="kv mode: follow the workers' KV events (on) or assume routed prefixes are cached "
        "for a while (off); default: --router-config's use_kv_events, else on",
    )
    parser.add_argument(
        "--router-config",
        metavar="FILE",
        help="kv mode: YAML of the router core's RouterConfig (as the EPP's --config): "
        "overlap_weight, temperature, busy_threshold, …",
    )
    add_admission_arguments(parser, who="a kv-mode frontend", env_prefix=ENV_PREFIX)
    add_replica_arguments(
        parser,
        who="kv-mode frontend",
        env_prefix=ENV_PREFIX,
        port=FRONTEND_REPLICA_PORT,
    )


def config_from_args(args: argparse.Namespace) -> FrontendConfig:
    mode = Mode(args.mode)
    if args.engine_url is None and mode is Mode.DIRECT:
        raise ValueError("--engine-url is required in direct mode (the pod's own engine)")
    router = None
    if args.router_config is not None or args.kv_events is not None:
        from dynamograph.protocol.router_config import RouterConfig

        # A flag overrides the file only when given.
        kv_events = None if args.kv_events is None else args.kv_events == "on"
        router = RouterConfig.load(args.router_config, use_kv_events=kv_events)
    replicas = replica_settings(args)
    if replicas is not None and mode is not Mode.KV:
        raise ValueError(
            f"--replica-peers and --replica-selector share kv mode's bookings; --mode is {mode}"
        )
    if admission_given(args) and mode is not Mode.KV:
        raise ValueError(
            f"--max-pending-picks and --max-loop-lag bound kv mode's routing; --mode is {mode}"
        )
    return FrontendConfig(
        engine_url=args.engine_url,
        mode=mode,
        enforce_disagg=args.enforce_disagg,
        disagg_fallback=args.disagg_fallback,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        connect_timeout=args.connect_timeout,
        first_byte_timeout=args.first_byte_timeout,
        head_timeout=args.head_timeout,
        body_timeout=args.body_timeout,
        kv_events=router is None or router.use_kv_events,
        kv_curve=kv_curve_from_args(args),
        router=router,
        replicas=replicas,
        admission=admission_limits(args, env_prefix=ENV_PREFIX),
    )


def graph_from_args(args: argparse.Namespace) -> Discovery | None:
    """The graph's workers; a static frontend with no --worker knows only its own engine."""
    if args.discovery == "static" and not args.worker and not args.workers_file:
        if args.engine_url is None:
            raise ValueError(
                f"--mode {args.mode} without --engine-url needs workers: --worker ENGINE_URL, "
                "--workers-file FILE or --discovery kubernetes"
            )
        return None
    return Discovery(source_from_args(args))


async def serve(args: argparse.Namespace) -> None:
    frontend = Frontend(config_from_args(args), graph_from_args(args))
    url = await frontend.start(args.host, args.port)
    # Everything allocated so far lives as long as the process: move it out of the cyclic
    # collector's reach. Unfrozen, every older-generation pass walked these ~100k objects,
    # about a quarter of the hop's instructions (callgrind: ~105k of 428k per request).
    gc.collect()
    gc.freeze()
    log.info("frontend listening", extra={"url": url, "mode": args.mode})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await frontend.stop()


def run(args: argparse.Namespace) -> int:
    try:
        config_from_args(args)
        graph_from_args(args)
    except ValueError as exc:
        print(f"dynamograph frontend: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(serve(args))
    return 0
