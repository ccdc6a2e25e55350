"""How a DynamoGraph's services are launched: the contract ports and the command-line builders.

This module owns the mapping from graph fields to what a component is started with, shared by
the two launchers: the operator puts these command lines and files into pod specs, and
`dynamograph up` runs them as local processes (with local addresses in place of the ports).
One mapping, so a graph behaves the same in both places (docs/contracts.md):

- `worker_args`: the `dynamograph worker` command line of an engine service;
- `graph_router`: the routing policy of a graph (its epp service's `router`, else defaults);
- `router_config`: the router's `--config` file (a RouterConfig) from that policy, and
  `uses_kv_events`: whether the policy indexes the engines' KV events;
- `standalone_router` and `standalone_frontend_args`: a standalone frontend's own policy (its
  `router` section) and its routing flags, the same config file in kv mode;
- `admission_args`: what a router process admits (the EPP's and a kv-mode frontend's
  `--max-pending-picks`, `--max-loop-lag`);
- `engine_config_file`: the EPP's `--engine-config` file (the graph's `spec.engineConfig`), where
  it is mounted and the flag that names it (`engine_config_args`); `bound_kv_events`: the port
  the EPP opens to engines whose KV-event publishers dial it.
"""

import re
from typing import Any

import yaml

from .graph import ComponentType, DynamoGraph, RouterMode, RouterSpec, ServiceSpec
from .kv_curve import KV_CURVE_ENV
from .router_config import default_picker, ttft_scorers

# Contract ports (docs/contracts.md).
HTTP_PORT = 8080  # frontend; the InferencePool targetPort
ENGINE_PORT = 8000  # engine HTTP API, also its /metrics
KV_EVENTS_PORT = 5557  # DP rank 0's; its replay port: `kv_replay_port`
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_REPLICA_PORT = 9004  # replica sync: process i of an EPP pod publishes its bookings on + i
FRONTEND_REPLICA_PORT = 9005  # a kv-mode standalone frontend's replica sync

# The environment variable that carries a graph's worker admin token (`dynamograph worker
# --admin-token`): every engine of a graph gets the same one, since a decode engine pulls KV
# from a prefill engine's /v1/kv_transfer/pull with it. An environment variable rather than a
# flag so that it comes from a Secret and stays out of command lines (docs/contracts.md).
ADMIN_TOKEN_ENV = "DYNAMOGRAPH_ADMIN_TOKEN"
ADMIN_TOKEN_KEY = "token"  # its key in the graph's Secret (`admin_token_secret`)


def admin_token_secret(graph: DynamoGraph) -> str:
    """The Secret (in the graph's namespace) that holds the graph's admin token under
    ADMIN_TOKEN_KEY: created with a random value by the operator, read by every engine."""
    return f"{graph.name}-admin-token"


def admin_token_env(graph: DynamoGraph) -> dict[str, Any]:
    """The engine container's env entry for the admin token: from the graph's Secret."""
    ref = {"name": admin_token_secret(graph), "key": ADMIN_TOKEN_KEY}
    return {"name": ADMIN_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}}


# The KV-event stream's CURVE option (protocol/kv_curve.py, off by default): a graph's key folder
# is the Secret `<graph>-kv-curve` (the files `dynamograph kv-curve-keys` writes), mounted
# read-only at KV_CURVE_DIR in every engine, EPP and kv-mode frontend container and named to
# them by $DYNAMOGRAPH_KV_CURVE_DIR (docs/security.md).
KV_CURVE_DIR = "/etc/dynamograph/kv-curve"
KV_CURVE_VOLUME = "kv-curve"


def kv_curve_secret(graph: DynamoGraph) -> str:
    """The Secret (in the graph's namespace) that holds the graph's KV-event CURVE keys."""
    return f"{graph.name}-kv-curve"


def kv_curve_mount(graph: DynamoGraph) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(pod volume, container volumeMount, container env entry) that give a container the
    graph's KV-event CURVE keys."""
    volume = {"name": KV_CURVE_VOLUME, "secret": {"secretName": kv_curve_secret(graph)}}
    mount = {"name": KV_CURVE_VOLUME, "mountPath": KV_CURVE_DIR, "readOnly": True}
    return volume, mount, {"name": KV_CURVE_ENV, "value": KV_CURVE_DIR}


_ROLES = {
    ComponentType.WORKER: "aggregated",
    ComponentType.PREFILL: "prefill",
    ComponentType.DECODE: "decode",
}


def kv_replay_port(data_parallel_size: int, events_port: int = KV_EVENTS_PORT) -> int:
    """Rank r publishes on events_port + r and replays on the replay port + r, so the replay
    ports start after the last events port: 5558 for one rank on the contract's 5557, 5559 for
    two. The one rule for the operator and `dynamograph worker`'s default; an events port of 0
    (free ports, the mock's) leaves the replay port free too."""
    return 0 if events_port == 0 else events_port + max(data_parallel_size, 1)


def worker_args(graph: DynamoGraph, spec: ServiceSpec) -> list[str]:
    model = graph.spec.model
    args = [
        "worker",
        "--engine",
        str(graph.spec.backend),
        "--model",
        model.name,
        "--served-model-name",
        graph.spec.served_model_name,
        "--role",
        _ROLES[ComponentType(spec.component_type)],
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--kv-events-port",
        str(KV_EVENTS_PORT),
        "--kv-replay-port",
        str(kv_replay_port(spec.data_parallel_size)),
        "--block-size",
        str(graph.spec.kv_block_size),
        "--data-parallel-size",
        str(spec.data_parallel_size),
    ]
    if model.tokenizer:
        args += ["--tokenizer", model.tokenizer]
    for flag, size in (
        ("--tensor-parallel-size", spec.tensor_parallel_size),
        ("--pipeline-parallel-size", spec.pipeline_parallel_size),
    ):
        if size != 1:  # vllm only (the graph refuses them for the mock)
            args += [flag, str(size)]
    engine = spec.engine
    if engine is not None:
        for flag, value in (
            ("--num-gpu-blocks", engine.num_gpu_blocks),
            ("--max-num-seqs", engine.max_num_seqs),
            ("--max-num-batched-tokens", engine.max_num_batched_tokens),
            ("--context-length", engine.context_length),
            ("--speedup", engine.speedup),
            ("--seed", engine.seed),
        ):
            if value is not None:
                args += [flag, str(value)]
        # `=`: an argument that starts with `-` would otherwise read as a flag of our own
        args += [f"--vllm-arg={argument}" for argument in engine.extra_args]
    return args


def graph_router(graph: DynamoGraph) -> RouterSpec:
    """The graph's routing policy: the EPP's router section, else the defaults."""
    for spec in graph.spec.services_of(ComponentType.EPP).values():
        if spec.router is not None:
            return spec.router
    return RouterSpec()


def uses_kv_events(router: RouterSpec) -> bool:
    """`approx` is KV routing without KV events: routed prefixes count as cached for a while."""
    return router.kv_events and router.mode != RouterMode.APPROX


def router_config(router: RouterSpec) -> dict[str, Any]:
    """The EPP's `--config` file: the router core's RouterConfig fields (protocol/router_config.py).

    `router.config` entries are passed through verbatim (e.g. approx_ttl_s, session_ttl_s). The
    operator checks the result against RouterConfig when a graph is applied; the EPP checks it
    again at start-up.
    """
    config: dict[str, Any] = {
        "picker": (
            default_picker().model_dump()
            if router.mode in (RouterMode.KV, RouterMode.APPROX)
            else {"type": str(router.mode)}
        ),
        "scorers": [ref.model_dump() for ref in ttft_scorers(router.overlap_weight)],
        "temperature": router.temperature,
        "use_kv_events": uses_kv_events(router),
        "enforce_disagg": router.enforce_disagg,
    }
    if router.busy_threshold is not None:
        config["busy_threshold"] = router.busy_threshold
    config.update(router.config)
    return config


def standalone_router(spec: ServiceSpec) -> RouterSpec:
    """A standalone frontend's routing policy: its own `router` section, else the defaults
    (kv). Not the EPP's: a frontend service routes by itself."""
    return spec.router or RouterSpec()


def admission_args(router: RouterSpec) -> list[str]:
    """What a router process (the EPP, a kv-mode frontend) admits, as flags: those the section
    sets (the rest keep the process's defaults, router.admission)."""
    args = []
    if router.max_pending_picks is not None:
        args += ["--max-pending-picks", str(router.max_pending_picks)]
    if router.max_loop_lag_seconds is not None:
        args += ["--max-loop-lag", f"{router.max_loop_lag_seconds:g}"]
    return args


def standalone_frontend_args(router: RouterSpec, config_path: str) -> list[str]:
    """A standalone frontend's routing flags: its mode and, in kv mode, the router config file
    (`router_config(router)`, written at `config_path`), KV events on or off and its admission
    limits, as the EPP gets them; `--enforce-disagg` in either mode."""
    args = ["--mode", str(router.mode)]
    if router.mode == RouterMode.KV:
        args += ["--router-config", config_path]
        args += ["--kv-events", "on" if uses_kv_events(router) else "off"]
        args += admission_args(router)
    if router.enforce_disagg:
        args.append("--enforce-disagg")
    return args


# A graph's `spec.engineConfig` (engines that serve no /v1/engine, docs/epp.md): the operator
# writes it into the ConfigMap `<graph>-engine-config` under ENGINE_CONFIG_FILE, mounts that
# read-only at ENGINE_CONFIG_DIR in the EPP container and names the file with --engine-config.
ENGINE_CONFIG_DIR = "/etc/dynamograph/engine"
ENGINE_CONFIG_FILE = "engine.yaml"
ENGINE_CONFIG_VOLUME = "engine-config"


def engine_config_name(graph: DynamoGraph) -> str:
    """The ConfigMap (in the graph's namespace) holding the graph's engine document."""
    return f"{graph.name}-engine-config"


def engine_config_file(graph: DynamoGraph) -> str | None:
    """The EPP's `--engine-config` file, YAML; None when the graph has no `engineConfig`."""
    document = graph.spec.engine_document()
    return None if document is None else yaml.safe_dump(document, sort_keys=True)


# A bound KV-event endpoint the EPP can serve to engines in other pods: every interface, a port.
_BOUND_ENDPOINT = re.compile(r"^tcp://(\*|0\.0\.0\.0):([0-9]{1,5})$")


def bound_kv_events(graph: DynamoGraph) -> tuple[str, int | None] | None:
    """With `engineConfig.kv_events.bind` (llm-d's layout: the engines' publishers dial the EPP,
    which binds a SUB), (endpoint, port): the port the EPP pod opens to them, None when the
    endpoint is not `tcp://*:<port>`, which engines in other pods cannot reach. Else None."""
    document = graph.spec.engine_document() or {}
    events = document.get("kv_events") or {}
    if not events.get("bind"):
        return None
    endpoint = str(events.get("endpoint", ""))
    match = _BOUND_ENDPOINT.match(endpoint)
    return endpoint, int(match.group(2)) if match else None


def engine_config_args(path: str = f"{ENGINE_CONFIG_DIR}/{ENGINE_CONFIG_FILE}") -> list[str]:
    """The EPP's (or a frontend's) flag naming the engine document at `path`."""
    return ["--engine-config", path]
