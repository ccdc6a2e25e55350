"""The process kubelet: test infrastructure that runs Deployments as local processes.

It stands in for three parts of a cluster that the kmock emulator lacks: the ReplicaSet
controller (Deployment replicas and template -> Pod objects), the kubelet (each Pod's
containers -> local processes, its configMap, secret and emptyDir volumes -> directories,
readiness probes -> the Pod's Ready condition) and the Deployment status
(replicas/readyReplicas/updatedReplicas, which the operator reports in the graph's status).
Each pod gets its own loopback address 127.a.b.N with the container ports of
its spec (see `pods.py` for how a pod's network namespace is emulated).

The components under test see a cluster: the operator writes Deployments, the EPP watches Pods
through its normal Kubernetes discovery and reaches the pods at their podIP. Nothing here is
product code; it runs only inside the e2e suite.

Reconciliation is level-triggered, every `interval` seconds: list Deployments and Pods, start
what is missing, stop what is surplus (newest first) or orphaned, probe what is not ready yet,
restart crashed containers with a back-off, and patch statuses only when they change.
"""

import asyncio
import contextlib
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import string
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp

from . import pods as podlib
from .kubeapi import CONFIGMAPS, DEPLOYMENTS, PODS, SECRETS, ApiError, KubeApi

log = logging.getLogger(__name__)

MAX_GRACE_S = 5.0
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)
VOLUME_SOURCES = {"configMap": CONFIGMAPS, "secret": SECRETS}  # pods.volume_source's kinds


@dataclass
class Container:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    probe: dict[str, Any] | None
    process: asyncio.subprocess.Process | None = None
    log_file: TextIO | None = None
    ready: bool = False
    restarts: int = 0
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)


@dataclass
class Pod:
    name: str
    namespace: str
    uid: str
    ip: str
    deployment: str
    template_hash: str
    spec: dict[str, Any]
    containers: list[Container]
    directory: Path
    created: float = field(default_factory=time.monotonic)
    reported: dict[str, Any] | None = None  # last status patched into the API

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def ready(self) -> bool:
        return all(c.ready for c in self.containers)

    def pids(self) -> list[int]:
        return [c.process.pid for c in self.containers if c.process is not None]


class AddressPool:
    """Loopback addresses 127.a.b.2, 127.a.b.3, ... never handed out twice in one run, so a
    stale connection to a stopped pod can never reach its successor."""

    def __init__(self, rng: random.Random | None = None):
        rng = rng or random.Random()
        self._a = rng.randrange(100, 250)
        self._b = rng.randrange(1, 250)
        self._n = 1

    def next(self) -> str:
        self._n += 1
        if self._n > 254:
            self._n, self._b = 2, (self._b % 250) + 1
        return f"127.{self._a}.{self._b}.{self._n}"


def die_with_parent() -> None:
    """Child-side (preexec): SIGKILL this process when the test process dies, however it dies.

    Teardown stops every pod; this covers the runner itself being killed (CI timeouts), which
    would otherwise orphan processes that run in their own sessions.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def ports_free(ip: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                return False
    return True


class ProcessKubelet:
    """Run every Deployment in the API server as local processes until `stop()`."""

    def __init__(
        self,
        api: KubeApi,
        workdir: Path,
        kubeconfig: Path,
        *,
        interval: float = 0.2,
        extra_env: dict[str, str] | None = None,
        rng: random.Random | None = None,
    ):
        self.api = api
        self.workdir = workdir
        self.kubeconfig = kubeconfig
        self.interval = interval
        self.extra_env = extra_env or {}
        self.addresses = AddressPool(rng)
        self.pods: dict[tuple[str, str], Pod] = {}
        self.errors: list[str] = []  # reconcile failures, for diagnostics
        self.stopped_pids: list[int] = []
        self._task: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        self._task = asyncio.create_task(self._loop(), name="process-kubelet")

    async def stop(self) -> None:
        """Stop the loop, then every pod's processes (best effort on the API side)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.gather(
            *(self._stop_pod(p, delete=True) for p in list(self.pods.values())),
            return_exceptions=True,
        )
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> "ProcessKubelet":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep running: the next round may succeed
                self._error(f"reconcile failed: {exc!r}")
            await asyncio.sleep(self.interval)

    def _error(self, text: str) -> None:
        """Keep `text` for diagnostics, once while it repeats round after round."""
        text = text[:500]
        if not self.errors or self.errors[-1].partition(" ")[2] != text:
            self.errors.append(f"{time.strftime('%H:%M:%S')} {text}")
            log.warning("process kubelet: %s", text)

    # ---- reconcile -----------------------------------------------------------------------

    async def reconcile(self) -> None:
        deployments = [
            d
            for d in await self.api.list(DEPLOYMENTS)
            if not (d.get("metadata") or {}).get("deletionTimestamp")
        ]
        listed = {
            (p["metadata"].get("namespace", "default"), p["metadata"]["name"])
            for p in await self.api.list(PODS)
        }
        # Pods deleted through the API (by a test, or by the GC): stop their processes.
        await asyncio.gather(
            *(
                self._stop_pod(p, delete=False)
                for k, p in list(self.pods.items())
                if k not in listed
            )
        )

        live = set()
        for deployment in deployments:
            meta = deployment["metadata"]
            live.add((meta.get("namespace", "default"), meta["name"]))
            try:
                await self._reconcile_deployment(deployment)
            except podlib.PodSpecError as exc:
                # As on a node, a pod that cannot start (a Secret not there yet) holds up only
                # its own Deployment; the next round tries again.
                self._error(f"deployment {meta.get('namespace', 'default')}/{meta['name']}: {exc}")
        await asyncio.gather(
            *(
                self._stop_pod(p, delete=True)
                for p in list(self.pods.values())
                if (p.namespace, p.deployment) not in live
            )
        )

        await asyncio.gather(*(self._tend(p) for p in list(self.pods.values())))
        for deployment in deployments:
            await self._report_deployment(deployment)

    def _pods_of(self, namespace: str, deployment: str) -> list[Pod]:
        return sorted(
            (
                p
                for p in self.pods.values()
                if (p.namespace, p.deployment) == (namespace, deployment)
            ),
            key=lambda p: p.created,
        )

    async def _reconcile_deployment(self, deployment: dict[str, Any]) -> None:
        meta = deployment["metadata"]
        namespace = meta.get("namespace", "default")
        desired = int(deployment["spec"].get("replicas", 1))
        hash_ = podlib.template_hash(deployment["spec"]["template"])
        current = self._pods_of(namespace, meta["name"])
        new = [p for p in current if p.template_hash == hash_]
        old = [p for p in current if p.template_hash != hash_]
        for _ in range(desired - len(new)):
            await self._start_pod(deployment, hash_)
        surplus = list(reversed(new[desired:]))  # scale down: newest first
        # A template change rolls: old pods go once the new ones serve (or nothing is wanted).
        if old and (desired == 0 or sum(p.ready for p in new) >= desired):
            surplus += old
        await asyncio.gather(*(self._stop_pod(p, delete=True) for p in surplus))

    async def _report_deployment(self, deployment: dict[str, Any]) -> None:
        meta = deployment["metadata"]
        namespace = meta.get("namespace", "default")
        hash_ = podlib.template_hash(deployment["spec"]["template"])
        mine = self._pods_of(namespace, meta["name"])
        ready = sum(p.ready for p in mine)
        status: dict[str, Any] = {
            "replicas": len(mine),
            "updatedReplicas": sum(p.template_hash == hash_ for p in mine),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, int(deployment["spec"].get("replicas", 1)) - ready),
        }
        if meta.get("generation") is not None:
            status["observedGeneration"] = meta["generation"]
        current = deployment.get("status") or {}
        if all(current.get(k) == v for k, v in status.items()):
            return  # level-triggered against the listed object: nothing to write
        await self.api.patch(DEPLOYMENTS, namespace, meta["name"], {"status": status}, "status")

    # ---- pods ----------------------------------------------------------------------------

    def _allocate(self, spec: dict[str, Any]) -> str:
        ports = sorted(set(podlib.pod_ports(spec).values()))
        for _ in range(50):
            ip = self.addresses.next()
            if ports_free(ip, ports):
                return ip
        raise RuntimeError(f"no loopback address with ports {ports} free after 50 tries")

    async def _start_pod(self, deployment: dict[str, Any], hash_: str) -> Pod:
        meta = deployment["metadata"]
        namespace = meta.get("namespace", "default")
        spec = deployment["spec"]["template"].get("spec") or {}
        suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
        name = f"{meta['name']}-{hash_}-{suffix}"
        ip = self._allocate(spec)
        uid = str(uuid.uuid4())
        directory = self.workdir / namespace / name
        directory.mkdir(parents=True, exist_ok=True)
        refs = podlib.PodRefs(name, namespace, ip, uid, spec.get("serviceAccountName", "default"))
        try:
            containers = await self._containers(spec, refs, directory)
        except podlib.PodSpecError:
            shutil.rmtree(directory)  # a pod that never started leaves nothing behind
            raise
        pod = Pod(name, namespace, uid, ip, meta["name"], hash_, spec, containers, directory)
        await self.api.create(
            PODS, namespace, podlib.pod_manifest(deployment, name, ip, uid, hash_)
        )
        self.pods[pod.key] = pod
        for container in containers:
            await self._spawn(pod, container)
        log.info("process kubelet: started pod %s/%s at %s", namespace, name, ip)
        return pod

    async def _containers(
        self, spec: dict[str, Any], refs: podlib.PodRefs, directory: Path
    ) -> list[Container]:
        """The pod's containers, ready to spawn: volumes materialised, argv and env resolved."""
        volumes = await self._volumes(refs.namespace, spec, directory)
        base_env = self._base_env()
        secret_data = {}
        for secret_name in podlib.secret_names(spec):
            secret = await self.api.get(SECRETS, refs.namespace, secret_name)
            if secret is not None:  # a missing one: container_env names the variable
                secret_data[secret_name] = podlib.object_data("secret", secret)
        containers = []
        for c in spec.get("containers") or []:
            mounts = podlib.container_mounts(c, volumes)
            containers.append(
                Container(
                    name=c["name"],
                    argv=podlib.container_argv(c, refs.ip, mounts),
                    env=podlib.container_env(c, refs, base_env, secret_data, mounts),
                    log_path=directory / f"{c['name']}.log",
                    probe=c.get("readinessProbe"),
                )
            )
        return containers

    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(
            {
                # What a pod's service-account mount gives it: access to the API server.
                "KUBECONFIG": str(self.kubeconfig),
                "HF_HUB_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    async def _volumes(
        self, namespace: str, spec: dict[str, Any], directory: Path
    ) -> dict[str, str]:
        """Materialise the pod's configMap, secret and emptyDir volumes as directories; name ->
        path. A missing ConfigMap or Secret the pod needs raises PodSpecError (not started)."""
        out = {}
        for name, volume in podlib.volume_dirs(spec).items():
            path = directory / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            source = podlib.volume_source(volume)
            if source is not None:
                kind, object_name = source
                obj = await self.api.get(VOLUME_SOURCES[kind], namespace, object_name)
                for file, (content, mode) in podlib.volume_files(volume, obj).items():
                    (path / file).parent.mkdir(parents=True, exist_ok=True)
                    (path / file).write_bytes(content)
                    (path / file).chmod(mode)
            out[name] = str(path)
        return out

    async def _spawn(self, pod: Pod, container: Container) -> None:
        if container.log_file is None:
            container.log_file = container.log_path.open("a")
        container.log_file.write(
            f"--- start {time.strftime('%H:%M:%S')}: {' '.join(container.argv)}\n"
        )
        container.log_file.flush()
        container.process = await asyncio.create_subprocess_exec(
            *container.argv,
            env=container.env,
            cwd=pod.directory,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=container.log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals the whole tree
            preexec_fn=die_with_parent,
        )
        container.ready = False
        container.restart_at = None

    async def _tend(self, pod: Pod) -> None:
        """Restart crashed containers, probe the unready ones, report the pod's status."""
        now = time.monotonic()
        for c in pod.containers:
            proc = c.process
            if proc is not None and proc.returncode is not None:
                c.exit_codes.append(proc.returncode)
                c.process, c.ready = None, False
                backoff = RESTART_BACKOFF_S[min(c.restarts, len(RESTART_BACKOFF_S) - 1)]
                c.restart_at = now + backoff
                log.warning(
                    "process kubelet: %s/%s container %s exited %s; restarting in %.1fs",
                    pod.namespace,
                    pod.name,
                    c.name,
                    proc.returncode,
                    backoff,
                )
            if c.process is None and c.restart_at is not None and now >= c.restart_at:
                c.restarts += 1
                await self._spawn(pod, c)
            if c.process is not None and not c.ready:
                c.ready = await self._probe(pod, c)
        status = podlib.pod_status(
            pod.spec,
            pod.ip,
            {c.name: c.ready for c in pod.containers},
            {c.name: c.restarts for c in pod.containers},
        )
        if status != pod.reported:
            try:
                await self.api.patch(PODS, pod.namespace, pod.name, {"status": status}, "status")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                await self._stop_pod(pod, delete=False)  # deleted meanwhile (a test, the GC)
                return
            pod.reported = status

    async def _probe(self, pod: Pod, container: Container) -> bool:
        probe = container.probe
        if not probe:
            return True  # no readiness probe: ready once running, as in Kubernetes
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                port = podlib.resolve_port(get["port"], pod.spec)
                url = f"http://{pod.ip}:{port}{get.get('path', '/')}"
                assert self._http is not None
                async with self._http.get(url) as response:
                    return 200 <= response.status < 400
            if "tcpSocket" in probe:
                port = podlib.resolve_port(probe["tcpSocket"]["port"], pod.spec)
                _, writer = await asyncio.wait_for(asyncio.open_connection(pod.ip, port), 1.0)
                writer.close()
                return True
            if "grpc" in probe:
                return await _grpc_serving(
                    pod.ip, int(probe["grpc"]["port"]), probe["grpc"].get("service", "")
                )
        except (OSError, aiohttp.ClientError, TimeoutError):
            return False
        raise podlib.PodSpecError(
            f"container {container.name!r}: readiness probe {sorted(probe)} is not supported "
            "by the process kubelet (httpGet, tcpSocket and grpc are)"
        )

    async def _stop_pod(self, pod: Pod, *, delete: bool) -> None:
        """API object first (so watchers stop routing to it), then the processes; the pod
        leaves `self.pods` only once its processes are gone."""
        if delete:
            with contextlib.suppress(Exception):
                await self.api.delete(PODS, pod.namespace, pod.name)
        grace = min(float(pod.spec.get("terminationGracePeriodSeconds", 30)), MAX_GRACE_S)
        await asyncio.gather(*(self._kill(c, grace) for c in pod.containers))
        self.stopped_pids.extend(pod.pids())
        self.pods.pop(pod.key, None)
        log.info("process kubelet: stopped pod %s/%s", pod.namespace, pod.name)

    async def _kill(self, container: Container, grace: float) -> None:
        proc = container.process
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        if container.log_file is not None:
            container.log_file.close()
            container.log_file = None

    # ---- diagnostics ---------------------------------------------------------------------

    def describe(self, tail_lines: int = 15) -> str:
        """Pods, addresses, readiness, restarts and the log tail of every unready container."""
        lines = ["process kubelet pods:"]
        for pod in sorted(self.pods.values(), key=lambda p: p.key):
            state = ", ".join(
                f"{c.name}={'ready' if c.ready else 'starting'}"
                + (f" restarts={c.restarts} exits={c.exit_codes}" if c.restarts else "")
                for c in pod.containers
            )
            lines.append(f"  {pod.namespace}/{pod.name} {pod.ip}: {state}")
            for c in pod.containers:
                if not c.ready and c.log_path.exists():
                    tail = c.log_path.read_text(errors="replace").splitlines()[-tail_lines:]
                    lines += [f"    | {c.name}: {t}" for t in tail]
        if self.errors:
            lines.append("reconcile errors: " + "; ".join(self.errors[-5:]))
        return "\n".join(lines)


async def _grpc_serving(ip: str, port: int, service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async with grpc.aio.insecure_channel(f"{ip}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
