"""The control-plane tier's fixtures (marker `operator`): a real control plane on 127.0.0.1
(`controlplane.py`), our chart installed into it by real helm, and `dynamograph operator`
running as a process with the chart's ServiceAccount token, so RBAC is enforced.

Without the binaries (scripts/build-control-plane.sh; `make test` builds them) every test here
is skipped with a message naming what is missing.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from .controlplane import REPO, ControlPlane, Missing, find_binaries, kubeconfig_text


@pytest.fixture(scope="module", autouse=True)
def module_stops_its_processes():
    """No process check here (tests/process_guard.py): the session's control plane outlives
    every module."""
    yield


CHART = REPO / "charts" / "dynamograph"
UPSTREAM_CRDS = REPO / "tests" / "operator" / "data" / "upstream-crds"
RELEASE = "dynamograph"
RELEASE_NAMESPACE = "dynamograph-system"
WORKLOAD_IMAGE = "dynamograph:cluster-test"  # never pulled: kwok runs no containers


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.operator)
            # a cold control plane plus helm take tens of seconds on a loaded machine
            item.add_marker(pytest.mark.timeout(300))


def wait_for(what: str, check, timeout: float = 60.0, interval: float = 0.25, describe=None):
    """Poll `check()` until it returns something truthy; fail naming `what` (and whatever
    `describe()` says about the cluster) when `timeout` passes."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            value = check()
        except Exception as exc:  # e.g. the object does not exist yet
            value, last = None, exc
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = describe() if describe else ""
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what} ({last!r})\n{detail}"
            )
        time.sleep(interval)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    try:
        find_binaries()
        cp = ControlPlane(tmp_path_factory.mktemp("control-plane"))
        cp.kubectl_argv()  # kubectl present
    except Missing as exc:
        pytest.skip(str(exc))
    if not shutil.which("helm", path=str(REPO / ".local" / "bin")):
        pytest.skip("helm not found in .local/bin (scripts/fetch-helm.sh)")
    cp.start()
    try:
        for crd in sorted(UPSTREAM_CRDS.glob("*.yaml")):
            cp.kubectl("apply", "--server-side", "-f", str(crd))
        yield cp
    finally:
        cp.stop()


def helm(cp: ControlPlane, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    home = cp.workdir / "helm-home"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KUBE")},
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
        "KUBECONFIG": str(cp.kubeconfig),
    }
    res = subprocess.run(
        [str(REPO / ".local" / "bin" / "helm"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if check and res.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{res.stdout}\n{res.stderr}")
    return res


class Operator:
    """`dynamograph operator` as a process, logged in with a ServiceAccount token."""

    def __init__(self, cp: ControlPlane, kubeconfig: Path, log: Path):
        self.cp, self.kubeconfig, self.log = cp, kubeconfig, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
        env.update(
            KUBECONFIG=str(self.kubeconfig),
            DYNAMOGRAPH_IMAGE=WORKLOAD_IMAGE,
            DYNAMOGRAPH_RESYNC_SECONDS="2",
            PYTHONUNBUFFERED="1",
        )
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dynamograph.cli",
                    "--log-level",
                    "info",
                    "--log-format",
                    "text",
                    "operator",
                    "--all-namespaces",
                    "--liveness-port",
                    "0",
                ],
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)

    def log_tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def forbidden(self) -> list[str]:
        """Log lines where the API refused the operator: RBAC's "... is forbidden: User ...",
        kopf's APIForbiddenError, and also the 403 for writing into a namespace being deleted
        (the operator leaves such a namespace alone, so that is a fault too). A bare "403" would
        also match log timestamps (",403" milliseconds)."""
        return [ln for ln in self.log_tail(10**7).splitlines() if "orbidden" in ln]


@pytest.fixture(scope="session")
def chart_release(control_plane):
    """Our chart, installed by real helm (CRDs from its crds/, RBAC, ServiceAccount)."""
    cp = control_plane
    helm(
        cp,
        "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        "--set", f"workload.image={WORKLOAD_IMAGE}", "--wait=false",
    )  # fmt: skip
    cp.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/dynamographs.dynamograph.io",
    )  # fmt: skip
    return RELEASE


def service_account_kubeconfig(cp: ControlPlane, namespace: str, name: str, path: Path) -> Path:
    """A kubeconfig with a token for ServiceAccount namespace/name, requested from the
    TokenRequest API (`kubectl create token`)."""
    token = cp.kubectl("create", "token", name, "-n", namespace, "--duration=2h").stdout.strip()
    path.write_text(kubeconfig_text(cp.server, cp.pki / "ca.crt", {"token": token}))
    return path


@pytest.fixture(scope="session")
def operator(control_plane, chart_release, tmp_path_factory):
    """`dynamograph operator -A` with the chart's ServiceAccount's token."""
    cp = control_plane
    d = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(cp, RELEASE_NAMESPACE, RELEASE, d / "kubeconfig")
    op = Operator(cp, kubeconfig, d / "operator.log")
    op.start()
    try:
        yield op
    finally:
        op.stop()


@pytest.fixture
def namespace(control_plane, request):
    """A fresh namespace enforcing Pod Security "restricted"; deleted afterwards (not waited
    for). On a failed test, its objects and the operator's log are printed."""
    cp = control_plane
    name = f"t-{uuid.uuid4().hex[:8]}"
    cp.kubectl_apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": name,
                "labels": {
                    "pod-security.kubernetes.io/enforce": "restricted",
                    "pod-security.kubernetes.io/enforce-version": "latest",
                },
            },
        }
    )
    wait_for(
        f"ServiceAccount default in {name}",
        lambda: cp.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0,
        timeout=30,
    )
    yield name
    cp.kubectl("delete", "namespace", name, "--wait=false", check=False)


def describe(cp: ControlPlane, namespace: str, op: Operator | None = None) -> str:
    """What a failing test prints: the namespace's objects, events and the operator's log."""
    parts = []
    for args in (
        ("get", "dg,deploy,rs,pods,svc,cm,sa,role,rolebinding", "-n", namespace, "-o", "wide"),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        ("get", "dg", "-n", namespace, "-o", "jsonpath={.items[*].status}"),
    ):
        res = cp.kubectl(*args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n{res.stdout}{res.stderr}")
    if op is not None:
        parts.append(f"--- operator log ---\n{op.log_tail()}")
    return "\n".join(parts)


def get(cp: ControlPlane, *args: str) -> dict | None:
    res = cp.kubectl("get", *args, "-o", "json", check=False)
    if res.returncode != 0:
        if "NotFound" in res.stderr or "not found" in res.stderr:
            return None
        raise RuntimeError(res.stderr)
    return json.loads(res.stdout)
