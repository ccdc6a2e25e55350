"""The DynamoGraph resource: pydantic models of its spec and status, the one source of truth.

This module owns what a DynamoGraph *is*: its fields, their defaults and validation, and
`load_graph`, which reads one from a YAML file or a dict. Both readers of a graph use it: the
operator (`dynamograph operator`), which validates every live object with these models and
generates the CRD in `crds/` from them (`dynamograph crds`), and `dynamograph up`, which runs a
graph on this machine. How each service is launched from it is `protocol.launch`.
Field names are camelCase on the wire (Kubernetes style) and snake_case in Python.

Validation a CRD schema can express (enums, minimums, required fields, patterns, some CEL rules)
is in the field definitions; cross-field rules that need to see the whole graph are pydantic
validators. Both raise errors that name the field path (`spec.services.decode.replicas`) so the
operator can put it in a Degraded condition and an Event, and `up` can print it.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from .engine import EngineTemplate, EngineTemplateFields

GROUP: Final = "dynamograph.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = "dynamograph.io/v1alpha1"  # GROUP/VERSION, spelled out for its Literal type
KIND: Final = "DynamoGraph"
PLURAL = "dynamographs"
SINGULAR = "dynamograph"
SHORT_NAMES = ["dg"]

# A graph's objects are named `<graph>-<service>`; Kubernetes Service names are DNS-1035 labels
# (at most 63 characters), so the two parts share that budget.
MAX_OBJECT_NAME = 63
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Kubernetes resource.Quantity, as controller-gen writes it into CRDs.
QUANTITY = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


# The node label NVIDIA's GPU feature discovery puts on GPU nodes (e.g. NVIDIA-H100-80GB-HBM3);
# `gpuType` selects nodes by it.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

# The `vllm serve` flags `dynamograph worker --engine vllm` sets itself (worker/vllm.py; a test
# checks the two agree), each with what sets it instead: `engine.extraArgs` may not repeat them.
# vLLM also reads `--flag_name` for `--flag-name` and has `--no-` forms of its boolean flags.
VLLM_OWNED_FLAGS: Final = {
    "--model": "model.name",
    "--served-model-name": "model.servedModelName",
    "--tokenizer": "model.tokenizer",
    "--host": "the contract's ports (docs/contracts.md)",
    "--port": "the contract's ports (docs/contracts.md)",
    "--block-size": "kvBlockSize",
    "--enable-prefix-caching": "nothing: always on, KV-aware routing needs it",
    "--no-enable-prefix-caching": "nothing: always on, KV-aware routing needs it",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-num-batched-tokens": "engine.maxNumBatchedTokens",
    "--max-model-len": "engine.contextLength",
    "--num-gpu-blocks-override": "engine.numGpuBlocks",
    "--seed": "engine.seed",
    "--data-parallel-size": "dataParallelSize",
    "-dp": "dataParallelSize",
    "--tensor-parallel-size": "tensorParallelSize",
    "-tp": "tensorParallelSize",
    "--pipeline-parallel-size": "pipelineParallelSize",
    "-pp": "pipelineParallelSize",
    "--kv-events-config": "the operator (KV events feed the router's index)",
    "--kv-transfer-config": "componentType (the prefill/decode hand-off)",
    "--middleware": "the operator (it serves /v1/engine)",
    "--scheduling-policy": "the operator (priority: the frontend forwards request priorities)",
    "--enable-lora": "nothing yet: LoRA adapters are not part of a DynamoGraph",
    "--no-enable-lora": "nothing yet: LoRA adapters are not part of a DynamoGraph",
    "--max-loras": "nothing yet: LoRA adapters are not part of a DynamoGraph",
    "--lora-modules": "nothing yet: LoRA adapters are not part of a DynamoGraph",
}


def _owned_flags_regex() -> str:
    names = sorted({f.lstrip("-").replace("-", "[-_]") for f in VLLM_OWNED_FLAGS})
    long = [n for n in names if len(n) > 2]
    short = [n for n in names if len(n) <= 2]
    return f"^(--({'|'.join(long)})|-({'|'.join(short)}))(=.*)?$"


# An argument that sets one of VLLM_OWNED_FLAGS, in any of vLLM's spellings.
VLLM_OWNED_FLAG_RE: Final = _owned_flags_regex()


def owned_vllm_flag(argument: str) -> str | None:
    """The VLLM_OWNED_FLAGS entry `argument` sets (`--max_model_len=9` sets --max-model-len)."""
    if not re.match(VLLM_OWNED_FLAG_RE, argument):
        return None
    flag = argument.split("=", 1)[0]
    return flag[:2] + flag[2:].replace("_", "-") if flag.startswith("--") else flag


class ComponentType(StrEnum):
    FRONTEND = "frontend"
    WORKER = "worker"  # aggregated: prefill and decode in one engine
    PREFILL = "prefill"
    DECODE = "decode"
    EPP = "epp"


ENGINE_TYPES = frozenset({ComponentType.WORKER, ComponentType.PREFILL, ComponentType.DECODE})
# Pods the InferencePool selects: those that serve requests end to end behind a frontend sidecar.
SERVING_TYPES = frozenset({ComponentType.WORKER, ComponentType.DECODE})
ROUTER_TYPES = frozenset({ComponentType.EPP, ComponentType.FRONTEND})


class Backend(StrEnum):
    MOCK = "mock"
    VLLM = "vllm"


class RouterMode(StrEnum):
    KV = "kv"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"
    LEAST_LOADED = "least-loaded"
    APPROX = "approx"


# What the frontend's own router supports (`dynamograph frontend --mode`).
FRONTEND_MODES = frozenset({RouterMode.KV, RouterMode.ROUND_ROBIN})


class EppTlsMode(StrEnum):
    """How the EPP serves the ext_proc port the gateway connects to."""

    PLAINTEXT = "Plaintext"  # h2c
    SELF_SIGNED = "SelfSigned"  # TLS, a certificate the EPP makes at start (GAIE's default)
    SECRET = "Secret"  # TLS, tls.crt/tls.key of a kubernetes.io/tls Secret, reloaded on change


class FailureMode(StrEnum):
    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


class GraphState(StrEnum):
    PENDING = "pending"
    PROGRESSING = "progressing"
    READY = "ready"
    FAILED = "failed"


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        use_enum_values=True,
        validate_default=True,
    )


def _quantity_text(value: Any) -> Any:
    """YAML writes `cpu: 2` as a number; Kubernetes quantities are strings."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    Field(
        pattern=QUANTITY,
        description="Kubernetes quantity, e.g. `4`, `500m`, `16Gi`",
        # pydantic leaves a pattern behind a BeforeValidator out of the schema: restate it.
        json_schema_extra={"x-kubernetes-int-or-string": True, "pattern": QUANTITY},
    ),
]


def _cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    """An `x-kubernetes-validations` rule: the apiserver refuses what the validators refuse."""
    out: dict[str, Any] = {"rule": rule, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    return out


# Names of Secrets, PersistentVolumeClaims: DNS subdomains.
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


# Where the model cache volume is mounted in engine containers; HF_HOME points there.
MODEL_CACHE_DIR: Final = "/var/cache/huggingface"


class ModelCacheSpec(_Model):
    """The model cache: a PersistentVolumeClaim (any node) or a directory on the node."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.claimName) != has(self.hostPath)",
                    "claimName: set exactly one of claimName and hostPath",
                    ".claimName",
                )
            ]
        }
    )

    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="a PersistentVolumeClaim in the graph's namespace (ReadWriteMany, or "
        "ReadOnlyMany with readOnly, when several pods share it)",
    )
    host_path: str | None = Field(
        default=None,
        min_length=2,
        max_length=4096,
        pattern=r"^/",
        description="a directory on the node (created if absent); Pod Security baseline and "
        "restricted refuse hostPath volumes, so the namespace must allow privileged pods",
    )
    read_only: bool = Field(
        default=False, description="mount read-only (a cache filled beforehand)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelCacheSpec:
        if (self.claim_name is None) == (self.host_path is None):
            raise ValueError("claimName: set exactly one of claimName and hostPath")
        return self


class ModelSpec(_Model):
    """The model every engine of the graph serves."""

    name: str = Field(min_length=1, description="model to load, e.g. Qwen/Qwen3-0.6B")
    served_model_name: str | None = Field(
        default=None,
        min_length=1,
        description="name clients put in the request's `model` field; defaults to `name`",
    )
    tokenizer: str | None = Field(
        default=None,
        min_length=1,
        description="tokenizer spec shared by EPP, frontend and engine: `qwen`, `qwen:<vocabulary>` "
        "or a path to a tokenizer.json; defaults to the Qwen vocabulary of a Qwen model (the "
        "mock backend: for any model). With backend vllm any other model needs it: the path of "
        f"its tokenizer.json, e.g. in the model cache (under {MODEL_CACHE_DIR}, which is then "
        "mounted read-only into the EPP too)",
    )
    cache: ModelCacheSpec | None = Field(
        default=None,
        description="a volume holding the Hugging Face cache, mounted into every engine "
        f"container at {MODEL_CACHE_DIR} with HF_HOME pointing there, so a restarted or added "
        "pod does not download the model again",
    )


class ResourcesSpec(_Model):
    gpu: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="GPUs per pod (`nvidia.com/gpu`); for vllm engines it defaults to "
        "dataParallelSize × tensorParallelSize × pipelineParallelSize and may only be that or 0 "
        "(vLLM's CPU backend); otherwise 0",
    )
    cpu: Quantity | None = Field(default=None, description="CPU request and limit per container")
    memory: Quantity | None = Field(
        default=None, description="memory request and limit per container"
    )


class EnvVar(_Model):
    """A container environment variable, as in a pod spec."""

    name: str = Field(min_length=1, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        default=None,
        description="a Kubernetes EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef, ...)",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set either value or valueFrom, not both")
        return self


_OWNED_FLAG_MESSAGE = (
    " is a flag the operator sets itself; set its DynamoGraph field instead "
    "(docs/operator.md, engine arguments)"
)
# One `vllm serve` argument. The rule is on each item, and items and their count are bounded,
# to keep the apiserver's cost estimate of the regular expression (at most 32 services × 32
# arguments × 192 characters) within its budget.
EngineArgument = Annotated[
    str,
    Field(
        min_length=1,
        max_length=192,
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.matches('{VLLM_OWNED_FLAG_RE}')",
                    "messageExpression": f"'extraArgs: ' + self + '{_OWNED_FLAG_MESSAGE}'",
                    "message": f"extraArgs: an argument{_OWNED_FLAG_MESSAGE}",
                }
            ]
        },
    ),
]


class EngineArgs(_Model):
    """Engine sizing passed to `dynamograph worker` (the mock simulates them; vLLM obeys them)."""

    num_gpu_blocks: int | None = Field(default=None, ge=1, description="KV cache size in blocks")
    max_num_seqs: int | None = Field(default=None, ge=1, description="concurrent sequences")
    max_num_batched_tokens: int | None = Field(
        default=None, ge=1, description="tokens per scheduler step"
    )
    context_length: int | None = Field(default=None, ge=1, description="maximum model length")
    speedup: float | None = Field(
        default=None, gt=0, description="mock only: simulated time runs this many times faster"
    )
    seed: int | None = Field(default=None, ge=0, description="random seed")
    extra_args: list[EngineArgument] = Field(
        default_factory=list,
        max_length=32,
        description="vllm only: arguments appended to `vllm serve` as given (e.g. "
        "`--gpu-memory-utilization=0.92`, `--kv-cache-dtype=fp8`); flags the operator sets "
        "itself are refused, with the field that sets them",
    )

    @field_validator("extra_args")
    @classmethod
    def _not_ours(cls, extra_args: list[str]) -> list[str]:
        for argument in extra_args:
            flag = owned_vllm_flag(argument)
            if flag is not None:
                raise ValueError(
                    f"{argument!r} is a flag the operator sets itself; set it with "
                    f"{VLLM_OWNED_FLAGS[flag]} instead (docs/operator.md, engine arguments)"
                )
        return extra_args


class RouterSpec(_Model):
    """Routing policy of an EPP (or a standalone frontend)."""

    mode: RouterMode = RouterMode.KV
    overlap_weight: float = Field(
        default=1.0,
        ge=0,
        description="weight of the prefill term (uncached prompt blocks plus prefill blocks "
        "queued on the worker) in the routing cost, whose other terms are in blocks to prefill "
        "too (docs/router.md)",
    )
    temperature: float = Field(
        default=0.0, ge=0, description="softmax sampling temperature; 0 picks the best worker"
    )
    enforce_disagg: bool = Field(
        default=False,
        description="refuse (503) instead of serving aggregated when no prefill worker is ready",
    )
    kv_events: bool = Field(
        default=True,
        description="index the engines' KV events (false, or mode approx: assume routed "
        "prefixes are cached for a while)",
    )
    busy_threshold: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="KV usage fraction over which a worker counts as busy; all busy: 503 with "
        "Retry-After (Dynamo's rule, docs/router.md)",
    )
    processes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="epp services: EPP processes per pod (more cores for one pod); they serve "
        "the pod's ports together and share their in-flight bookings, as the pods do with each "
        "other (docs/epp.md, replicas and processes)",
    )
    replica_timeout_seconds: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="epp services: a replica (pod or process) silent this long has its "
        "in-flight bookings dropped from the others' load",
    )
    max_pending_picks: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="epp services and kv-mode frontends: requests admitted and not yet routed, "
        "at most, per process; past it a new request gets 429 with Retry-After at once instead "
        "of queueing (unset: 256)",
    )
    max_loop_lag_seconds: float | None = Field(
        default=None,
        ge=0,
        le=60,
        description="epp services and kv-mode frontends: how far the router's event loop may "
        "run behind (it is short of CPU) before a new request gets 429 with Retry-After at "
        "once; 0: not checked (unset: 0.5)",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="further router settings, written verbatim into the router config file",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )


_IS_SECRET_MODE = "has(self.mode) && self.mode == 'Secret'"


class EppTlsSpec(_Model):
    """TLS on the EPP's ext_proc port. Gateways connect to an endpoint picker with TLS by
    default (GAIE's InferencePool API; kgateway only does TLS), without verifying it unless
    configured to (Istio: a DestinationRule with `tls.mode: SIMPLE`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"!({_IS_SECRET_MODE}) || has(self.secretName)",
                    "secretName: mode Secret needs the name of a kubernetes.io/tls Secret",
                    ".secretName",
                ),
                _cel(
                    f"!has(self.secretName) || ({_IS_SECRET_MODE})",
                    "secretName: only mode Secret uses a Secret",
                    ".secretName",
                ),
            ]
        }
    )

    mode: EppTlsMode = Field(
        default=EppTlsMode.SELF_SIGNED,
        description="SelfSigned (default, as GAIE's EPP): TLS with a certificate made at start; "
        "Secret: TLS with the secretName Secret's tls.crt/tls.key, reloaded when it changes; "
        "Plaintext: h2c, for gateways that connect without TLS",
    )
    secret_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN,
        description="mode Secret: a kubernetes.io/tls Secret in the graph's namespace "
        "(e.g. one cert-manager keeps renewed)",
    )

    @model_validator(mode="after")
    def _secret_for_secret_mode(self) -> EppTlsSpec:
        if self.mode == EppTlsMode.SECRET and self.secret_name is None:
            raise ValueError("secretName: mode Secret needs the name of a kubernetes.io/tls Secret")
        if self.mode != EppTlsMode.SECRET and self.secret_name is not None:
            raise ValueError(f"secretName: only mode Secret uses a Secret, not mode {self.mode}")
        return self


class TolerationEffect(StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"
    NO_EXECUTE = "NoExecute"


class Toleration(_Model):
    """A pod toleration, as in a pod spec (`kubectl explain pod.spec.tolerations`)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "has(self.key) || (has(self.operator) && self.operator == 'Exists')",
                    "key: a toleration without a key needs operator Exists (it tolerates every "
                    "taint)",
                    ".key",
                )
            ]
        }
    )

    key: str | None = Field(default=None, min_length=1, max_length=317)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(default=None, max_length=63)
    effect: TolerationEffect | None = Field(
        default=None, description="absent: tolerate every effect of the taint"
    )
    toleration_seconds: int | None = Field(
        default=None, description="NoExecute only: how long the pod stays once tainted"
    )

    @model_validator(mode="after")
    def _key_or_exists(self) -> Toleration:
        if self.key is None and self.operator != "Exists":
            raise ValueError(
                "key: a toleration without a key needs operator Exists (it tolerates every taint)"
            )
        return self


class MultinodeSpec(_Model):
    """Reserved for engines that span nodes (one replica made of `nodeCount` pods, e.g. a
    LeaderWorkerSet with tensor or pipeline parallelism across them). Not implemented: only
    `nodeCount: 1` is accepted, so a graph written today keeps its meaning when it is."""

    node_count: int = Field(
        default=1,
        ge=1,
        le=1,
        description="nodes per engine replica; reserved, only 1 (one pod per replica) today",
    )


# The startup allowance of an engine when `startupTimeoutSeconds` is absent: vLLM downloads and
# loads weights (tens of minutes for a 70B model on a cold cache); the mock starts in seconds.
DEFAULT_STARTUP_SECONDS: Final = {Backend.VLLM: 1800, Backend.MOCK: 300}

_ENGINE_CEL = "self.componentType in ['worker', 'prefill', 'decode']"
_ADMISSION_NEEDS_KV = (
    "a round-robin frontend picks without a queue and admits every request; set it on a "
    "kv-mode frontend or on the epp"
)


class ServiceSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"!has(self.engine) || {_ENGINE_CEL}",
                    "engine: only worker, prefill and decode services run an engine",
                    ".engine",
                ),
                _cel(
                    "!has(self.router) || self.componentType in ['epp', 'frontend']",
                    "router: only epp and frontend services route",
                    ".router",
                ),
                _cel(
                    f"{_ENGINE_CEL} || !has(self.resources) || !has(self.resources.gpu) "
                    "|| self.resources.gpu == 0",
                    "resources.gpu: only worker, prefill and decode services use GPUs",
                    ".resources",
                ),
                _cel(
                    f"{_ENGINE_CEL} || !has(self.dataParallelSize) || self.dataParallelSize == 1",
                    "dataParallelSize: only worker, prefill and decode services run an engine",
                    ".dataParallelSize",
                ),
                _cel(
                    f"{_ENGINE_CEL} || ((!has(self.tensorParallelSize) || "
                    "self.tensorParallelSize == 1) && (!has(self.pipelineParallelSize) || "
                    "self.pipelineParallelSize == 1))",
                    "tensorParallelSize: only worker, prefill and decode services run an engine",
                    ".tensorParallelSize",
                ),
                _cel(
                    f"{_ENGINE_CEL} || (!has(self.sharedMemory) && !has(self.gpuType) && "
                    "!has(self.startupTimeoutSeconds) && !has(self.multinode))",
                    "sharedMemory, gpuType, startupTimeoutSeconds, multinode: only worker, "
                    "prefill and decode services run an engine",
                ),
                _cel(
                    "!has(self.gpuType) || !has(self.nodeSelector) || "
                    f"!('{GPU_PRODUCT_LABEL}' in self.nodeSelector)",
                    f"gpuType: sets nodeSelector {GPU_PRODUCT_LABEL}; set one of the two",
                    ".gpuType",
                ),
                _cel(
                    "!has(self.tls) || self.componentType == 'epp'",
                    "tls: only epp services serve the gateway's ext_proc connection",
                    ".tls",
                ),
                _cel(
                    "self.componentType != 'frontend' || !has(self.router) "
                    "|| !has(self.router.mode) || self.router.mode in ['kv', 'round-robin']",
                    "router.mode: a frontend routes with kv or round-robin",
                    ".router",
                ),
                _cel(
                    "self.componentType != 'frontend' || !has(self.router) "
                    "|| !has(self.router.mode) || self.router.mode == 'kv' "
                    "|| (!has(self.router.maxPendingPicks) && !has(self.router.maxLoopLagSeconds))",
                    f"router.maxPendingPicks, router.maxLoopLagSeconds: {_ADMISSION_NEEDS_KV}",
                    ".router",
                ),
            ]
        }
    )

    component_type: ComponentType
    replicas: int = Field(default=1, ge=0, le=1024)
    data_parallel_size: int = Field(
        default=1, ge=1, le=64, description="data-parallel ranks per engine pod"
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="vllm: GPUs each data-parallel rank shards the model over "
        "(`--tensor-parallel-size`); the pod's GPU count follows",
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="vllm: pipeline stages per rank (`--pipeline-parallel-size`); the pod's GPU "
        "count follows",
    )
    multinode: MultinodeSpec | None = Field(
        default=None, description="reserved for engines spanning several nodes; nodeCount 1 only"
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    shared_memory: Quantity | None = Field(
        default=None,
        description="engines: size of /dev/shm, an in-memory emptyDir counted against the "
        "pod's memory (NCCL and vLLM's workers exchange data there); default 8Gi for vllm "
        "engines, none for the mock",
    )
    gpu_type: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        description=f"engines: run only on nodes whose {GPU_PRODUCT_LABEL} label is this "
        "(NVIDIA GPU feature discovery's product name, e.g. NVIDIA-H100-80GB-HBM3)",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="the pods' nodeSelector"
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=32,
        description="the pods' tolerations (e.g. of a `nvidia.com/gpu` taint on GPU nodes)",
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="the pods' affinity, a Kubernetes Affinity (nodeAffinity, podAffinity, "
        "podAntiAffinity), checked by the apiserver when the Deployment is applied",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    startup_timeout_seconds: int | None = Field(
        default=None,
        ge=30,
        le=86400,
        description="engines: how long a pod may take to load its model before it is "
        "restarted (the startup probe); the Deployment's progressDeadlineSeconds is this plus "
        "10 minutes for scheduling and pulling. Default 1800 for vllm, 300 for the mock",
    )
    envs: list[EnvVar] = Field(default_factory=list, description="extra container env")
    extra_pod_spec: dict[str, Any] = Field(
        default_factory=dict,
        description="PodSpec fields merged into the generated pod spec (nodeSelector, "
        "tolerations, affinity, volumes, ...); lists are appended",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    image: str | None = Field(
        default=None, min_length=1, description="container image; defaults to the operator's"
    )
    engine: EngineArgs | None = Field(
        default=None, description="engine arguments (worker, prefill and decode services)"
    )
    router: RouterSpec | None = Field(
        default=None, description="routing policy (epp and frontend services)"
    )
    tls: EppTlsSpec | None = Field(
        default=None,
        description="epp services: TLS on the ext_proc port the gateway connects to; "
        "absent means mode SelfSigned",
    )

    @model_validator(mode="after")
    def _fits_component(self) -> ServiceSpec:
        kind = ComponentType(self.component_type)
        if self.engine is not None and kind not in ENGINE_TYPES:
            raise ValueError(
                f"engine: {kind} services run no engine (only worker, prefill and decode do)"
            )
        if self.router is not None and kind not in ROUTER_TYPES:
            raise ValueError(f"router: {kind} services do not route (only epp and frontend do)")
        if self.tls is not None and kind != ComponentType.EPP:
            raise ValueError(f"tls: {kind} services do not serve ext_proc (only epp does)")
        if kind not in ENGINE_TYPES and self.data_parallel_size != 1:
            raise ValueError(f"dataParallelSize: {kind} services run no engine")
        if kind not in ENGINE_TYPES and self.resources.gpu:
            raise ValueError(f"resources.gpu: {kind} services use no GPU")
        if kind not in ENGINE_TYPES and (
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
        ) != (1, 1):
            raise ValueError(f"tensorParallelSize: {kind} services run no engine")
        for field in ("shared_memory", "gpu_type", "startup_timeout_seconds", "multinode"):
            if kind not in ENGINE_TYPES and getattr(self, field) is not None:
                raise ValueError(f"{to_camel(field)}: {kind} services run no engine")
        if self.gpu_type is not None and GPU_PRODUCT_LABEL in self.node_selector:
            raise ValueError(f"gpuType: sets nodeSelector {GPU_PRODUCT_LABEL}; set one of the two")
        if (
            kind == ComponentType.FRONTEND
            and self.router is not None
            and self.router.mode not in FRONTEND_MODES
        ):
            raise ValueError(
                f"router.mode: a frontend routes with kv or round-robin, not {self.router.mode}"
            )
        if kind == ComponentType.FRONTEND and self.router is not None:
            router = self.router
            for field in ("max_pending_picks", "max_loop_lag_seconds"):
                if router.mode != RouterMode.KV and getattr(router, field) is not None:
                    raise ValueError(f"router.{to_camel(field)}: {_ADMISSION_NEEDS_KV}")
        return self

    @property
    def devices(self) -> int:
        """The GPUs an engine's ranks occupy on vLLM: data × tensor × pipeline parallel."""
        return self.data_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size


class ParentRef(_Model):
    """The Gateway the HTTPRoute attaches to (a Gateway API ParentReference)."""

    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(default=None, min_length=1, max_length=63)
    section_name: str | None = Field(default=None, min_length=1, max_length=253)
    group: str = "gateway.networking.k8s.io"
    kind: str = "Gateway"


class GatewaySpec(_Model):
    parent_ref: ParentRef | None = Field(
        default=None, description="attach an HTTPRoute to this Gateway"
    )
    failure_mode: FailureMode = Field(
        default=FailureMode.FAIL_CLOSE,
        description="what the gateway does when the EPP does not answer",
    )
    hostnames: list[str] = Field(
        default_factory=list,
        description="the HTTPRoute's hostnames (empty: every hostname of the Gateway's listener)",
    )
    request_timeout: str = Field(
        default="0s",
        pattern=r"^([0-9]{1,5}(h|m|s|ms)){1,4}$",
        description="the HTTPRoute's request timeout, a Gateway API duration; 0s disables it "
        "(the default: a generation streams for minutes, and gateways that apply a default cut "
        "it at 15 s)",
    )


class KvEventsSpec(_Model):
    """How the engines' KV-event and replay sockets are secured (docs/security.md)."""

    curve: bool = Field(
        default=False,
        description="ZMQ CURVE on the KV-event and replay sockets: encrypted, and only the "
        "graph's EPP and kv-mode frontends (holding its client key) may subscribe; the operator "
        "creates the Secret `<graph>-kv-curve` with the graph's keys once and mounts it into "
        "them and every engine. For clusters that do not enforce NetworkPolicy; mock backend "
        "only (vLLM's KV-event publisher has no CURVE option)",
    )


def _services_with(kinds: str) -> str:
    return f"self.services.exists(k, self.services[k].componentType in [{kinds}])"


def _service_field(name: str, default: int) -> str:
    """A service's integer field in a CEL rule over `self.services[k]`, its default if absent."""
    return f"(has(self.services[k].{name}) ? self.services[k].{name} : {default})"


_VLLM_GPUS_CEL = " * ".join(
    _service_field(f, 1) for f in ("dataParallelSize", "tensorParallelSize", "pipelineParallelSize")
)
_SCALABLE = "'worker', 'decode'"
# vLLM's KV-event publisher (its own ZMQ sockets) has no CURVE option; `dynamograph worker
# --engine vllm` refuses --kv-curve-dir, so the graph refuses the field before any pod fails.
_VLLM_CURVE = (
    "kvEvents.curve: vLLM's KV-event publisher has no CURVE option; with backend vllm leave "
    "kvEvents.curve off and keep other pods away from the event ports with NetworkPolicy "
    "(the chart's networkPolicy.enabled; docs/security.md)"
)


_ROUTER_DOCUMENT = (
    "engineConfig: the engine document is read by the graph's routers (it describes the workers "
    "they find that serve no /v1/engine): the graph needs an epp or a frontend service"
)


class DynamoGraphSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    _services_with("'worker', 'decode'"),
                    "services: the graph needs a worker (aggregated) or decode service",
                    ".services",
                ),
                _cel(
                    "size(self.services.filter(k, self.services[k].componentType == 'epp')) <= 1",
                    "services: at most one epp service per graph",
                    ".services",
                ),
                _cel(
                    "!" + _services_with("'prefill'") + " || " + _services_with("'decode'"),
                    "services: a prefill service needs a decode service to hand off to",
                    ".services",
                ),
                _cel(
                    "!has(self.gateway) || !has(self.gateway.parentRef) || "
                    + _services_with("'epp'"),
                    "gateway.parentRef: routing through a gateway needs an epp service",
                    ".gateway",
                ),
                _cel(
                    "self.backend == 'vllm' || self.services.all(k, "
                    f"{_service_field('tensorParallelSize', 1)} == 1 && "
                    f"{_service_field('pipelineParallelSize', 1)} == 1 && "
                    "(!has(self.services[k].engine) || !has(self.services[k].engine.extraArgs) "
                    "|| size(self.services[k].engine.extraArgs) == 0))",
                    "backend: tensorParallelSize, pipelineParallelSize and engine.extraArgs "
                    "are vllm settings; the mock backend simulates one device per rank",
                    ".backend",
                ),
                _cel(
                    "self.backend != 'vllm' || self.services.all(k, "
                    f"!(self.services[k].componentType in ['worker', 'prefill', 'decode']) || "
                    "!has(self.services[k].resources) || !has(self.services[k].resources.gpu) "
                    "|| self.services[k].resources.gpu == 0 "
                    f"|| self.services[k].resources.gpu == {_VLLM_GPUS_CEL})",
                    "services: a vllm engine pod uses dataParallelSize × tensorParallelSize × "
                    "pipelineParallelSize GPUs; leave resources.gpu out, or set it to that or to "
                    "0 (vLLM's CPU backend)",
                    ".services",
                ),
                _cel(
                    "self.backend != 'vllm' || !has(self.kvEvents) || !has(self.kvEvents.curve) "
                    "|| !self.kvEvents.curve",
                    _VLLM_CURVE,
                    ".kvEvents",
                ),
                _cel(
                    # `tokenization.tokenizer_for_model`'s rule: a Qwen model's vocabulary ships
                    "self.backend != 'vllm' || has(self.model.tokenizer) "
                    "|| self.model.name.matches('(?i)qwen')",
                    "model.tokenizer: with backend vllm a model other than Qwen's names its "
                    "tokenizer (the path of its tokenizer.json): dynamograph ships only Qwen's "
                    "vocabularies",
                    ".model.tokenizer",
                ),
                _cel(
                    "!has(self.engineConfig) || " + _services_with("'epp', 'frontend'"),
                    _ROUTER_DOCUMENT,
                    ".engineConfig",
                ),
                _cel(
                    "!has(self.scaleTarget) || self.scaleTarget in self.services",
                    "scaleTarget: must name a service of the graph",
                    ".scaleTarget",
                ),
                _cel(
                    "!has(self.replicas) || has(self.scaleTarget) || size(self.services.filter("
                    f"k, self.services[k].componentType in [{_SCALABLE}])) == 1",
                    "replicas: the graph has several worker/decode services; name the one "
                    "spec.replicas scales in scaleTarget",
                    ".replicas",
                ),
            ]
        }
    )

    model: ModelSpec
    backend: Backend = Backend.MOCK
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="tokens per KV block")
    services: dict[str, ServiceSpec] = Field(
        min_length=1,
        max_length=32,
        description="service name -> service; each becomes a Deployment `<graph>-<name>`",
    )
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    kv_events: KvEventsSpec = Field(
        default_factory=KvEventsSpec,
        description="security of the engines' KV-event stream (off: plaintext, kept to the "
        "graph's pods by NetworkPolicy)",
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="replicas of the scale target service, in place of its own "
        "services.<name>.replicas; the field `kubectl scale dg/NAME` and a "
        "HorizontalPodAutoscaler set (the /scale subresource)",
    )
    scale_target: str | None = Field(
        default=None,
        min_length=1,
        max_length=40,
        description="the service `replicas` and the /scale subresource scale; default: the "
        "graph's only worker or decode service",
    )
    engine_config: EngineTemplateFields | None = Field(  # type: ignore[valid-type]
        default=None,
        description="the engine document of workers that serve no /v1/engine (engines we did "
        "not launch: unmodified vLLM, llm-d-inference-sim): EngineConfig fields under their own "
        "snake_case names (model, kv_cache_block_size, tokenizer, kv_events, ...), as the EPP's "
        "--engine-config file (docs/epp.md, engines we did not launch); model, "
        "served_model_name, kv_cache_block_size and tokenizer default to the graph's. The "
        "operator writes it into the ConfigMap `<graph>-engine-config` and gives it to the EPP "
        "and the standalone frontend services, which find workers too",
    )

    @field_validator("services")
    @classmethod
    def _service_names(cls, services: dict[str, ServiceSpec]) -> dict[str, ServiceSpec]:
        for name in services:
            if not re.match(DNS_LABEL, name) or len(name) > 40:
                raise ValueError(
                    f"service name {name!r} must be a DNS label: lower-case letters, digits and "
                    "'-', starting with a letter, at most 40 characters"
                )
        return services

    @model_validator(mode="after")
    def _graph_shape(self) -> DynamoGraphSpec:
        kinds = [ComponentType(s.component_type) for s in self.services.values()]
        if not any(k in SERVING_TYPES for k in kinds):
            raise ValueError(
                "services: the graph needs a worker (aggregated) or decode service to serve requests"
            )
        if kinds.count(ComponentType.EPP) > 1:
            raise ValueError("services: at most one epp service per graph")
        if ComponentType.PREFILL in kinds and ComponentType.DECODE not in kinds:
            raise ValueError("services: a prefill service needs a decode service to hand off to")
        if self.gateway.parent_ref is not None and ComponentType.EPP not in kinds:
            raise ValueError("gateway.parentRef: routing through a gateway needs an epp service")
        if self.backend != Backend.VLLM:
            for name, spec in self.services.items():
                engine = spec.engine
                if (spec.tensor_parallel_size, spec.pipeline_parallel_size) != (1, 1) or (
                    engine is not None and engine.extra_args
                ):
                    raise ValueError(
                        f"spec.services.{name}: tensorParallelSize, pipelineParallelSize and "
                        "engine.extraArgs are vllm settings; the mock backend simulates one "
                        "device per rank"
                    )
        for name, spec in self.services_of(*ENGINE_TYPES).items():
            want = spec.devices
            if self.backend == Backend.VLLM and spec.resources.gpu not in (None, 0, want):
                raise ValueError(
                    f"spec.services.{name}.resources.gpu: a vllm engine pod uses "
                    f"dataParallelSize × tensorParallelSize × pipelineParallelSize = {want} "
                    f"GPUs, not {spec.resources.gpu}; leave resources.gpu out, or set it to "
                    f"{want} or to 0 (vLLM's CPU backend)"
                )
        if self.backend == Backend.VLLM and self.model.tokenizer is None:
            from .tokenization import tokenizer_for_model  # heavy: only when needed

            try:
                tokenizer_for_model(self.model.name)
            except ValueError as exc:
                raise ValueError(f"model.tokenizer: {exc}") from None
        if self.backend == Backend.VLLM and self.kv_events.curve:
            raise ValueError(_VLLM_CURVE)
        if self.scale_target is not None and self.scale_target not in self.services:
            raise ValueError(
                f"scaleTarget: {self.scale_target!r} is not a service of the graph "
                f"(services: {', '.join(self.services)})"
            )
        routers = {ComponentType.EPP, ComponentType.FRONTEND}
        if self.engine_config is not None and not routers.intersection(kinds):
            raise ValueError(_ROUTER_DOCUMENT)
        if self.engine_config is not None:
            try:
                EngineTemplate.checked(self.engine_document(), source="engineConfig")
            except ValidationError as exc:  # what EngineConfig refuses in the merged document
                first = exc.errors()[0]
                raise ValueError(
                    f"engineConfig.{error_path(tuple(first['loc']))}: {first['msg']}"
                ) from None
        target = self.scale_target_service
        if self.replicas is not None:
            if target is None:
                raise ValueError(
                    "replicas: the graph has several worker/decode services; name the one "
                    "spec.replicas scales in scaleTarget"
                )
            self.services[target].replicas = self.replicas
        return self

    def engine_document(self) -> dict[str, Any] | None:
        """`engineConfig` as the EPP's `--engine-config` document: the fields given, over the
        graph's model, served model name, KV block size and tokenizer. None without it."""
        if self.engine_config is None:
            return None
        document: dict[str, Any] = {
            "model": self.model.name,
            "served_model_name": self.served_model_name,
            "kv_cache_block_size": self.kv_block_size,
        }
        if self.model.tokenizer is not None:
            document["tokenizer"] = self.model.tokenizer
        given = self.engine_config.model_dump(mode="json", exclude_unset=True)
        return {**document, **given}

    @property
    def scale_target_service(self) -> str | None:
        """The service `replicas` and /scale act on: `scaleTarget`, else the only worker or
        decode service (None when there are several)."""
        if self.scale_target is not None:
            return self.scale_target
        serving = list(self.services_of(*SERVING_TYPES))
        return serving[0] if len(serving) == 1 else None

    def gpus(self, spec: ServiceSpec) -> int:
        """GPUs per pod of a service: `resources.gpu`, else for a vllm engine one per device of
        its ranks (data × tensor × pipeline parallel), else none."""
        if spec.resources.gpu is not None:
            return spec.resources.gpu
        if self.backend == Backend.VLLM and spec.component_type in ENGINE_TYPES:
            return spec.devices
        return 0

    def startup_seconds(self, spec: ServiceSpec) -> int:
        """How long an engine may take to start (its startup probe's allowance)."""
        if spec.startup_timeout_seconds is not None:
            return spec.startup_timeout_seconds
        return DEFAULT_STARTUP_SECONDS[Backend(self.backend)]

    def services_of(self, *kinds: ComponentType) -> dict[str, ServiceSpec]:
        return {n: s for n, s in self.services.items() if s.component_type in kinds}

    @property
    def served_model_name(self) -> str:
        return self.model.served_model_name or self.model.name


class GraphMetadata(BaseModel):
    """The part of ObjectMeta the graph's validation looks at (the rest is kept, not checked)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=40, pattern=DNS_LABEL)
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


class ServiceStatus(_Model):
    replicas: int = Field(default=0, ge=0, description="desired replicas")
    ready_replicas: int = Field(default=0, ge=0)
    updated_replicas: int = Field(default=0, ge=0, description="pods on the current template")
    available_replicas: int = Field(default=0, ge=0)


class Condition(_Model):
    type: Literal[
        "Ready", "Available", "Progressing", "Degraded", "GatewayAccepted", "EndpointAssigned"
    ]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
    message: str = ""
    last_transition_time: str | None = Field(default=None, description="RFC 3339 time")
    observed_generation: int | None = Field(default=None, ge=0)


class ScaleStatus(_Model):
    """What the /scale subresource reads: the scale target service's pods and their selector."""

    service: str = Field(description="the scale target service")
    replicas: int = Field(default=0, ge=0, description="its pods (the Deployment's replicas)")
    selector: str = Field(
        description="label selector of its pods, as a string (what an HPA's metrics select)"
    )


class DynamoGraphStatus(_Model):
    observed_generation: int | None = Field(default=None, ge=0)
    state: GraphState = GraphState.PENDING
    conditions: list[Condition] = Field(default_factory=list)
    services: dict[str, ServiceStatus] = Field(default_factory=dict)
    replicas: int = Field(default=0, ge=0, description="desired pods over all services")
    ready_replicas: int = Field(default=0, ge=0, description="ready pods over all services")
    endpoint: str | None = Field(
        default=None,
        description="the OpenAI base URL a client can curl: the Gateway's address when the graph "
        "attaches to one, else the standalone frontend's in-cluster Service; absent while there "
        "is none (the EndpointAssigned condition says why)",
    )
    scale: ScaleStatus | None = Field(
        default=None, description="the scale target service, for the /scale subresource"
    )


class DynamoGraph(_Model):
    """A whole DynamoGraph object, as `kubectl apply` sends it."""

    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        populate_by_name=True,
        use_enum_values=True,
        validate_default=True,
    )

    api_version: Literal["dynamograph.io/v1alpha1"] = API_VERSION
    kind: Literal["DynamoGraph"] = KIND
    metadata: GraphMetadata
    spec: DynamoGraphSpec
    status: DynamoGraphStatus | None = None

    @model_validator(mode="after")
    def _names_fit(self) -> DynamoGraph:
        for service in self.spec.services:
            name = f"{self.metadata.name}-{service}"
            if len(name) > MAX_OBJECT_NAME:
                raise ValueError(
                    f"spec.services.{service}: object name {name!r} is longer than "
                    f"{MAX_OBJECT_NAME} characters; shorten the graph or service name"
                )
        return self

    @property
    def name(self) -> str:
        return self.metadata.name


class GraphError(ValueError):
    """A DynamoGraph that does not validate; `errors` are (field path, message) pairs."""

    def __init__(self, errors: list[tuple[str, str]], source: str = "DynamoGraph"):
        self.errors = errors
        self.source = source
        lines = "\n".join(f"  {path}: {message}" for path, message in errors)
        super().__init__(f"{source} is invalid:\n{lines}")

    @property
    def field(self) -> str:
        """The first offending field path (what an Event or condition names)."""
        return self.errors[0][0]


def error_path(location: tuple[int | str, ...]) -> str:
    """pydantic's error location as a field path: `spec.services.decode.envs[0].name`.

    Locations already use the wire (camelCase) names, because input is validated by alias.
    """
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".")


def validation_errors(exc: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for err in exc.errors():
        # Model validators report at the model's location; their message may start with the
        # sub-field they mean ("replicas: ..."), which we fold into the path.
        path = error_path(tuple(err["loc"]))
        message = err["msg"].removeprefix("Value error, ")
        head, sep, rest = message.partition(": ")
        if sep and re.match(r"^[A-Za-z][A-Za-z0-9_.]*$", head) and err["type"] == "value_error":
            if head.startswith("spec."):
                path, message = head, rest
            else:
                path, message = f"{path}.{head}" if path else head, rest
        if prefix:
            path = f"{prefix}.{path}" if path else prefix
        out.append((path, message))
    return out


def load_graph(source: str | Path | dict[str, Any]) -> DynamoGraph:
    """Validate a DynamoGraph from a YAML file path or an already-parsed dict.

    Raises GraphError whose message names every offending field, e.g.
    `spec.services.decode.replicas: Input should be greater than or equal to 0`.
    """
    label = "DynamoGraph"
    if isinstance(source, str | Path):
        label = str(source)
        try:
            text = Path(source).read_text()
        except OSError as exc:
            raise GraphError([("", f"cannot read: {exc.strerror}")], label) from None
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise GraphError([("", f"not valid YAML: {exc}")], label) from None
        if len(docs) != 1:
            raise GraphError([("", f"expected one YAML document, found {len(docs)}")], label)
        data = docs[0]
    else:
        data = source
    if not isinstance(data, dict):
        raise GraphError([("", "a DynamoGraph is a mapping with apiVersion, kind, metadata, spec")])
    try:
        return DynamoGraph.model_validate(data)
    except ValidationError as exc:
        raise GraphError(validation_errors(exc), label) from None
