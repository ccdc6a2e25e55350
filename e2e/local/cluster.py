"""The cluster-in-a-box: API emulator, the real operator, garbage collector, process kubelet.

`local_cluster(workdir)` starts, in order: the kmock-based API server on 127.0.0.1 (with the
CRDs declared and ownerReference garbage collection, see `emulator.py`), the operator as its own
process (`dynamograph operator`, kopf, with a kubeconfig pointing at the emulator) and the
process kubelet. It yields
a `LocalCluster` for the scenario: apply/patch/delete graphs, inspect objects, describe state
for failure messages. Teardown stops everything it started, kubelet pods first.
"""

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock

from ..graphs import Manifest
from ..waiting import wait_for
from .emulator import make_emulator
from .kubeapi import DEPLOYMENTS, DYNAMOGRAPHS, PODS, KubeApi, write_kubeconfig
from .kubelet import ProcessKubelet, die_with_parent

OPERATOR_IMAGE = "dynamograph:e2e-local"  # never pulled: the process kubelet ignores images


def operator_argv(python: str = sys.executable) -> list[str]:
    # -A: kmock cannot serve GET /api/v1/namespaces, which kopf needs for namespace patterns.
    # --liveness-port 0: kopf's probe would bind 0.0.0.0:8080, the sidecars' port on every pod.
    # Text logs at info level: readable in a failing test's diagnostics.
    return [
        python, "-m", "dynamograph.cli", "--log-level", "info", "--log-format", "text",
        "operator", "--all-namespaces", "--liveness-port", "0",
    ]  # fmt: skip


def operator_env(kubeconfig: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(
        {
            "KUBECONFIG": str(kubeconfig),
            "DYNAMOGRAPH_IMAGE": OPERATOR_IMAGE,
            # Deployment status changes reach the graph's status through this resync at worst.
            "DYNAMOGRAPH_RESYNC_SECONDS": "2",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@dataclass
class LocalCluster:
    url: str
    emulator: Any  # the ClusterEmulator, for diagnostics straight from its object store
    api: KubeApi
    kubelet: ProcessKubelet
    operator: asyncio.subprocess.Process
    operator_log: Path
    workdir: Path

    async def apply_graph(self, graph: Manifest) -> dict[str, Any]:
        namespace = graph["metadata"].get("namespace", "default")
        return await self.api.create(DYNAMOGRAPHS, namespace, graph)

    async def get_graph(self, namespace: str, name: str) -> dict[str, Any] | None:
        return await self.api.get(DYNAMOGRAPHS, namespace, name)

    async def patch_graph(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        await self.api.patch(DYNAMOGRAPHS, namespace, name, patch)

    async def delete_graph(self, namespace: str, name: str) -> None:
        await self.api.delete(DYNAMOGRAPHS, namespace, name)

    async def pods(self, namespace: str, labels: dict[str, str] | None = None) -> list[dict]:
        items = await self.api.list(PODS, namespace)
        labels = labels or {}
        return [
            p
            for p in items
            if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    async def deployments(self, namespace: str) -> list[dict]:
        return await self.api.list(DEPLOYMENTS, namespace)

    def operator_log_tail(self, lines: int = 25) -> str:
        try:
            text = self.operator_log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join("    | operator: " + t for t in text)

    def describe(self) -> str:
        alive = (
            "running" if self.operator.returncode is None else f"exited {self.operator.returncode}"
        )
        graphs = [
            f"  {ns}/{name}: deletionTimestamp={meta.get('deletionTimestamp')} "
            f"finalizers={meta.get('finalizers')} state={(obj.get('status') or {}).get('state')}"
            for (resource, ns, name), o in self.emulator.objects.items()
            if resource.plural == "dynamographs" and not o.deleted
            for obj in [o.raw]
            for meta in [obj.get("metadata") or {}]
        ]
        return "\n".join(
            [
                self.kubelet.describe(),
                "graphs:",
                *graphs,
                f"operator ({alive}):",
                self.operator_log_tail(),
            ]
        )

    async def wait_graph_state(self, namespace: str, name: str, state: str, within: float) -> dict:
        async def probe():
            graph = await self.get_graph(namespace, name)
            status = (graph or {}).get("status") or {}
            return graph if status.get("state") == state else None

        return await wait_for(
            probe, f"graph {namespace}/{name} state {state!r}", within=within, detail=self.describe
        )


async def _stop_process(process: asyncio.subprocess.Process, grace: float = 10.0) -> None:
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()


@contextlib.asynccontextmanager
async def local_cluster(workdir: Path) -> AsyncIterator[LocalCluster]:
    os.makedirs(workdir, exist_ok=True)
    async with make_emulator() as emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = write_kubeconfig(workdir / "kubeconfig.yaml", url)
        operator_log = workdir / "operator.log"
        async with KubeApi(url) as api:
            with operator_log.open("ab") as log_file:
                operator = await asyncio.create_subprocess_exec(
                    *operator_argv(),
                    env=operator_env(kubeconfig),
                    cwd=workdir,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            kubelet = ProcessKubelet(api, workdir / "pods", kubeconfig)
            try:
                async with kubelet:
                    yield LocalCluster(url, emulator, api, kubelet, operator, operator_log, workdir)
            finally:
                await _stop_process(operator)
