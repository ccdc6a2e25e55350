"""Graph → processes: what `dynamograph up` runs for a DynamoGraph, as a pure function.

`plan_graph` turns a validated `DynamoGraph` (`protocol/graph.py`, the one schema) into the
list of local processes with their command lines, ports and readiness probes — the local
equivalent of the operator's pods. No I/O: ports come from an injected allocator and files to
write (the Envoy config) are returned as data, so the plan is unit-tested without starting
anything.

Mapping (the operator puts the same command lines into pod specs; docs/contracts.md):
- every `worker` (aggregated) and `decode` replica: an engine plus its frontend sidecar, whose
  port is the serving endpoint the EPP hands to Envoy;
- every `prefill` replica: an engine only (frontends reach it by instance id);
- the EPP in static discovery mode (`--worker ENGINE_URL[=FRONTEND]`), with the `epp` service's
  router settings (defaults when the graph has none): one per `replicas` of the service, each of
  `router.processes` processes, syncing their bookings when there are several;
- a real Envoy configured as a GAIE gateway in front of it (balancing over the EPP replicas):
  the OpenAI base URL.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from dynamograph.protocol.engine import Role
from dynamograph.protocol.graph import (
    ComponentType,
    DynamoGraph,
    FailureMode,
    RouterMode,
    RouterSpec,
    ServiceSpec,
)
from dynamograph.protocol.kv_curve import KV_CURVE_ENV, key_files
from dynamograph.protocol.launch import (
    ADMIN_TOKEN_ENV,
    admission_args,
    graph_router,
    router_config,
    standalone_frontend_args,
    standalone_router,
    uses_kv_events,
    worker_args,
)

from .envoy import EPP_STREAMS_PER_CONNECTION
from .spec import HOST, STAGE_ENGINES, STAGE_GATEWAY, STAGE_ROUTERS, Plan, Probe, ProcessSpec

_ROLES = {
    ComponentType.WORKER: Role.AGGREGATED,
    ComponentType.PREFILL: Role.PREFILL,
    ComponentType.DECODE: Role.DECODE,
}


# The Envoy part of the plan is `local.envoy.envoy_config`; injected so tests and the
# planner never depend on where the binary lives.
EnvoyConfigFn = Callable[..., dict]


def plan_graph(
    graph: DynamoGraph,
    run_dir: Path,
    take_port: Callable[[int], int],
    *,
    envoy_binary: str,
    envoy_config: EnvoyConfigFn,
    speedup: float | None = None,
    python: str = sys.executable,
    kv_curve: bool = False,
) -> Plan:
    """Every process of `graph` on 127.0.0.1, in start order.

    `take_port(n)` returns the first of n consecutive free ports. `speedup` overrides every mock
    engine's `engine.speedup` (tests and benchmarks run simulated time faster). `kv_curve` (or
    the graph's `spec.kvEvents.curve`, as the operator reads it) turns on the KV-event stream's
    CURVE option with a key folder new with the run (`<run_dir>/kv-curve`, protocol.kv_curve),
    named to every engine and subscriber.
    """
    spec = graph.spec
    kv_curve = kv_curve or spec.kv_events.curve
    cli = (python, "-m", "dynamograph.cli")
    notes: list[str] = []
    processes: list[ProcessSpec] = []
    epp_services = spec.services_of(ComponentType.EPP)
    router = graph_router(graph)
    # One admin token for the graph's engines: decode engines pull KV from prefill engines
    # with it (protocol.launch.ADMIN_TOKEN_ENV); new with every `up`.
    admin_token = secrets.token_urlsafe(24)
    curve_dir = run_dir / "kv-curve"

    for service_name, service in spec.services.items():
        kind = ComponentType(service.component_type)
        if kind not in _ROLES:
            continue
        for index in range(service.replicas):
            processes.extend(
                _engine_processes(
                    graph,
                    service_name,
                    service,
                    index,
                    take_port,
                    cli,
                    speedup=speedup,
                    enforce_disagg=router.enforce_disagg,
                    admin_token=admin_token,
                )
            )

    engines = [p for p in processes if p.kind == "engine"]
    prefill_urls = [p.engine_url for p in engines if p.role == Role.PREFILL]
    processes = [
        _with_prefill_workers(p, prefill_urls) if p.kind == "frontend" else p for p in processes
    ]
    if not any(p.serving for p in engines):
        notes.append("no worker or decode replicas: Envoy has nothing to route to")

    epp_count = 1
    for name, service in epp_services.items():
        if service.replicas == 0:
            notes.append(f"services.{name}: runs one EPP locally (replicas: 0)")
        epp_count = max(service.replicas, 1)
    if not epp_services:
        notes.append("no epp service in the graph: running one with the default router settings")
    if spec.engine_config is not None:
        notes.append(
            "engineConfig: not used locally (it describes engines the graph does not launch; "
            "the engines started here describe themselves at /v1/engine)"
        )
    router_files: dict[str, str] = {}
    for name, service in spec.services_of(ComponentType.FRONTEND).items():
        own = standalone_router(service)
        config_file = run_dir / f"{name}-router.yaml"
        if own.mode == RouterMode.KV:
            router_files[str(config_file)] = yaml.safe_dump(router_config(own))
        standalone = _standalone_frontends(
            graph.name, name, service, engines, take_port, cli, config_file
        )
        processes.extend(standalone)
        urls = ", ".join(f"http://{HOST}:{p.ports['http']}/v1" for p in standalone)
        notes.append(f"services.{name}: standalone frontend, OpenAI base URL {urls}")

    epps = _epp_processes(graph.name, router, engines, take_port, cli, run_dir, epp_count)
    processes.extend(epps)
    # more than one: Envoy balances its ext_proc streams over them (active-active replicas)
    replicas = [f"{HOST}:{e.ports['grpc']}" for e in epps[1:]]

    listen, admin = take_port(1), take_port(1)
    config_path = run_dir / "envoy.json"
    fail_open = spec.gateway.failure_mode == FailureMode.FAIL_OPEN
    # FailOpen: with the EPP unreachable Envoy may still pick, but only among the pool's
    # endpoints (the serving sidecars, as the InferencePool selects them in the cluster).
    pool = {"pool_endpoints": [str(p.serving) for p in engines if p.serving]} if fail_open else {}
    config = envoy_config(
        listen_port=listen,
        admin_port=admin,
        epp_address=f"{HOST}:{epps[0].ports['grpc']}",
        failure_mode_allow=fail_open,
        **pool,
        **({"epp_replicas": replicas} if replicas else {}),
        # several processes behind each EPP port: connections are what the kernel spreads
        **(
            {"epp_streams_per_connection": EPP_STREAMS_PER_CONNECTION}
            if router.processes > 1
            else {}
        ),
    )
    processes.append(
        ProcessSpec(
            name=f"{graph.name}-envoy",
            kind="envoy",
            argv=(
                envoy_binary,
                "-c",
                str(config_path),
                "--disable-hot-restart",
                "--log-level",
                "warning",
            ),
            stage=STAGE_GATEWAY,
            ready=Probe("http", f"http://{HOST}:{admin}/ready"),
            ports={"http": listen, "admin": admin},
        )
    )
    if kv_curve:  # Envoy aside, every process may subscribe or publish
        for process in processes:
            if process.kind != "envoy":
                process.env[KV_CURVE_ENV] = str(curve_dir)
    files = {
        **({str(curve_dir / name): text for name, text in key_files().items()} if kv_curve else {}),
        str(config_path): json.dumps(config, indent=1),
        # The operator's ConfigMap content, so the EPP is set up as it would be in the cluster.
        str(run_dir / "router.yaml"): yaml.safe_dump(router_config(router)),
        **router_files,  # the standalone frontends' own, as the operator's ConfigMaps
    }
    return Plan(
        graph=graph.name,
        model=spec.served_model_name,
        processes=processes,
        base_url=f"http://{HOST}:{listen}/v1",
        files=files,
        notes=notes,
    )


def _engine_processes(
    graph: DynamoGraph,
    service_name: str,
    service: ServiceSpec,
    index: int,
    take_port: Callable[[int], int],
    cli: tuple[str, ...],
    *,
    speedup: float | None,
    enforce_disagg: bool,
    admin_token: str,
) -> list[ProcessSpec]:
    kind = ComponentType(service.component_type)
    role = _ROLES[kind]
    name = f"{graph.name}-{service_name}-{index}"
    dp = service.data_parallel_size
    port, events, replay = take_port(1), take_port(dp), take_port(dp)
    engine_url = f"http://{HOST}:{port}"
    # The engine command line the operator's pods run too (protocol.launch), with the
    # local addresses in place of the pod's fixed ports.
    local = {
        "--host": HOST,
        "--port": str(port),
        "--kv-events-port": str(events),
        "--kv-replay-port": str(replay),
        "--name": name,
    }
    if speedup is not None:
        local["--speedup"] = str(speedup)
    argv = [*cli, *_set_flags(worker_args(graph, service), local)]
    env = {ADMIN_TOKEN_ENV: admin_token}
    env.update({e.name: e.value for e in service.envs if e.value is not None})
    processes = []
    serving = None
    if kind in (ComponentType.WORKER, ComponentType.DECODE):
        front_port = take_port(1)
        serving = f"{HOST}:{front_port}"
        processes.append(
            ProcessSpec(
                name=f"{name}-frontend",
                kind="frontend",
                argv=(
                    *cli,
                    "frontend",
                    "--host",
                    HOST,
                    "--port",
                    str(front_port),
                    "--engine-url",
                    engine_url,
                    *(["--enforce-disagg"] if enforce_disagg else []),
                ),
                stage=STAGE_ROUTERS,
                ready=Probe("http", f"http://{serving}/health"),
                ports={"http": front_port},
                service=service_name,
            )
        )
    engine = ProcessSpec(
        name=name,
        kind="engine",
        argv=tuple(argv),
        stage=STAGE_ENGINES,
        ready=Probe("http", f"{engine_url}/health"),
        ports={"engine": port, "kv-events": events, "kv-replay": replay},
        service=service_name,
        role=str(role),
        engine_url=engine_url,
        serving=serving,
        env=env,
    )
    return [engine, *processes]


def _set_flags(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with each flag's value replaced, or the flag appended when absent."""
    out = list(args)
    for flag, value in values.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def _with_prefill_workers(frontend: ProcessSpec, prefill_urls: list[str | None]) -> ProcessSpec:
    """A decode sidecar learns the prefill engines (ids → URLs) by static discovery."""
    if not prefill_urls:
        return frontend
    extra: list[str] = ["--discovery", "static"]
    for url in prefill_urls:
        extra += ["--worker", str(url)]
    return ProcessSpec(**{**frontend.__dict__, "argv": (*frontend.argv, *extra)})


def _standalone_frontends(
    graph: str,
    service_name: str,
    service: ServiceSpec,
    engines: list[ProcessSpec],
    take_port: Callable[[int], int],
    cli: tuple[str, ...],
    router_file: Path,
) -> list[ProcessSpec]:
    """A `frontend` service: frontends routing by themselves (kv or round-robin, by the
    service's own `router`, its config at `router_file`), no gateway."""
    router = standalone_router(service)
    routing = standalone_frontend_args(router, str(router_file))
    # kv mode, more than one: the replicas share their bookings (replica sync, static peers)
    sync = router.mode == RouterMode.KV and service.replicas > 1
    sync_ports = [take_port(1) for _ in range(service.replicas)] if sync else []
    out = []
    for index in range(service.replicas):
        port = take_port(1)
        argv = [*cli, "frontend", "--host", HOST, "--port", str(port), *routing]
        if sync:
            peers = ",".join(f"{HOST}:{p}" for p in sync_ports if p != sync_ports[index])
            argv += ["--replica-port", str(sync_ports[index]), "--replica-peers", peers]
        argv += ["--discovery", "static"]
        for engine in engines:
            argv += ["--worker", _worker_arg(engine)]
        out.append(
            ProcessSpec(
                name=f"{graph}-{service_name}-{index}",
                kind="frontend",
                argv=tuple(argv),
                stage=STAGE_ROUTERS,
                ready=Probe("http", f"http://{HOST}:{port}/health"),
                ports={"http": port},
                service=service_name,
            )
        )
    return out


def _worker_arg(engine: ProcessSpec) -> str:
    """Static discovery entry: ENGINE_URL, then `=SERVING` when a sidecar serves it."""
    return f"{engine.engine_url}={engine.serving}" if engine.serving else str(engine.engine_url)


def _epp_processes(
    graph: str,
    router: RouterSpec,
    engines: list[ProcessSpec],
    take_port: Callable[[int], int],
    cli: tuple[str, ...],
    run_dir: Path,
    count: int,
) -> list[ProcessSpec]:
    """The EPP, or `count` replicas of it (the epp service's `replicas`), each of
    `router.processes` processes; with more than one process in all they share their bookings
    (replica sync, docs/epp.md): replica i's process k publishes on its replica port + k."""
    processes = router.processes
    sync = count > 1 or processes > 1
    replica_ports = [take_port(processes) for _ in range(count)] if sync else []
    out = []
    for i in range(count):
        name = f"{graph}-epp" if count == 1 else f"{graph}-epp-{i}"
        epp = _epp_process(name, router, engines, take_port, cli, run_dir)
        if sync:
            peers = [
                f"{HOST}:{port + k}"
                for j, port in enumerate(replica_ports)
                if j != i
                for k in range(processes)
            ]
            flags = ["--processes", str(processes), "--replica-port", str(replica_ports[i])]
            flags += ["--replica-peers", ",".join(peers)] if peers else []
            epp = dataclasses.replace(
                epp,
                argv=(*epp.argv, *flags),
                ports={**epp.ports, "replica-sync": replica_ports[i]},
            )
        out.append(epp)
    return out


def _epp_process(
    name: str,
    router: RouterSpec,
    engines: list[ProcessSpec],
    take_port: Callable[[int], int],
    cli: tuple[str, ...],
    run_dir: Path,
) -> ProcessSpec:
    grpc, health = take_port(1), take_port(1)
    # with `--processes N` process i serves /metrics at the port + 1 + i: those are taken too
    metrics = take_port(1 + router.processes if router.processes > 1 else 1)
    argv = [
        *cli,
        "epp",
        "--host",
        HOST,
        "--grpc-port",
        str(grpc),
        "--health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--discovery",
        "static",
    ]
    for engine in engines:
        argv += ["--worker", _worker_arg(engine)]
    argv += [
        "--overlap-weight",
        str(router.overlap_weight),
        "--temperature",
        str(router.temperature),
    ]
    argv += ["--kv-events", "on" if uses_kv_events(router) else "off"]
    if router.enforce_disagg:
        argv.append("--enforce-disagg")
    argv += admission_args(router)
    argv += ["--config", str(run_dir / "router.yaml")]
    return ProcessSpec(
        name=name,
        kind="epp",
        argv=tuple(argv),
        stage=STAGE_ROUTERS,
        ready=Probe("grpc", f"{HOST}:{health}", "readiness"),
        ports={"grpc": grpc, "grpc-health": health, "metrics": metrics},
    )
