"""Spec -> desired Kubernetes objects: pure functions, no I/O (docs/operator.md).

For one DynamoGraph this builds, in creation order: the discovery ServiceAccount, Role and
RoleBinding (pods get/list/watch, used by the EPP and by the frontends; inferenceobjectives
get/list/watch, used by the EPP), the EPP's router
ConfigMap (and, with `spec.engineConfig`, its engine-document ConfigMap), the EPP and frontend Services, the NetworkPolicies of the engine and EPP pods, a
Deployment per service with a PodDisruptionBudget for the EPP and every service of more than
one replica, the InferencePool over the decode/aggregated worker pods, an HTTPRoute when the
gateway names a parentRef, and a PodMonitor (applied only where its CRD is served). Apart from
them, the operator creates once (never reads or patches) the Secrets `admin_token_secret_object`
(the engines' admin token) and, with `spec.kvEvents.curve`, `kv_curve_secret_object` (the
KV-event stream's CURVE keys, mounted into every engine, the EPP and kv-mode frontends). Every
object carries the graph's labels and a controller ownerReference, so deleting the graph
deletes them.

The pods run the command lines of the contract (docs/contracts.md): `dynamograph worker` with
the frontend sidecar in engine pods that serve requests, `dynamograph epp`, and standalone
`dynamograph frontend`. The EPP serves the gateway's ext_proc connection with TLS unless its
service says `tls.mode: Plaintext` (a self-signed certificate, or a mounted TLS Secret). Errors the CRD schema cannot see (an unknown field in extraPodSpec)
raise `GraphError` naming the field.
"""

import copy
import functools
import hashlib
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from dynamograph.protocol.graph import (
    API_VERSION,
    ENGINE_TYPES,
    GPU_PRODUCT_LABEL,
    KIND,
    MODEL_CACHE_DIR,
    SERVING_TYPES,
    Backend,
    ComponentType,
    DynamoGraph,
    EppTlsMode,
    EppTlsSpec,
    GraphError,
    RouterMode,
    RouterSpec,
    ServiceSpec,
)
from dynamograph.protocol.launch import (
    ADMIN_TOKEN_KEY,
    ENGINE_CONFIG_DIR,
    ENGINE_CONFIG_FILE,
    ENGINE_CONFIG_VOLUME,
    ENGINE_PORT,
    EPP_GRPC_PORT,
    EPP_HEALTH_PORT,
    EPP_METRICS_PORT,
    EPP_REPLICA_PORT,
    FRONTEND_REPLICA_PORT,
    HTTP_PORT,
    KV_EVENTS_PORT,
    admin_token_env,
    admin_token_secret,
    admission_args,
    bound_kv_events,
    engine_config_args,
    engine_config_file,
    engine_config_name,
    graph_router,
    kv_curve_mount,
    kv_curve_secret,
    kv_replay_port,
    router_config,
    standalone_frontend_args,
    standalone_router,
    uses_kv_events,
    worker_args,
)
from dynamograph.protocol.router_config import RouterConfig

from .config import OperatorConfig

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_GRAPH = "dynamograph.io/graph"
LABEL_SERVICE = "dynamograph.io/service"
LABEL_COMPONENT = "dynamograph.io/component-type"
# On decode/aggregated worker pods: what the InferencePool and the frontend Service select.
LABEL_SERVING = "dynamograph.io/serving"
MANAGED_BY = "dynamograph-operator"

ROUTER_CONFIG_DIR = "/etc/dynamograph/router"
ROUTER_CONFIG_FILE = "router.yaml"
# On the EPP's pod template with `spec.engineConfig`: the engine document's SHA-256, so that a
# changed document rolls the EPP (it reads the file once, at start).
ENGINE_CONFIG_CHECKSUM = "dynamograph.io/engine-config-sha256"
# On the EPP's pod template: the router config document's SHA-256, for the same reason (a changed
# `router` section, `router.config` included, would otherwise wait for the next restart).
ROUTER_CONFIG_CHECKSUM = "dynamograph.io/router-config-sha256"
# Where the EPP's TLS Secret is mounted (GAIE's chart mounts its certificate the same way:
# a folder with tls.crt and tls.key given to --cert-path).
EPP_TLS_DIR = "/etc/dynamograph/epp-tls"
EPP_TLS_VOLUME = "epp-tls"
POOL_GROUP = "inference.networking.k8s.io"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"  # GAIE's InferenceObjective (v1alpha2)
MONITORING_API_VERSION = "monitoring.coreos.com/v1"

# The EPP's rollout drains streams: on deletion its pod first keeps serving for the preStop
# sleep (gateways learn from the EndpointSlice that it is going and open no new streams there),
# then SIGTERM turns readiness off and the streams in flight get `--drain-grace` to finish;
# the kubelet kills it at terminationGracePeriodSeconds. `extraPodSpec`'s
# terminationGracePeriodSeconds sets the whole budget; sleep and drain grace follow from it.
EPP_TERMINATION_GRACE_SECONDS = 130
EPP_PRESTOP_SECONDS = 10
EPP_STOP_MARGIN_SECONDS = 5  # after the drain: closing the index and the servers
# Defaults for the containers without GPUs, when the service's resources say nothing. No CPU
# limits: CFS throttling shows up as tail latency on the routing path; memory is limited.
EPP_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
FRONTEND_RESOURCES = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
SIDECAR_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


@functools.cache
def _pod_spec_fields() -> frozenset[str]:
    """PodSpec's field names, from the Kubernetes client's model (imported only when needed:
    the client package is slow to import)."""
    from kubernetes.client import V1PodSpec

    return frozenset(V1PodSpec.attribute_map.values())


@dataclass(frozen=True)
class Owner:
    """The live graph object the generated objects belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


# ---- names -------------------------------------------------------------------------------


def deployment_name(graph: str, service: str) -> str:
    return f"{graph}-{service}"


def epp_service_name(graph: str) -> str:
    return f"{graph}-epp"


def frontend_service_name(graph: str) -> str:
    return f"{graph}-frontend"


def discovery_name(graph: str) -> str:
    """ServiceAccount, Role and RoleBinding that let pods watch the graph's pods."""
    return f"{graph}-discovery"


def router_config_name(graph: str) -> str:
    return f"{graph}-router"


def frontend_router_config_name(graph: str, service: str) -> str:
    """A kv-mode standalone frontend service's router config (the EPP's is `router_config_name`)."""
    return f"{graph}-{service}-router"


def engines_policy_name(graph: str) -> str:
    """The NetworkPolicy of the graph's engine pods (the EPP's is `epp_service_name`)."""
    return f"{graph}-engines"


def graph_labels(graph: str) -> dict[str, str]:
    return {
        LABEL_NAME: "dynamograph",
        LABEL_INSTANCE: graph,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_GRAPH: graph,
    }


def service_labels(graph: str, service: str, kind: str) -> dict[str, str]:
    return {**graph_labels(graph), LABEL_SERVICE: service, LABEL_COMPONENT: str(kind)}


def graph_selector(graph: str) -> str:
    """The label selector discovery watches: every pod of the graph (EPP pods have no engine port)."""
    return f"{LABEL_GRAPH}={graph}"


def router_selector(graph: DynamoGraph) -> str:
    """The pods the EPP and the standalone frontends discover: the graph's; with `engineConfig`
    not its standalone frontends, since a router then also takes a pod with only an `http` port
    for an engine we did not launch, and a frontend serves `http` but is no engine."""
    selector = graph_selector(graph.name)
    if graph.spec.engine_config is None:
        return selector
    return f"{selector},{LABEL_COMPONENT}!={ComponentType.FRONTEND.value}"


# ---- building blocks ---------------------------------------------------------------------


def _meta(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": dict(labels),
        "ownerReferences": [owner.reference()],
    }


def _downward_env() -> list[dict[str, Any]]:
    def field(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    return [
        field("POD_NAME", "metadata.name"),
        field("POD_IP", "status.podIP"),
        field("POD_NAMESPACE", "metadata.namespace"),
    ]


def _user_env(spec: ServiceSpec) -> list[dict[str, Any]]:
    return [env.model_dump(by_alias=True, exclude_none=True) for env in spec.envs]


def _http_probe(port: str, period: int, failures: int, path: str = "/health") -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _grpc_probe(port: int, service: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "grpc": {"port": port, "service": service},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def _cpu_memory(spec: ServiceSpec) -> dict[str, str]:
    res = spec.resources
    return {k: v for k, v in (("cpu", res.cpu), ("memory", res.memory)) if v is not None}


def _container(
    name: str, image: str, args: list[str], config: OperatorConfig, **fields: Any
) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["dynamograph"],
        "args": args,
        **fields,
        # Pod Security "restricted" (with the pod's runAsNonRoot and seccompProfile below)
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def epp_tls(graph: DynamoGraph) -> EppTlsSpec:
    """The EPP's TLS choice: its service's `tls`, else SelfSigned (TLS, as GAIE's EPP)."""
    for spec in graph.spec.services_of(ComponentType.EPP).values():
        if spec.tls is not None:
            return spec.tls
    return EppTlsSpec()


def _kv_curve_parts(
    graph: DynamoGraph, *, opens_kv_sockets: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container volumeMounts, container env) giving a container the graph's
    KV-event CURVE keys: one of each for a container that opens KV-event sockets (an engine
    publishes, the EPP and a kv-mode standalone frontend subscribe) when `spec.kvEvents.curve`
    is on, else none."""
    if not (opens_kv_sockets and graph.spec.kv_events.curve):
        return [], [], []
    volume, mount, env = kv_curve_mount(graph)
    return [volume], [mount], [env]


# ---- containers --------------------------------------------------------------------------


def _kv_ports(data_parallel_size: int) -> list[dict[str, Any]]:
    ports = []
    for name, base in (
        ("kv-events", KV_EVENTS_PORT),
        ("kv-replay", kv_replay_port(data_parallel_size)),
    ):
        for rank in range(data_parallel_size):
            port_name = name if rank == 0 else f"{name}-{rank}"
            ports.append({"name": port_name, "containerPort": base + rank, "protocol": "TCP"})
    return ports


def frontend_args(
    graph: DynamoGraph, owner: Owner, standalone: tuple[str, ServiceSpec] | None = None
) -> list[str]:
    """A frontend's command line: the serving pods' sidecar (no `standalone`), which follows
    the EPP's headers, or a standalone frontend service (name, spec), which routes by its own
    `router`; in kv mode its pods share their bookings (replica sync with the service's other
    pods, on at any replica count so that scaling never changes the pod template)."""
    args = ["frontend", "--host", "0.0.0.0", "--port", str(HTTP_PORT)]
    if standalone is None:
        args += ["--engine-url", f"http://127.0.0.1:{ENGINE_PORT}", "--mode", "direct"]
        if graph_router(graph).enforce_disagg:
            args.append("--enforce-disagg")
    else:
        name, spec = standalone
        router = standalone_router(spec)
        args += standalone_frontend_args(router, f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}")
        if router.mode == RouterMode.KV:
            selector = f"{LABEL_GRAPH}={graph.name},{LABEL_SERVICE}={name}"
            args += ["--replica-port", str(FRONTEND_REPLICA_PORT), "--replica-selector", selector]
        if graph.spec.engine_config is not None:  # it finds engines we did not launch too
            args += engine_config_args()
    args += ["--discovery", "kubernetes", "--namespace", owner.namespace]
    return [
        *args,
        "--selector",
        graph_selector(graph.name) if standalone is None else router_selector(graph),
    ]


def epp_args(
    graph: DynamoGraph,
    owner: Owner,
    router: RouterSpec,
    tls: EppTlsSpec | None = None,
    drain_grace: int | None = None,
) -> list[str]:
    args = [
        "epp",
        "--host",
        "0.0.0.0",
        "--grpc-port",
        str(EPP_GRPC_PORT),
        "--health-port",
        str(EPP_HEALTH_PORT),
        "--metrics-port",
        str(EPP_METRICS_PORT),
        "--discovery",
        "kubernetes",
        "--namespace",
        owner.namespace,
        "--selector",
        router_selector(graph),
        # the InferencePool it serves (named as the graph): its InferenceObjectives' priorities
        "--pool-name",
        graph.name,
        "--config",
        f"{ROUTER_CONFIG_DIR}/{ROUTER_CONFIG_FILE}",
        # The contract's flags repeat the config's core fields, so the pod's command line alone
        # tells an operator of the cluster how the router is set up.
        "--overlap-weight",
        str(router.overlap_weight),
        "--temperature",
        str(router.temperature),
        "--kv-events",
        "on" if uses_kv_events(router) else "off",
    ]
    if router.enforce_disagg:
        args.append("--enforce-disagg")
    args += admission_args(router)
    if graph.spec.engine_config is not None:
        args += engine_config_args()
    if drain_grace is not None:
        args += ["--drain-grace", str(drain_grace)]
    # Active-active: every EPP pod (and process) books with the others' in-flight requests in
    # view. On at any replica count, so scaling the EPP never changes its pod template.
    args += [
        "--processes",
        str(router.processes),
        "--replica-port",
        str(EPP_REPLICA_PORT),
        "--replica-selector",
        f"{LABEL_GRAPH}={graph.name},{LABEL_COMPONENT}={ComponentType.EPP.value}",
        "--replica-timeout",
        f"{router.replica_timeout_seconds:g}",
    ]
    return args + _tls_args(tls or EppTlsSpec())


def _tls_args(tls: EppTlsSpec) -> list[str]:
    """GAIE's flags, spelled out (the CLI's own default is plaintext, GAIE's is TLS)."""
    if tls.mode == EppTlsMode.PLAINTEXT:
        return ["--secure-serving=false"]
    if tls.mode == EppTlsMode.SELF_SIGNED:
        return ["--secure-serving=true"]
    # The kubelet swaps a changed Secret into the volume; the EPP takes it up for new
    # connections (cert-manager renewals need no restart).
    return ["--secure-serving=true", "--cert-path", EPP_TLS_DIR, "--enable-cert-reload=true"]


def router_config_errors(router: RouterSpec, path: str) -> list[tuple[str, str]]:
    """What the router core's RouterConfig refuses in `router_config(router)`, as (field path,
    message) pairs naming the spec field to fix: a `router.config` key by its own path, a
    setting derived from the router section by `path`."""
    try:
        RouterConfig.model_validate(router_config(router))
    except ValidationError as exc:
        return [_router_config_error(router, path, err) for err in exc.errors()]
    return []


def _router_config_error(router: RouterSpec, path: str, err: Any) -> tuple[str, str]:
    loc = ".".join(str(part) for part in err["loc"])
    got = f" (got {err['input']!r:.80})"
    if err["type"] == "extra_forbidden":
        known = ", ".join(RouterConfig.model_fields)
        message = f"not a router setting{got}; the router's settings are: {known} (docs/router.md)"
    else:
        message = f"{err['msg']}{got}"
    if err["loc"] and err["loc"][0] in router.config:
        return f"{path}.config.{loc}", message
    return path, f"router setting {loc}: {message}"


# vLLM's workers and NCCL exchange tensors through /dev/shm; a container's default is 64 MiB.
DEFAULT_SHARED_MEMORY = "8Gi"
SHM_VOLUME = "shm"
MODEL_CACHE_VOLUME = "model-cache"
STARTUP_PROBE_PERIOD = 10
# An engine Deployment's progress deadline is its startup allowance plus this, for scheduling
# and the image pull (Kubernetes' default deadline, 600 s, is all a Deployment gets otherwise).
PROGRESS_MARGIN_SECONDS = 600


def _shared_memory(graph: DynamoGraph, spec: ServiceSpec) -> str | None:
    if spec.shared_memory is not None:
        return spec.shared_memory
    return DEFAULT_SHARED_MEMORY if graph.spec.backend == Backend.VLLM else None


def _engine_volumes(graph: DynamoGraph, spec: ServiceSpec) -> list[dict[str, Any]]:
    """An engine pod's /dev/shm (in memory), model cache and KV-event CURVE key volumes."""
    volumes = []
    shm = _shared_memory(graph, spec)
    if shm is not None:
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    return volumes + _model_cache_volume(graph) + _kv_curve_parts(graph, opens_kv_sockets=True)[0]


def _model_cache_volume(graph: DynamoGraph, *, read_only: bool = False) -> list[dict[str, Any]]:
    """The model cache's volume, if the graph names one (`read_only`: read-only even where the
    spec lets the engines write)."""
    cache = graph.spec.model.cache
    if cache is None:
        return []
    # `readOnly: false` only when true: the apiserver omits a false one, and a field the live
    # object lacks would be patched on every pass.
    flag = {"readOnly": True} if cache.read_only or read_only else {}
    if cache.claim_name is not None:
        claim = {"claimName": cache.claim_name, **flag}
        return [{"name": MODEL_CACHE_VOLUME, "persistentVolumeClaim": claim}]
    return [
        {
            "name": MODEL_CACHE_VOLUME,
            "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"},
        }
    ]


def _model_cache_mount(graph: DynamoGraph, *, read_only: bool = False) -> list[dict[str, Any]]:
    cache = graph.spec.model.cache
    if cache is None:
        return []
    mount: dict[str, Any] = {"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_DIR}
    return [{**mount, "readOnly": True} if cache.read_only or read_only else mount]


def _tokenizer_in_model_cache(graph: DynamoGraph) -> bool:
    """Whether the graph's tokenizer is a file in its model cache: then the EPP, which
    tokenizes every prompt, mounts the cache too (read-only)."""
    tokenizer = graph.spec.model.tokenizer or ""
    path = tokenizer.removeprefix("hf:")
    return graph.spec.model.cache is not None and path.startswith(MODEL_CACHE_DIR + "/")


def _engine_mounts(graph: DynamoGraph, spec: ServiceSpec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = []
    if _shared_memory(graph, spec) is not None:
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    return mounts + _model_cache_mount(graph) + _kv_curve_parts(graph, opens_kv_sockets=True)[1]


def _placement(spec: ServiceSpec) -> dict[str, Any]:
    """nodeSelector (with gpuType's label), tolerations and affinity of a service's pods."""
    selector = dict(spec.node_selector)
    if spec.gpu_type is not None:
        selector[GPU_PRODUCT_LABEL] = spec.gpu_type
    out: dict[str, Any] = {}
    if selector:
        out["nodeSelector"] = selector
    if spec.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations
        ]
    if spec.affinity is not None:
        out["affinity"] = copy.deepcopy(spec.affinity)
    return out


def _engine_container(
    graph: DynamoGraph, spec: ServiceSpec, image: str, config: OperatorConfig
) -> dict[str, Any]:
    limits: dict[str, Any] = _cpu_memory(spec)
    requests = dict(limits)
    gpus = graph.spec.gpus(spec)
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    resources = {k: v for k, v in (("requests", requests), ("limits", limits)) if v}
    # Model loading takes minutes on vLLM; the startup probe holds liveness off until then.
    startup_failures = -(-graph.spec.startup_seconds(spec) // STARTUP_PROBE_PERIOD)
    env = [
        *_downward_env(),
        admin_token_env(graph),
        *_kv_curve_parts(graph, opens_kv_sockets=True)[2],
    ]
    if graph.spec.model.cache is not None:
        env.append({"name": "HF_HOME", "value": MODEL_CACHE_DIR})
    fields: dict[str, Any] = {}
    mounts = _engine_mounts(graph, spec)
    if mounts:
        fields["volumeMounts"] = mounts
    return _container(
        "engine",
        image,
        worker_args(graph, spec),
        config,
        ports=[
            {"name": "engine", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            *_kv_ports(spec.data_parallel_size),
        ],
        env=[*env, *_user_env(spec)],
        resources=resources,
        startupProbe=_http_probe("engine", STARTUP_PROBE_PERIOD, startup_failures),
        readinessProbe=_http_probe("engine", 5, 3),
        livenessProbe=_http_probe("engine", 10, 6),
        **fields,
    )


def _frontend_container(
    graph: DynamoGraph,
    owner: Owner,
    spec: ServiceSpec,
    image: str,
    config: OperatorConfig,
    *,
    name: str | None = None,
) -> dict[str, Any]:
    """The serving pods' frontend sidecar (no `name`), or the standalone frontend service
    `name`'s container."""
    fields: dict[str, Any] = {}
    ports = [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}]
    if name is None:
        # the EPP already chose; the sidecar follows the routing headers
        resources: dict[str, Any] = copy.deepcopy(SIDECAR_RESOURCES)
        env = _downward_env()
    else:
        kv = standalone_router(spec).mode == RouterMode.KV
        resources = _resources_or(spec, FRONTEND_RESOURCES)
        _, mounts, curve_env = _kv_curve_parts(graph, opens_kv_sockets=kv)
        mounts = [*_engine_config_mounts(graph), *mounts]
        if kv:  # its router config file (`--router-config`), its replica sync
            mounts = [_router_config_mount(), *mounts]
            ports.append(
                {"name": "replica-sync", "containerPort": FRONTEND_REPLICA_PORT, "protocol": "TCP"}
            )
        env = _downward_env() + curve_env + _user_env(spec)
        if mounts:
            fields["volumeMounts"] = mounts
    return _container(
        "frontend",
        image,
        frontend_args(graph, owner, None if name is None else (name, spec)),
        config,
        ports=ports,
        env=env,
        resources=resources,
        **fields,
        # /health waits for the engine (or for discovered workers); /live only for the process,
        # so a slow model load does not restart the frontend.
        readinessProbe=_http_probe("http", 5, 3),
        livenessProbe=_http_probe("http", 10, 6, path="/live"),
    )


def _router_config_mount() -> dict[str, Any]:
    return {"name": "router-config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True}


def _engine_config_mounts(graph: DynamoGraph) -> list[dict[str, Any]]:
    """A router's (the EPP's, a standalone frontend's) mount of `engineConfig`, if any."""
    if graph.spec.engine_config is None:
        return []
    return [{"name": ENGINE_CONFIG_VOLUME, "mountPath": ENGINE_CONFIG_DIR, "readOnly": True}]


def _engine_config_volumes(graph: DynamoGraph, annotations: dict[str, str]) -> list[dict[str, Any]]:
    """A router pod's volume of `engineConfig`, if any; its checksum goes into `annotations`, so
    a changed document rolls the pods, which read it at start."""
    document = engine_config_file(graph)
    if document is None:
        return []
    annotations[ENGINE_CONFIG_CHECKSUM] = _sha256(document)
    return [{"name": ENGINE_CONFIG_VOLUME, "configMap": {"name": engine_config_name(graph)}}]


def _resources_or(spec: ServiceSpec, default: dict[str, Any]) -> dict[str, Any]:
    """The service's cpu/memory as requests and limits, else `default`."""
    cpu_memory = _cpu_memory(spec)
    if cpu_memory:
        return {"requests": cpu_memory, "limits": dict(cpu_memory)}
    return copy.deepcopy(default)


def epp_resources(processes: int) -> dict[str, Any]:
    """The EPP's default resources: `EPP_RESOURCES` per process (each holds its own index,
    tokenizers and router)."""
    if processes == 1:
        return copy.deepcopy(EPP_RESOURCES)
    return {
        "requests": {"cpu": f"{500 * processes}m", "memory": f"{512 * processes}Mi"},
        "limits": {"memory": f"{2 * processes}Gi"},
    }


def epp_grace(spec: ServiceSpec, path: str) -> tuple[int, int, int]:
    """(terminationGracePeriodSeconds, preStop sleep, --drain-grace) of an EPP service: the
    budget is extraPodSpec's terminationGracePeriodSeconds or EPP_TERMINATION_GRACE_SECONDS."""
    grace = spec.extra_pod_spec.get("terminationGracePeriodSeconds", EPP_TERMINATION_GRACE_SECONDS)
    if not isinstance(grace, int) or isinstance(grace, bool) or grace < 0:
        raise GraphError([(f"{path}.terminationGracePeriodSeconds", "must be an integer >= 0")])
    sleep = min(EPP_PRESTOP_SECONDS, grace // 4)
    return grace, sleep, max(grace - sleep - EPP_STOP_MARGIN_SECONDS, 0)


def _epp_container(
    graph: DynamoGraph,
    owner: Owner,
    spec: ServiceSpec,
    image: str,
    config: OperatorConfig,
    name: str,
) -> dict[str, Any]:
    _, sleep, drain = epp_grace(spec, f"spec.services.{name}.extraPodSpec")
    lifecycle = {"preStop": {"sleep": {"seconds": sleep}}} if sleep else {}
    tls = epp_tls(graph)
    mounts = [_router_config_mount(), *_engine_config_mounts(graph)]
    if tls.mode == EppTlsMode.SECRET:
        mounts.append({"name": EPP_TLS_VOLUME, "mountPath": EPP_TLS_DIR, "readOnly": True})
    if _tokenizer_in_model_cache(graph):
        mounts += _model_cache_mount(graph, read_only=True)
    _, curve_mounts, curve_env = _kv_curve_parts(graph, opens_kv_sockets=True)
    return _container(
        "epp",
        image,
        epp_args(graph, owner, graph_router(graph), tls, drain),
        config,
        ports=[
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
            {"name": "replica-sync", "containerPort": EPP_REPLICA_PORT, "protocol": "TCP"},
            *_bound_kv_ports(graph, "containerPort"),
        ],
        env=_downward_env() + curve_env + _user_env(spec),
        resources=_resources_or(spec, epp_resources(graph_router(graph).processes)),
        volumeMounts=mounts + curve_mounts,
        **({"lifecycle": lifecycle} if lifecycle else {}),
        # The EPP's gRPC health services: readiness (a serving worker is known, not draining)
        # and liveness (the process runs).
        readinessProbe=_grpc_probe(EPP_HEALTH_PORT, "readiness", 5, 3),
        livenessProbe=_grpc_probe(EPP_HEALTH_PORT, "liveness", 10, 6),
    )


BOUND_KV_PORT_NAME = "kv-events"


def _bound_kv_ports(graph: DynamoGraph, key: str) -> list[dict[str, Any]]:
    """The EPP's port for engines whose KV-event publishers dial it (`engineConfig.kv_events`
    with `bind`), as a container port (`key` containerPort) or a Service port (`port`)."""
    bound = bound_kv_events(graph)
    if bound is None or bound[1] is None:
        return []
    port: dict[str, Any] = {"name": BOUND_KV_PORT_NAME, key: bound[1], "protocol": "TCP"}
    if key == "port":
        port["targetPort"] = BOUND_KV_PORT_NAME
    return [port]


def engine_config_errors(graph: DynamoGraph) -> list[tuple[str, str]]:
    """What the EPP could not serve of `engineConfig`, as (field path, message) pairs: a bound
    KV-event endpoint (llm-d's layout: each engine's publisher dials the EPP through the Service
    `<graph>-epp`) must be `tcp://*:<port>` on a port the EPP does not use itself, and it
    reaches one EPP process only (a Service sends each engine's one connection to one pod) and
    cannot be secured with CURVE. A standalone frontend routing by KV events would get none of
    them: the engines dial the EPP."""
    bound = bound_kv_events(graph)
    if bound is None:
        return []
    endpoint, port = bound
    path = "spec.engineConfig.kv_events.endpoint"
    service = epp_service_name(graph.name)
    if port is None or not 0 < port < 65536:
        return [
            (
                path,
                f"{endpoint!r}: with bind the EPP binds this endpoint and the engines' publishers "
                f"dial it through the Service {service}; write tcp://*:<port> (e.g. tcp://*:5557)",
            )
        ]
    router = graph_router(graph)
    own = {
        EPP_GRPC_PORT: "ext_proc gRPC",
        EPP_HEALTH_PORT: "gRPC health",
        EPP_METRICS_PORT: "metrics",
        **{EPP_REPLICA_PORT + i: "replica sync" for i in range(router.processes)},
    }
    errors = []
    # without an epp service nothing binds the endpoint (a kv-mode frontend must not wait for
    # its events, below), so no port of the EPP's is taken
    if port in own and graph.spec.services_of(ComponentType.EPP):
        errors.append((path, f"port {port} is the EPP's {own[port]} port; choose another"))
    one = (
        f"with engineConfig.kv_events.bind each engine's publisher dials one EPP process (through "
        f"the Service {service}), so the others would miss its KV events: run one EPP replica of "
        "one process, or let the engines bind (kv_events without bind) so that every EPP "
        "process connects to each of them"
    )
    for name, spec in graph.spec.services_of(ComponentType.EPP).items():
        if spec.replicas > 1:
            errors.append((f"spec.services.{name}.replicas", one))
        if router.processes > 1:
            errors.append((f"spec.services.{name}.router.processes", one))
    for name, spec in graph.spec.services_of(ComponentType.FRONTEND).items():
        router = standalone_router(spec)
        if router.mode == RouterMode.KV and uses_kv_events(router):
            errors.append(
                (
                    f"spec.services.{name}.router.kvEvents",
                    "with engineConfig.kv_events.bind each engine's publisher dials one "
                    "endpoint, which only the EPP binds, so this kv-mode frontend would receive "
                    "no KV event: set router.kvEvents false here (it then counts routed prefixes "
                    "as cached for a while), or let the engines bind (kv_events without bind)",
                )
            )
    if graph.spec.kv_events.curve:
        errors.append(
            (
                "spec.kvEvents.curve",
                "a KV-event endpoint the EPP binds (engineConfig.kv_events.bind) cannot use "
                "CURVE: the EPP's keys make it a client; turn one of the two off",
            )
        )
    return errors


# ---- pod spec merging --------------------------------------------------------------------


def _merge(base: Any, extra: Any, path: str) -> Any:
    """extraPodSpec over the generated pod spec: maps merge, named list items merge by name,
    other list items are appended, scalars are replaced."""
    if isinstance(base, dict) and isinstance(extra, dict):
        out = dict(base)
        for key, value in extra.items():
            out[key] = _merge(base[key], value, f"{path}.{key}") if key in base else value
        return out
    if isinstance(base, list) and isinstance(extra, list):
        out_list = list(base)
        by_name = {item.get("name"): i for i, item in enumerate(base) if isinstance(item, dict)}
        for index, item in enumerate(extra):
            if not isinstance(item, dict):
                out_list.append(item)
                continue
            name = item.get("name")
            if name in by_name:
                at = by_name[name]
                out_list[at] = _merge(base[at], item, f"{path}[{index}]")
            else:
                out_list.append(item)
        return out_list
    if type(base) is not type(extra) and (isinstance(base, dict | list)):
        kind = "a mapping" if isinstance(base, dict) else "a list"
        raise GraphError([(path, f"must be {kind}")])
    return extra


def merge_extra_pod_spec(
    pod_spec: dict[str, Any], extra: dict[str, Any], path: str
) -> dict[str, Any]:
    unknown = sorted(set(extra) - _pod_spec_fields())
    if unknown:
        raise GraphError(
            [
                (f"{path}.{key}", "not a PodSpec field (see `kubectl explain pod.spec`)")
                for key in unknown
            ]
        )
    for key in ("containers", "initContainers", "volumes", "tolerations"):
        items = extra.get(key, [])
        if not isinstance(items, list):
            raise GraphError([(f"{path}.{key}", "must be a list")])
        if key != "tolerations":
            for index, item in enumerate(items):
                if not isinstance(item, dict) or not item.get("name"):
                    raise GraphError([(f"{path}.{key}[{index}]", "must be a mapping with a name")])
    ours = {c["name"] for c in pod_spec.get("containers", [])}
    for key in ("containers", "initContainers"):
        for index, item in enumerate(extra.get(key, [])):
            if (key == "initContainers" or item["name"] not in ours) and not item.get("image"):
                message = f"adds container {item['name']!r} (ours: {', '.join(sorted(ours))}) without an image"
                raise GraphError([(f"{path}.{key}[{index}].image", message)])
    return _merge(pod_spec, copy.deepcopy(extra), path)


# ---- objects -----------------------------------------------------------------------------


def router_config_file(graph: DynamoGraph) -> str:
    """The EPP's `--config` file (`RouterConfig` fields), YAML."""
    return _router_yaml(graph_router(graph))


def frontend_router_config_file(spec: ServiceSpec) -> str | None:
    """A standalone frontend's `--router-config` file, YAML; None unless it routes in kv mode."""
    router = standalone_router(spec)
    return _router_yaml(router) if router.mode == RouterMode.KV else None


def _router_yaml(router: RouterSpec) -> str:
    return yaml.safe_dump(router_config(router), sort_keys=True)


def _sha256(document: str) -> str:
    return hashlib.sha256(document.encode()).hexdigest()


def _deployment(
    graph: DynamoGraph, owner: Owner, name: str, spec: ServiceSpec, config: OperatorConfig
) -> dict[str, Any]:
    kind = ComponentType(spec.component_type)
    image = spec.image or config.image
    labels = service_labels(graph.name, name, kind)
    pod_labels = dict(labels)
    annotations = {"prometheus.io/scrape": "true"}
    volumes: list[dict[str, Any]] = []
    if kind in ENGINE_TYPES:
        containers = [_engine_container(graph, spec, image, config)]
        volumes += _engine_volumes(graph, spec)
        annotations["prometheus.io/port"] = str(ENGINE_PORT)
        if kind in SERVING_TYPES:
            containers.append(_frontend_container(graph, owner, spec, image, config))
            pod_labels[LABEL_SERVING] = "true"
    elif kind == ComponentType.EPP:
        containers = [_epp_container(graph, owner, spec, image, config, name)]
        annotations["prometheus.io/port"] = str(EPP_METRICS_PORT)
        volumes.append(
            {"name": "router-config", "configMap": {"name": router_config_name(graph.name)}}
        )
        annotations[ROUTER_CONFIG_CHECKSUM] = _sha256(router_config_file(graph))
        volumes += _engine_config_volumes(graph, annotations)
        tls = epp_tls(graph)
        if tls.mode == EppTlsMode.SECRET:
            # No subPath mounts: the kubelet only updates whole Secret volumes on rotation.
            volumes.append({"name": EPP_TLS_VOLUME, "secret": {"secretName": tls.secret_name}})
        if _tokenizer_in_model_cache(graph):
            volumes += _model_cache_volume(graph, read_only=True)
        volumes += _kv_curve_parts(graph, opens_kv_sockets=True)[0]
    else:  # standalone frontend
        containers = [_frontend_container(graph, owner, spec, image, config, name=name)]
        router_document = frontend_router_config_file(spec)
        if router_document is not None:  # kv mode: the router config, KV events
            source = {"name": frontend_router_config_name(graph.name, name)}
            volumes.append({"name": "router-config", "configMap": source})
            annotations[ROUTER_CONFIG_CHECKSUM] = _sha256(router_document)
        volumes += _engine_config_volumes(graph, annotations)
        volumes += _kv_curve_parts(graph, opens_kv_sockets=router_document is not None)[0]
        annotations["prometheus.io/port"] = str(HTTP_PORT)
    pod_spec: dict[str, Any] = {
        "serviceAccountName": discovery_name(graph.name),
        # Pod Security "restricted": the image runs as a non-root user (Dockerfile USER 10001);
        # an image that does not is refused by the kubelet rather than run as root.
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
        # Engines drain in-flight requests on SIGTERM before exiting.
        "terminationGracePeriodSeconds": (
            epp_grace(spec, "")[0]
            if kind == ComponentType.EPP
            else 60
            if kind in ENGINE_TYPES
            else 30
        ),
    }
    pod_spec.update(_placement(spec))
    if volumes:
        pod_spec["volumes"] = volumes
    if kind == ComponentType.PREFILL:
        # Engine-only pods (prefill) never call the API: no token in them. The EPP and every
        # frontend (standalone or the serving pods' sidecar) discover pods with it.
        pod_spec["automountServiceAccountToken"] = False
    if spec.extra_pod_spec:
        pod_spec = merge_extra_pod_spec(
            pod_spec, spec.extra_pod_spec, f"spec.services.{name}.extraPodSpec"
        )
    deployment_spec: dict[str, Any] = {
        "replicas": spec.replicas,
        "selector": {"matchLabels": {LABEL_GRAPH: graph.name, LABEL_SERVICE: name}},
        "template": {
            "metadata": {"labels": pod_labels, "annotations": annotations},
            "spec": pod_spec,
        },
    }
    if kind in ENGINE_TYPES:
        # The Deployment gives up (Degraded) only after a pod has had its whole startup allowance.
        deployment_spec["progressDeadlineSeconds"] = (
            graph.spec.startup_seconds(spec) + PROGRESS_MARGIN_SECONDS
        )
    if graph.spec.gpus(spec):
        # No surge: a rollout must not need a spare GPU node; replace one pod at a time.
        deployment_spec["strategy"] = {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }
    elif kind == ComponentType.EPP:
        # The new EPP is ready before an old one starts draining: the gateway always has one.
        deployment_spec["strategy"] = {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner, deployment_name(graph.name, name), labels),
        "spec": deployment_spec,
    }


def _rbac(graph: DynamoGraph, owner: Owner, labels: dict[str, str]) -> list[dict[str, Any]]:
    name = discovery_name(graph.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(owner, name, labels),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(owner, name, labels),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                # the EPP: the priorities of its pool's GAIE InferenceObjectives
                {
                    "apiGroups": [OBJECTIVE_GROUP],
                    "resources": ["inferenceobjectives"],
                    "verbs": ["get", "list", "watch"],
                },
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(owner, name, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}],
        },
    ]


def _service(
    owner: Owner, name: str, labels: dict[str, str], selector: dict[str, str], ports: list
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(owner, name, labels),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": ports},
    }


def _epp_app_protocol(tls: EppTlsSpec) -> str:
    """`kubernetes.io/h2c` says HTTP/2 in cleartext (Gateway API GEP-1911); over TLS the port
    is HTTP/2 inside TLS, which GAIE's chart labels `http2`."""
    return "kubernetes.io/h2c" if tls.mode == EppTlsMode.PLAINTEXT else "http2"


def _frontend_selector(graph: DynamoGraph) -> dict[str, str]:
    if graph.spec.services_of(ComponentType.FRONTEND):
        return {LABEL_GRAPH: graph.name, LABEL_COMPONENT: ComponentType.FRONTEND.value}
    return {LABEL_GRAPH: graph.name, LABEL_SERVING: "true"}


def _inference_pool(graph: DynamoGraph, owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": f"{POOL_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": _meta(owner, graph.name, graph_labels(graph.name)),
        "spec": {
            "selector": {"matchLabels": {LABEL_GRAPH: graph.name, LABEL_SERVING: "true"}},
            "targetPorts": [{"number": HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_service_name(graph.name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": str(graph.spec.gateway.failure_mode),
            },
        },
    }


def _http_route(graph: DynamoGraph, owner: Owner) -> dict[str, Any]:
    gateway = graph.spec.gateway
    parent = gateway.parent_ref
    assert parent is not None
    spec: dict[str, Any] = {
        "parentRefs": [parent.model_dump(by_alias=True, exclude_none=True)],
        "rules": [
            {
                # the OpenAI API only: the pool's frontends serve nothing else to clients
                "matches": [{"path": {"type": "PathPrefix", "value": "/v1"}}],
                "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": graph.name}],
                "timeouts": {"request": gateway.request_timeout},
            }
        ],
    }
    if gateway.hostnames:
        spec["hostnames"] = list(gateway.hostnames)
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": _meta(owner, graph.name, graph_labels(graph.name)),
        "spec": spec,
    }


def _pod_disruption_budget(
    graph: DynamoGraph, owner: Owner, name: str, spec: ServiceSpec
) -> dict[str, Any]:
    """One pod at a time may be evicted (node drains, cluster autoscaling): never a budget that
    blocks a drain (a single-replica EPP may go; run two for drains without a gap), and pods
    that are not Ready may always be evicted (a crash-looping pod must not hold a node)."""
    kind = ComponentType(spec.component_type)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(
            owner, deployment_name(graph.name, name), service_labels(graph.name, name, kind)
        ),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": {LABEL_GRAPH: graph.name, LABEL_SERVICE: name}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _component_peer(graph: DynamoGraph, **labels: str) -> dict[str, Any]:
    """Pods of this graph (in its namespace) with these labels, as a NetworkPolicyPeer."""
    return {"podSelector": {"matchLabels": {LABEL_GRAPH: graph.name, **labels}}}


def _tcp(port: int, end: int | None = None) -> dict[str, Any]:
    return {"protocol": "TCP", "port": port, **({"endPort": end} if end and end > port else {})}


def _gateway_peers(graph: DynamoGraph, owner: Owner, config: OperatorConfig) -> list[dict]:
    """Who may open ext_proc streams to the EPP: the configured peers, else the namespace of the
    graph's Gateway (where kgateway, Istio and GAIE's reference gateway run their proxies), else
    (no parentRef: the gateway is not known here) anyone."""
    if config.gateway_from:
        return [copy.deepcopy(peer) for peer in config.gateway_from]
    parent = graph.spec.gateway.parent_ref
    if parent is None:
        return []
    namespace = parent.namespace or owner.namespace
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}]


def _rule(ports: list[dict[str, Any]], peers: list[dict[str, Any]] | None) -> dict[str, Any]:
    """An ingress rule; `peers` None means from anywhere (a rule without `from`)."""
    return {"ports": ports} if peers is None else {"from": peers, "ports": ports}


def _network_policies(
    graph: DynamoGraph, owner: Owner, config: OperatorConfig
) -> list[dict[str, Any]]:
    """Ingress allow-lists for the engine pods and the EPP pods (docs/security.md).

    Engines: their engine HTTP port (OpenAI API, /v1/engine, admin endpoints) and KV-event and
    replay sockets from the graph's EPP and frontends (standalone, and the sidecars of the
    serving pods); every port from the graph's other engines (the disaggregated hand-off: KV
    pulls, vLLM's NIXL side channel and transfer ports); the frontend sidecar's serving port
    from anyone (the InferencePool's targetPort: the gateway's proxies, and in-cluster clients
    of the frontend Service); the engine port from Prometheus (`metrics_from`, it serves
    /metrics). EPP: gRPC (and its health port) from the gateway, metrics from Prometheus. The
    kubelet's probes are node traffic, which NetworkPolicy does not filter."""
    engines = graph.spec.services_of(*ENGINE_TYPES)
    widest = max(spec.data_parallel_size for spec in engines.values())
    kv = _tcp(KV_EVENTS_PORT, kv_replay_port(widest) + widest - 1)
    routers = [
        _component_peer(graph, **{LABEL_COMPONENT: ComponentType.EPP.value}),
        _component_peer(graph, **{LABEL_COMPONENT: ComponentType.FRONTEND.value}),
    ]
    engine_peers = [
        {
            "podSelector": {
                "matchLabels": {LABEL_GRAPH: graph.name},
                "matchExpressions": [
                    {
                        "key": LABEL_COMPONENT,
                        "operator": "In",
                        "values": sorted(str(k) for k in ENGINE_TYPES),
                    }
                ],
            }
        }
    ]
    metrics = [copy.deepcopy(peer) for peer in config.metrics_from]
    engine_rules = [
        _rule([_tcp(ENGINE_PORT), kv], routers),
        {"from": engine_peers},  # every port
        _rule([_tcp(HTTP_PORT)], None),
    ]
    if metrics:
        engine_rules.append(_rule([_tcp(ENGINE_PORT)], metrics))

    def policy(name: str, selector: dict[str, Any], rules: list[dict[str, Any]]) -> dict:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(owner, name, graph_labels(graph.name)),
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": rules},
        }

    engine_pods = copy.deepcopy(engine_peers[0]["podSelector"])
    out = [policy(engines_policy_name(graph.name), engine_pods, engine_rules)]
    if graph.spec.services_of(ComponentType.EPP):
        gateway = _gateway_peers(graph, owner, config)
        epp_rules = [
            _rule([_tcp(EPP_GRPC_PORT), _tcp(EPP_HEALTH_PORT)], gateway or None),
        ]
        # replica sync between the EPP pods: process i of a pod on EPP_REPLICA_PORT + i
        processes = graph_router(graph).processes
        epp_pods = _component_peer(graph, **{LABEL_COMPONENT: ComponentType.EPP.value})
        replicas = _tcp(EPP_REPLICA_PORT, EPP_REPLICA_PORT + processes - 1)
        epp_rules.append(_rule([replicas], [epp_pods]))
        bound = bound_kv_events(graph)
        if bound is not None and bound[1] is not None:
            # engines whose KV-event publishers dial the EPP: the graph's pods (foreign engine
            # pods join the graph by its label)
            epp_rules.append(_rule([_tcp(bound[1])], [_component_peer(graph)]))
        if metrics:
            epp_rules.append(_rule([_tcp(EPP_METRICS_PORT)], metrics))
        selector = {"matchLabels": {LABEL_GRAPH: graph.name, LABEL_COMPONENT: "epp"}}
        out.append(policy(epp_service_name(graph.name), selector, epp_rules))
    return out


def _pod_monitor(graph: DynamoGraph, owner: Owner, config: OperatorConfig) -> dict[str, Any]:
    """Prometheus Operator's PodMonitor for every pod of the graph, by port name: engines serve
    /metrics on `engine`, frontends (sidecar or standalone) on `http`, the EPP on `metrics`.
    The job label is the component type; graph and service become target labels."""
    return {
        "apiVersion": MONITORING_API_VERSION,
        "kind": "PodMonitor",
        "metadata": _meta(
            owner, graph.name, {**config.pod_monitor_labels, **graph_labels(graph.name)}
        ),
        "spec": {
            "selector": {"matchLabels": {LABEL_GRAPH: graph.name, LABEL_MANAGED_BY: MANAGED_BY}},
            "jobLabel": LABEL_COMPONENT,
            "podTargetLabels": [LABEL_GRAPH, LABEL_SERVICE],
            "podMetricsEndpoints": [
                {"port": port, "path": "/metrics"} for port in ("engine", "http", "metrics")
            ],
        },
    }


def _created_once_secret(
    graph: DynamoGraph, owner: Owner, name: str, data: dict[str, str]
) -> dict[str, Any]:
    """A Secret of the graph holding `data`. Such Secrets are not among `desired_objects`: the
    operator only ever creates them (new random content, once), never reads, compares or
    patches them, so it holds no right to read Secrets and their content stays out of the
    plan and the last-applied annotations."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(owner, name, graph_labels(graph.name)),
        "type": "Opaque",
        "stringData": data,
    }


def admin_token_secret_object(graph: DynamoGraph, owner: Owner, token: str) -> dict[str, Any]:
    """The graph's admin-token Secret (protocol.launch.admin_token_secret) holding `token`."""
    return _created_once_secret(graph, owner, admin_token_secret(graph), {ADMIN_TOKEN_KEY: token})


def kv_curve_secret_object(
    graph: DynamoGraph, owner: Owner, files: dict[str, str]
) -> dict[str, Any]:
    """The graph's KV-event CURVE Secret (protocol.launch.kv_curve_secret): the key folder's
    `files` (file name -> content, as protocol.kv_curve.key_files makes them), one key each, so
    the mounted volume is the folder `dynamograph kv-curve-keys` writes."""
    return _created_once_secret(graph, owner, kv_curve_secret(graph), files)


def desired_objects(
    graph: DynamoGraph, owner: Owner, config: OperatorConfig
) -> list[dict[str, Any]]:
    """Every object the graph should own, in creation order. Raises GraphError, e.g. for
    router settings RouterConfig refuses (so no EPP is rolled out with a config it rejects)."""
    errors = _router_errors(graph) + engine_config_errors(graph)
    objects: list[dict[str, Any]] = []
    epps = graph.spec.services_of(ComponentType.EPP)
    epp_name = next(iter(epps), None)
    epp_labels = (
        service_labels(graph.name, epp_name, ComponentType.EPP)
        if epp_name
        else graph_labels(graph.name)
    )
    objects += _rbac(graph, owner, epp_labels)
    engine_document = engine_config_file(graph)
    if engine_document is not None:  # read by the EPP and the standalone frontends
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(owner, engine_config_name(graph), epp_labels),
                "data": {ENGINE_CONFIG_FILE: engine_document},
            }
        )
    if epp_name is not None:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": _meta(owner, router_config_name(graph.name), epp_labels),
                "data": {ROUTER_CONFIG_FILE: router_config_file(graph)},
            }
        )
        objects.append(
            _service(
                owner,
                epp_service_name(graph.name),
                epp_labels,
                {LABEL_GRAPH: graph.name, LABEL_SERVICE: epp_name},
                [
                    {
                        "name": "grpc",
                        "port": EPP_GRPC_PORT,
                        "targetPort": "grpc",
                        "protocol": "TCP",
                        "appProtocol": _epp_app_protocol(epp_tls(graph)),
                    },
                    {
                        "name": "grpc-health",
                        "port": EPP_HEALTH_PORT,
                        "targetPort": "grpc-health",
                        "protocol": "TCP",
                    },
                    {
                        "name": "metrics",
                        "port": EPP_METRICS_PORT,
                        "targetPort": "metrics",
                        "protocol": "TCP",
                    },
                    *_bound_kv_ports(graph, "port"),
                ],
            )
        )
    objects.append(
        _service(
            owner,
            frontend_service_name(graph.name),
            graph_labels(graph.name),
            _frontend_selector(graph),
            [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"}],
        )
    )
    if config.network_policy:
        objects += _network_policies(graph, owner, config)
    for name, spec in graph.spec.services.items():
        router_document = (
            frontend_router_config_file(spec)
            if spec.component_type == ComponentType.FRONTEND
            else None
        )
        if router_document is not None:  # before the Deployment that mounts it
            objects.append(
                {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": _meta(
                        owner,
                        frontend_router_config_name(graph.name, name),
                        service_labels(graph.name, name, ComponentType.FRONTEND),
                    ),
                    "data": {ROUTER_CONFIG_FILE: router_document},
                }
            )
        try:
            objects.append(_deployment(graph, owner, name, spec, config))
        except GraphError as exc:
            errors += exc.errors
        if spec.component_type == ComponentType.EPP or spec.replicas > 1:
            objects.append(_pod_disruption_budget(graph, owner, name, spec))
    if errors:
        raise GraphError(errors)
    if config.pod_monitor:
        objects.append(_pod_monitor(graph, owner, config))
    if epp_name is not None:
        objects.append(_inference_pool(graph, owner))
        if graph.spec.gateway.parent_ref is not None:
            objects.append(_http_route(graph, owner))
    return objects


def _router_errors(graph: DynamoGraph) -> list[tuple[str, str]]:
    """RouterConfig's verdict on the router settings of every epp service (its router config
    file, defaults included) and of every frontend service that has a router section."""
    errors = []
    for name, spec in graph.spec.services_of(ComponentType.EPP, ComponentType.FRONTEND).items():
        if spec.router is None and spec.component_type == ComponentType.FRONTEND:
            continue
        errors += router_config_errors(spec.router or RouterSpec(), f"spec.services.{name}.router")
    return errors


def object_key(obj: dict[str, Any]) -> tuple[str, str, str]:
    """(apiVersion, kind, name): identifies an object within the graph's namespace."""
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]
