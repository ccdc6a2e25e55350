"""The field's own endpoint pickers as `bench route` policies: GAIE's reference EPP and llm-d's
inference scheduler, each behind the same real Envoy our EPP policies use.

Neither EPP has a static list of endpoints: both watch a Kubernetes API server for the pods
they may pick. So a policy here starts, in order:

1. the repo's control plane (tests/cluster/controlplane.py: etcd, kube-apiserver, kwok with pod
   IPs from 127.1.0.0/16, loaded by path: it is a self-contained script, not a package);
2. one Pod per worker of the benchmark's fleet, on a kwok Node, which kwok makes Running and
   Ready with its own 127.1.x.y address;
3. a twin of each fleet worker (the same command, the same seed and name) bound at its Pod's
   IP on one shared target port, since a pool has one target port for every pod and the fleet's
   workers share 127.0.0.1 on a port each; Linux routes all of 127/8 to lo;
4. GAIE's CRDs from Go's module cache (config/crd/bases of the pinned GAIE module) and an
   InferencePool selecting those pods, then the EPP watching it (`--pool-name`), plain-text
   gRPC, KUBECONFIG pointing at the control plane. (The standalone mode, `--endpoint-selector`
   without a pool, does not start in GAIE v1.5.0: its flag check forbids --pool-name beside the
   selector, and its datastore setup then refuses the empty pool name.)
5. Envoy from local/envoy.py's gateway config with the settings the gateways generate for a
   foreign EPP (COUNTERPARTS.md): request and response bodies FULL_DUPLEX_STREAMED (ours sets the
   response body to NONE, which only our EPP is written for), headers and trailers SEND.
6. for `llmd-precise`, llm-d's precise prefix-cache scorer as llm-d deploys it: its shipped
   configuration (`precise_config`) with pod discovery, so it subscribes to every Pod's KV
   events at `tcp://<pod IP>:<one port>`; the twins publish there with the topic
   `kv@<IP>:<port>@<model>` (`kv_topic`: the scorer keys its scores by `<IP>:<port>`, and takes
   the pod from the topic); prompts are tokenized through llm-d's tokenizer service contract,
   served by bench/llmd_tokenizer.py with the workers' tokenizer (llm-d's own service needs
   vLLM's CPU wheels), whose CPU counts as the EPP's.

`serve_foreign_epp(policy_name, counterpart, workers, ports, logs, model=...)` yields a `Routed`:
the gateway's URL, the twin workers (what the benchmark must reset and scrape), the EPP's pid
(its CPU time) and its metrics page. It never starts `workers` themselves, only their twins.
`unavailable(counterpart)` says why a policy cannot run here (a binary not built), or None.
Its pieces serve `bench epp`'s foreign comparison too (bench/epp.py drives the EPPs' gRPC port
itself, no Envoy): `pool_of_pods(app, names, target_port, logs)` (steps 1, 2 and 4: yields a
`Pool` with the pods' IPs), `precise_scorer(...)` (step 6's tokenizer and configuration) and
`start_foreign_epp(counterpart, pool, ...)` (the EPP watching it).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib.util
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import yaml

from dynamograph.local.procs import PortPool
from dynamograph.protocol.tokenization import tokenizer_for_model

from . import counterparts
from .route_client import completion_body
from .route_fleet import OFFLINE_ENV, LaunchError, Proc, Worker, stop_all, wait_http
from .route_routers import Routed

CONTROL_PLANE_SCRIPT = counterparts.REPO / "tests" / "cluster" / "controlplane.py"
NAMESPACE = "default"
# llm-d's scheduler without a --config-file runs GAIE's default plugins; the configuration its
# own repository ships for a pool without prefill/decode split is this file of the module (read
# from Go's module cache, where the build left it).
LLMD_CONFIG = Path("deploy") / "config" / "epp-config.yaml"
# ... and the one it ships for its precise prefix-cache scorer (KV events, tokenized prompts)
LLMD_PRECISE_CONFIG = Path("deploy") / "config" / "epp-precise-prefix-cache-config.yaml"
KV_CACHE_MODULE = "github.com/llm-d/llm-d-kv-cache"
LLMD_TOKENIZER_PROTO = Path("api") / "tokenizerpb" / "tokenizer.proto"
PRECISE_SCORER = "precise-prefix-cache-scorer"
LLMD_TOKENIZER_WORKERS = 5
# InferencePool (inference.networking.k8s.io/v1) and the x-k8s.io kinds the EPP also watches
# (InferenceObjective, InferenceModelRewrite), from the pinned GAIE module; both EPPs use them.
CRDS = Path("config") / "crd" / "bases"


@dataclass
class PodWorker(Worker):
    """A fleet worker's twin, listening at its Pod's IP."""

    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def _control_plane() -> ModuleType:
    """tests/cluster/controlplane.py as a module (registered first: its dataclasses look their
    module up in sys.modules)."""
    name = "dynamograph_bench_controlplane"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, CONTROL_PLANE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _module_dir(counterpart: str) -> Path:
    """Where Go's module cache holds the counterpart's module source (its shipped configs)."""
    pinned = counterparts.versions()
    prefix = counterparts.PREFIXES[counterpart]
    return _module_source(pinned[f"{prefix}_MODULE"], pinned[f"{prefix}_VERSION"])


def _kv_cache_proto() -> Path:
    """llm-d's tokenizer service contract, in the llm-d-kv-cache version the pinned scheduler
    is built against (its replace in scripts/counterparts.versions)."""
    replaces = counterparts.versions().get("LLMD_EPP_REPLACE", "")
    for replace in filter(None, replaces.split(",")):
        old, new = replace.split("=", 1)
        if old == KV_CACHE_MODULE:
            module, version = new.split("@", 1)
            return _module_source(module, version) / LLMD_TOKENIZER_PROTO
    raise LaunchError(f"no {KV_CACHE_MODULE} replace pinned for llmd-epp (LLMD_EPP_REPLACE)")


def _module_source(module: str, version: str) -> Path:
    cache = os.environ.get("GOMODCACHE") or os.path.join(
        os.environ.get("GOPATH") or os.path.expanduser("~/go"), "pkg", "mod"
    )
    # The module cache escapes capitals as !lower (module.EscapePath).
    escaped = "".join(f"!{c.lower()}" if c.isupper() else c for c in module)
    return Path(cache) / f"{escaped}@{version}"


def unavailable(counterpart: str, *, precise: bool = False) -> str | None:
    """Why the policy of `counterpart` ("gaie-epp", "llmd-epp"; `precise`: llm-d's precise
    prefix-cache configuration) cannot run here, else None."""
    if counterparts.binary(counterpart) is None:
        return f"{counterpart} is not built for its pinned version (make counterparts)"
    try:
        _control_plane().find_binaries()
    except Exception as exc:  # controlplane.Missing: the script is loaded by path, not imported
        return f"{exc} (make control-plane)"
    if counterpart == "llmd-epp" and not (_module_dir(counterpart) / LLMD_CONFIG).is_file():
        return f"llm-d's {LLMD_CONFIG} is not in Go's module cache ({_module_dir(counterpart)})"
    if precise:
        for path in (_module_dir(counterpart) / LLMD_PRECISE_CONFIG, _kv_cache_proto()):
            if not path.is_file():
                return f"{path} is not in Go's module cache (make counterparts)"
        if importlib.util.find_spec("grpc_tools") is None:
            return "grpcio-tools is not installed (it compiles llm-d's tokenizer.proto)"
    if not list((_module_dir("gaie-epp") / CRDS).glob("*.yaml")):
        return f"GAIE's CRDs are not in Go's module cache ({_module_dir('gaie-epp') / CRDS})"
    return None


def _pool(name: str, port: int) -> dict:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "targetPorts": [{"number": port}],
            # a gateway would route ext_proc to this Service; here Envoy is told the address
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
        },
    }


def _pod(name: str, app: str, node: str, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            # llm-d's decode filter keeps pods of role decode (or without the label)
            "labels": {"app": app, "llm-d.ai/role": "decode"},
        },
        "spec": {
            "nodeName": node,  # a kwok Node: kwok runs the pod's lifecycle, no scheduler needed
            "containers": [
                {
                    "name": "engine",
                    "image": "dynamograph-mock-worker",
                    "ports": [{"containerPort": port, "name": "http"}],
                }
            ],
        },
    }


def _ready_ips(cp, app: str, count: int) -> dict[str, str] | None:
    pods = cp.get_json("pods", "-n", NAMESPACE, "-l", f"app={app}")["items"]
    ips = {}
    for pod in pods:
        status = pod.get("status", {})
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions", [])
        )
        if ready and status.get("podIP"):
            ips[pod["metadata"]["name"]] = status["podIP"]
    return ips if len(ips) == count else None


def _twin(
    worker: Worker, host: str, port: int, events: int, logs: Path, topic: str | None = None
) -> PodWorker:
    """The fleet worker's command, bound at `host:port` with its KV events on `events` (and
    `topic` on every batch, when given)."""
    moved = {
        "--host": host,
        "--port": str(port),
        "--kv-events-port": str(events),
        "--kv-replay-port": str(events + 1),
    }
    argv = []
    for arg in worker.proc.argv:
        key = arg.split("=", 1)[0]
        argv.append(f"{key}={moved[key]}" if key in moved else arg)
    if topic is not None:
        argv.append(f"--kv-events-topic={topic}")
    proc = Proc(f"{worker.name}-pod", argv, logs / f"{worker.name}.log")
    return PodWorker(worker.name, port, events, proc, host=host)


def _epp_argv(
    counterpart: str,
    binary: Path,
    pool: str,
    grpc: int,
    health: int,
    metrics: int,
    config: Path | None = None,
) -> list[str]:
    argv = [
        str(binary),
        f"--grpc-port={grpc}",
        f"--grpc-health-port={health}",
        f"--metrics-port={metrics}",
        f"--pool-name={pool}",
        f"--pool-namespace={NAMESPACE}",
        "--secure-serving=false",  # plain-text gRPC: Envoy's EPP cluster speaks h2c
        "--metrics-endpoint-auth=false",
        "--tracing=false",
    ]
    if counterpart == "llmd-epp":
        argv.append(f"--config-file={config or _module_dir(counterpart) / LLMD_CONFIG}")
    return argv


def precise_config(
    shipped: dict[str, Any],
    *,
    model: str,
    block_size: int,
    tokenizer_socket: Path,
    events_port: int,
    app: str,
) -> dict[str, Any]:
    """llm-d's shipped precise prefix-cache configuration (its plugins and weights as they
    are) pointed at this pool: the workers' block size, the model whose KV events count,
    prompts tokenized through `tokenizer_socket`, and a KV-event subscriber per Pod of `app`
    at `tcp://<pod IP>:<events_port>` (its pod discovery, as llm-d deploys it)."""
    config = copy.deepcopy(shipped)
    for plugin in config.get("plugins", []):
        if plugin.get("type") != PRECISE_SCORER:
            continue
        parameters = plugin.setdefault("parameters", {})
        parameters.setdefault("tokenProcessorConfig", {})["blockSize"] = block_size
        parameters.setdefault("indexerConfig", {})["tokenizersPoolConfig"] = {
            "modelName": model,
            # kv-cache v0.9.0's default when it makes the pool itself; a pool given here
            # without a count has no workers and every request waits for its tokens forever
            "workersCount": LLMD_TOKENIZER_WORKERS,
            "uds": {"socketFile": str(tokenizer_socket)},
        }
        parameters["kvEventsConfig"] = {
            "topicFilter": "kv@",
            "discoverPods": True,
            "podDiscoveryConfig": {
                "podLabelSelector": f"app={app}",
                "podNamespace": NAMESPACE,
                "socketPort": events_port,
            },
        }
        return config
    raise LaunchError(f"llm-d's {LLMD_PRECISE_CONFIG} has no {PRECISE_SCORER} plugin")


def kv_topic(ip: str, port: int, model: str) -> str:
    """The topic a worker's KV events carry for llm-d: `kv@<pod>@<model>`, the pod named as the
    scorer names endpoints (`<IP>:<port>`), so its index's scores reach them."""
    return f"kv@{ip}:{port}@{model}"


def _flag(argv: Sequence[str], name: str) -> str:
    for arg in argv:
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    raise LaunchError(f"the workers' command has no {name}")


@contextlib.asynccontextmanager
async def llmd_tokenizer(model: str, logs: Path) -> AsyncIterator[tuple[Proc, Path]]:
    """llm-d's tokenizer service contract (bench/llmd_tokenizer.py) on a Unix socket, with the
    workers' tokenizer; yields the process and its socket; stops it on exit."""
    with tempfile.TemporaryDirectory(prefix="llmd-tok-") as folder:  # a short socket path
        socket = Path(folder) / "tokenizer.sock"
        proc = Proc(
            "llmd-tokenizer",
            [
                sys.executable, "-m", "dynamograph.bench.llmd_tokenizer",
                f"--socket={socket}", f"--proto={_kv_cache_proto()}",
                f"--tokenizer={tokenizer_for_model(model, simulated=True)}",
            ],
            logs / "llmd-tokenizer.log",
            OFFLINE_ENV,
        ).start()  # fmt: skip
        try:
            await _poll(lambda: socket.exists() or not proc.alive(), 60, "no tokenizer socket")
            if not proc.alive():
                raise proc.failure("exited before it served")
            yield proc, socket
        finally:
            await asyncio.to_thread(stop_all, [proc])


@contextlib.asynccontextmanager
async def precise_scorer(
    name: str, *, model: str, block_size: int, events_port: int, app: str, logs: Path
) -> AsyncIterator[tuple[Path, int]]:
    """llm-d's precise prefix-cache scorer made ready for the pods of `app` (module docstring,
    step 6): its tokenizer service started and its configuration (`precise_config`) written;
    yields (that configuration's file, the tokenizer's pid: llm-d's tokenizing is its EPP's CPU
    too); stops the tokenizer on exit."""
    async with llmd_tokenizer(model, logs) as (tokenizer, socket):
        assert tokenizer.popen is not None
        shipped = yaml.safe_load((_module_dir("llmd-epp") / LLMD_PRECISE_CONFIG).read_text())
        config = logs / f"{name}-config.yaml"
        config.write_text(
            yaml.safe_dump(
                precise_config(
                    shipped,
                    model=model,
                    block_size=block_size,
                    tokenizer_socket=socket,
                    events_port=events_port,
                    app=app,
                )
            )
        )
        yield config, tokenizer.popen.pid


def gateway_config(
    listen_port: int, admin_port: int, epp_address: str, access_log: str | None = None
) -> dict:
    """Our gateway config with the body modes every gateway generates for an InferencePool's
    EPP: request and response FULL_DUPLEX_STREAMED (ours sends no response body to our EPP)."""
    from dynamograph.local.envoy import envoy_config

    return envoy_config(
        listen_port,
        admin_port,
        epp_address,
        access_log=access_log,
        processing_mode={
            "request_body_mode": "FULL_DUPLEX_STREAMED",
            "response_body_mode": "FULL_DUPLEX_STREAMED",
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
    )


async def _wait_routed(epp: Proc, url: str, model: str, count: int, within_s: float) -> None:
    """Until `count` completions in a row answer 200 through the gateway: the EPP has listed
    the pods and scraped their metrics (before that it answers 503 or 429)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    body = completion_body(model, "Ready?", 1)
    ok, last = 0, ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while ok < count:
            if not epp.alive():
                raise epp.failure("exited before it routed a request")
            if loop.time() > deadline:
                raise epp.failure(f"routed no request within {within_s:.0f} s (last: {last})")
            try:
                async with session.post(
                    url + "/v1/completions", data=body, headers={"content-type": "application/json"}
                ) as resp:
                    last = f"{resp.status} {(await resp.text())[:200]}"
                    ok = ok + 1 if resp.status == 200 else 0
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, last = 0, repr(exc)
            if ok < count:
                await asyncio.sleep(0.3)


@dataclass
class Pool:
    """An InferencePool `app` on a running control plane, one Ready Pod per name."""

    control_plane: Any  # tests/cluster/controlplane.py's ControlPlane (loaded by path)
    app: str
    target_port: int
    ips: dict[str, str]  # pod name -> its IP (127.1.x.y)

    @property
    def endpoints(self) -> set[str]:
        """The pods' `ip:port`s: what a destination header may name."""
        return {f"{ip}:{self.target_port}" for ip in self.ips.values()}


@contextlib.asynccontextmanager
async def pool_of_pods(
    app: str, names: Sequence[str], target_port: int, logs: Path
) -> AsyncIterator[Pool]:
    """The control plane started, GAIE's CRDs, an InferencePool `app` with `target_port`, and one
    Pod per name that kwok made Ready (module docstring, steps 1, 2 and 4); the control plane is
    stopped on exit. Nothing listens at the pods' IPs: the caller starts what should."""
    cp = _control_plane().ControlPlane((logs / "control-plane").resolve(), nodes=1)
    await asyncio.to_thread(cp.start)
    try:
        crds = sorted((_module_dir("gaie-epp") / CRDS).glob("*.yaml"))
        await asyncio.to_thread(
            cp.kubectl, "apply", "--server-side", *(f"--filename={c}" for c in crds)
        )
        await asyncio.to_thread(
            cp.kubectl, "wait", "--for=condition=Established", "--timeout=60s",
            *(f"--filename={c}" for c in crds),
        )  # fmt: skip
        cp.kubectl_apply(_pool(app, target_port))
        for name in names:
            cp.kubectl_apply(_pod(name, app, "kwok-node-0", target_port))
        ips = await _poll(lambda: _ready_ips(cp, app, len(names)), 60, "kwok made no pod ready")
        yield Pool(cp, app, target_port, ips)
    finally:
        await asyncio.to_thread(cp.stop)


async def start_foreign_epp(
    counterpart: str,
    pool: Pool,
    grpc: int,
    health: int,
    metrics: int,
    log: Path,
    config: Path | None = None,
) -> Proc:
    """The counterpart's EPP watching `pool` (plain-text gRPC on `grpc`; llm-d's with `config`,
    else its shipped default), once its metrics page answers; the caller stops it."""
    binary = counterparts.binary(counterpart)
    if binary is None:
        raise LaunchError(f"{counterpart}: {unavailable(counterpart)}")
    epp = Proc(
        f"{counterpart}-epp",
        _epp_argv(counterpart, binary, pool.app, grpc, health, metrics, config),
        log,
        {"KUBECONFIG": str(pool.control_plane.kubeconfig)},
    ).start()
    try:
        await wait_http(epp, f"http://127.0.0.1:{metrics}/metrics", within_s=60)
    except BaseException:
        await asyncio.to_thread(stop_all, [epp])
        raise
    return epp


@contextlib.asynccontextmanager
async def serve_foreign_epp(
    policy_name: str,
    counterpart: str,
    workers: Sequence[Worker],
    ports: PortPool,
    logs: Path,
    *,
    model: str,
    precise: bool = False,
) -> AsyncIterator[Routed]:
    """The counterpart's EPP routing to twins of `workers` behind a real Envoy (module
    docstring); with `precise`, llm-d's precise prefix-cache scorer reading the twins' KV
    events (module docstring, step 6); everything it started is stopped on exit."""
    from dynamograph.local.envoy import run_envoy

    reason = unavailable(counterpart, precise=precise)
    if reason:
        raise LaunchError(f"{policy_name}: {reason}")
    # one port that is free at every pod IP: a port free on 127.0.0.1 has no wildcard
    # listener, and nothing else binds 127.1.x.y
    target_port = ports.take()
    # llm-d subscribes to every pod's KV events at one port (its pod discovery)
    shared_events = ports.take(2) if precise else None
    app = f"bench-{policy_name}"
    twins: list[PodWorker] = []
    epp: Proc | None = None
    async with contextlib.AsyncExitStack() as stack:
        pool = await stack.enter_async_context(
            pool_of_pods(app, [w.name for w in workers], target_port, logs)
        )
        try:
            for w in workers:
                ip = pool.ips[w.name]
                events = shared_events or ports.take(2)
                topic = kv_topic(ip, target_port, model) if precise else None
                twins.append(_twin(w, ip, target_port, events, logs / "fleet", topic))
            grpc, health, metrics = ports.take(), ports.take(), ports.take()
            listen, admin = ports.take(), ports.take()
            ports.release()
            for t in twins:
                t.proc.start()
            await asyncio.gather(
                *(wait_http(t.proc, t.url + "/health", within_s=120) for t in twins)
            )
            config, helper_pids = None, []
            if precise:
                assert shared_events is not None
                config, tokenizer_pid = await stack.enter_async_context(
                    precise_scorer(
                        policy_name,
                        model=model,
                        block_size=int(_flag(workers[0].proc.argv, "--block-size")),
                        events_port=shared_events,
                        app=app,
                        logs=logs,
                    )
                )
                helper_pids.append(tokenizer_pid)
            epp = await start_foreign_epp(
                counterpart, pool, grpc, health, metrics, logs / f"{policy_name}-epp.log", config
            )
            access_log = logs / f"{policy_name}-envoy" / "access.log"
            gateway = gateway_config(listen, admin, f"127.0.0.1:{grpc}", str(access_log))
            async with run_envoy(gateway, workdir=access_log.parent) as envoy:
                url = f"http://127.0.0.1:{listen}"
                await _wait_routed(epp, url, model, count=len(twins), within_s=90)
                assert epp.popen is not None
                yield Routed(
                    url,
                    twins,
                    [epp.popen.pid, *helper_pids],
                    f"http://127.0.0.1:{metrics}/metrics",
                    access_log,
                    [envoy.process.pid],
                )
        finally:
            await asyncio.to_thread(stop_all, [*([epp] if epp else []), *(t.proc for t in twins)])


async def index_lookup_hits(session: aiohttp.ClientSession, url: str) -> float:
    """Blocks llm-d's KV-block index found for the prompts it looked up so far, from its
    Prometheus page at `url` (its precise configuration turns these metrics on)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(url) as resp:
        text = await resp.text()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvcache_index_lookup_hits_total"
    )


async def _poll(check, within_s: float, what: str):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        try:
            found = await asyncio.to_thread(check)
        except subprocess.SubprocessError:
            found = None
        if found:
            return found
        if loop.time() > deadline:
            raise LaunchError(f"{what} within {within_s:.0f} s")
        await asyncio.sleep(0.3)
