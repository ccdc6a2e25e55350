"""A real Kubernetes control plane on 127.0.0.1, from the binaries scripts/build-control-plane.sh
caches: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake Nodes that
run pods' lifecycle without a kubelet).

    with ControlPlane(workdir) as cp:      # starts in seconds; stops everything on exit
        cp.kubectl("get", "nodes")

or, from a shell (what `make cluster` runs), in the foreground until Ctrl-C:

    .venv/bin/python tests/cluster/controlplane.py [--dir DIR] [--nodes N]

What it sets up: self-signed CA and serving certificate (`cryptography`), an admin client
certificate (group system:masters), a service-account signing key; the apiserver with RBAC
authorization and the default admission plugins plus PodSecurity; the controller-manager with
its default controllers (garbage collector, deployment, replicaset, service-account and token
controllers, ...) and the scheduler, both as admin; kwok managing Nodes annotated
`kwok.x-k8s.io/node: fake`, pod IPs from 127.1.0.0/16 (loopback, so real processes could answer
there). `kubeconfig` (admin) is written into the work directory.

Self-contained (standard library + cryptography): `make cluster` runs it as a script.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from dynamograph.bench.counterparts import read_versions
from dynamograph.worker.testing import free_port  # below the ephemeral range: no client takes it

REPO = Path(__file__).resolve().parents[2]
VERSIONS_FILE = REPO / "scripts" / "control-plane.versions"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
STAGES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)
POD_CIDR = "127.1.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"


class Missing(RuntimeError):
    """The control-plane binaries are not built (or not for the pinned versions)."""


def versions() -> dict[str, str]:
    return read_versions(VERSIONS_FILE)


def cache_dir() -> Path:
    """Where scripts/build-control-plane.sh puts this version's binaries (same rule as there)."""
    v = versions()
    root = os.environ.get("DYNAMOGRAPH_CONTROL_PLANE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "dynamograph",
        "control-plane",
    )
    key = f"k8s-{v['K8S_VERSION']}_etcd-{v['ETCD_VERSION']}_kwok-{v['KWOK_VERSION']}"
    return Path(root) / key


def find_binaries() -> Path:
    """The cache directory if it holds every binary and stage file; else raises Missing with
    what is absent and the command that builds it."""
    d = cache_dir()
    absent = [f"bin/{b}" for b in BINARIES if not os.access(d / "bin" / b, os.X_OK)]
    absent += [f"stages/{s}" for s in STAGES if not (d / "stages" / s).is_file()]
    if not (d / "VERSIONS").is_file():
        absent.append("VERSIONS")
    if absent:
        raise Missing(
            f"control-plane binaries missing in {d}: {', '.join(absent)} "
            "(build them with scripts/build-control-plane.sh; `make setup` runs it)"
        )
    return d


def _die_with_parent() -> None:
    """Child side (preexec): SIGKILL this process when the process that started it dies, however
    it dies (a killed test runner must not orphan a control plane in its own sessions)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# --- certificates ---------------------------------------------------------------------------


def _write_pki(d: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    d.mkdir(parents=True, exist_ok=True)

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def name(cn: str, org: str | None = None) -> x509.Name:
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        return x509.Name(attrs)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("dynamograph-test-ca"))
        .issuer_name(name("dynamograph-test-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip

    def leaf(stem: str, subject: x509.Name, server: bool) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.DNSName("kubernetes"),
                        x509.DNSName("kubernetes.default"),
                        x509.DNSName("kubernetes.default.svc"),
                        x509.DNSName("kubernetes.default.svc.cluster.local"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.IPAddress(ipaddress.ip_address("10.96.0.1")),
                    ]
                ),
                critical=False,
            )
        cert = b.sign(ca_key, hashes.SHA256())
        (d / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (d / f"{stem}.key").write_bytes(pem_key(key))

    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "ca.key").write_bytes(pem_key(ca_key))
    leaf("apiserver", name("kube-apiserver"), server=True)
    leaf("admin", name("dynamograph-admin", "system:masters"), server=False)
    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (d / "sa.key").write_bytes(pem_key(sa_key))
    (d / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def kubeconfig_text(server: str, ca_file: Path, user: dict[str, str], name: str = "local") -> str:
    """A kubeconfig (JSON is YAML) for one cluster and one user entry (token or client cert)."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}
            ],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
        },
        indent=1,
    )


# --- processes ------------------------------------------------------------------------------


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class ControlPlane:
    """Start with `start()` (or `with`), stop with `stop()`: every process it started is
    terminated (SIGTERM to its process group, SIGKILL after a grace period)."""

    workdir: Path
    nodes: int = 2
    node_cpu: str = "32"
    node_memory: str = "256Gi"
    node_gpus: int = 8
    bin_dir: Path | None = None
    procs: list[_Proc] = field(default_factory=list)
    server: str = ""
    started_s: float = 0.0

    @property
    def kubeconfig(self) -> Path:
        return self.workdir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        """JSON lines, one audit event per request made by a ServiceAccount."""
        return self.workdir / "audit.log"

    def audit_events(self, user: str) -> list[dict]:
        if not self.audit_log.exists():
            return []
        events = []
        for line in self.audit_log.read_text().splitlines():
            if f'"{user}"' in line:
                event = json.loads(line)
                if event.get("user", {}).get("username") == user:
                    events.append(event)
        return events

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    def _bin(self, name: str) -> str:
        return str((self.bin_dir or find_binaries() / "bin") / name)

    # lifecycle

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 90.0) -> None:
        t0 = time.monotonic()
        cache = find_binaries()
        self.bin_dir = self.bin_dir or cache / "bin"
        self.workdir.mkdir(parents=True, exist_ok=True)
        _write_pki(self.pki)
        deadline = time.monotonic() + timeout
        try:
            self._start_etcd(deadline)
            self._start_apiserver(deadline)
            self.kubeconfig.write_text(
                kubeconfig_text(
                    self.server,
                    self.pki / "ca.crt",
                    {
                        "client-certificate": str(self.pki / "admin.crt"),
                        "client-key": str(self.pki / "admin.key"),
                    },
                )
            )
            self._spawn(
                "kube-controller-manager",
                [
                    self._bin("kube-controller-manager"),
                    f"--kubeconfig={self.kubeconfig}",
                    "--authentication-kubeconfig=" + str(self.kubeconfig),
                    "--authorization-kubeconfig=" + str(self.kubeconfig),
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    f"--cert-dir={self.workdir / 'kcm-certs'}",
                    f"--service-account-private-key-file={self.pki / 'sa.key'}",
                    f"--root-ca-file={self.pki / 'ca.crt'}",
                    f"--service-cluster-ip-range={SERVICE_CIDR}",
                    "--controllers=*",
                    "--concurrent-gc-syncs=5",
                    "--node-monitor-grace-period=60s",
                ],
            )
            self._spawn(
                "kube-scheduler",
                [
                    self._bin("kube-scheduler"),
                    f"--kubeconfig={self.kubeconfig}",
                    "--authentication-kubeconfig=" + str(self.kubeconfig),
                    "--authorization-kubeconfig=" + str(self.kubeconfig),
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={free_port()}",
                    f"--cert-dir={self.workdir / 'scheduler-certs'}",
                ],
            )
            stages = cache / "stages"
            self._spawn(
                "kwok",
                [
                    self._bin("kwok"),
                    f"--kubeconfig={self.kubeconfig}",
                    "--manage-all-nodes=false",
                    f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
                    f"--cidr={POD_CIDR}",
                    "--node-ip=127.0.0.1",
                    "--node-lease-duration-seconds=40",
                    f"--server-address=127.0.0.1:{free_port()}",
                    *[f"--config={stages / s}" for s in STAGES],
                ],
            )
            for i in range(self.nodes):
                self.kubectl_apply(self.node_manifest(f"kwok-node-{i}"))
            self._wait_nodes_ready(deadline)
            self._wait_default_service_account(deadline)
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0

    def stop(self, grace: float = 10.0) -> None:
        """Stop in reverse start order (kwok ... apiserver, then etcd, which the apiserver needs
        to shut down cleanly): SIGTERM to each process group, SIGKILL after `grace`."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
                try:
                    p.popen.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.popen.pid, signal.SIGKILL)
                    p.popen.wait(timeout=5)
        self.procs.clear()

    def _spawn(self, name: str, argv: list[str]) -> _Proc:
        log = self.workdir / f"{name}.log"
        fh = open(log, "ab")  # noqa: SIM115 (the child owns the file; closed below)
        try:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() kills it whole
                preexec_fn=_die_with_parent,
                cwd=self.workdir,
                env={k: v for k, v in os.environ.items() if not k.startswith("KUBE")},
            )
        finally:
            fh.close()
        proc = _Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def _check_alive(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                tail = p.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}; log tail:\n{tail}")

    def _poll(self, what: str, check, deadline: float, interval: float = 0.2):
        last: object = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                result = check()
            except Exception as exc:  # not up yet
                last = exc
                result = None
            if result:
                return result
            time.sleep(interval)
        raise TimeoutError(f"control plane: {what} not ready in time (last: {last!r})")

    def _start_etcd(self, deadline: float) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                self._bin("etcd"),
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync=true",
                "--quota-backend-bytes=1073741824",
                "--log-level=warn",
            ],
        )

        def healthy() -> bool:
            with urllib.request.urlopen(self.etcd_url + "/health", timeout=2) as r:
                return json.load(r).get("health") == "true"

        self._poll("etcd", healthy, deadline)

    def _start_apiserver(self, deadline: float) -> None:
        port = free_port()
        self.server = f"https://127.0.0.1:{port}"
        pki = self.pki
        # Audit what service accounts do (the operator logs in as one): what tests read to
        # compare the operator's RBAC grants with the calls it really makes.
        policy = self.workdir / "audit-policy.json"
        policy.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    "omitStages": ["RequestReceived"],
                    "rules": [
                        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
                        {"level": "None"},
                    ],
                }
            )
        )
        self._spawn(
            "kube-apiserver",
            [
                self._bin("kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                # the defaults (NamespaceLifecycle, ServiceAccount, PodSecurity, ...) plus these
                "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,PodSecurity,"
                "ResourceQuota,LimitRanger,DefaultStorageClass,MutatingAdmissionWebhook,"
                "ValidatingAdmissionWebhook,ValidatingAdmissionPolicy",
                # Endpoints may not hold loopback addresses: no `kubernetes` Service endpoints.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=false",
                "--profiling=false",
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
            ],
        )
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))

        def ready() -> bool:
            with urllib.request.urlopen(self.server + "/readyz", context=ctx, timeout=3) as r:
                return r.status == 200

        self._poll("kube-apiserver /readyz", ready, deadline)

    # kubectl helpers

    def kubectl_argv(self, *args: str) -> list[str]:
        kubectl = shutil.which("kubectl", path=str(REPO / ".local" / "bin")) or shutil.which(
            "kubectl"
        )
        if not kubectl:
            raise Missing("kubectl not found (scripts/fetch-helm.sh puts it in .local/bin)")
        return [kubectl, f"--kubeconfig={self.kubeconfig}", *args]

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        res = subprocess.run(
            self.kubectl_argv(*args),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and res.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {res.stderr.strip()}")
        return res

    def kubectl_apply(self, obj: dict) -> None:
        self.kubectl("apply", "-f", "-", input=json.dumps(obj))

    def get_json(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def node_manifest(self, name: str) -> dict:
        capacity = {"cpu": self.node_cpu, "memory": self.node_memory, "pods": "110"}
        if self.node_gpus:
            capacity["nvidia.com/gpu"] = str(self.node_gpus)
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "annotations": {FAKE_NODE_ANNOTATION: "fake"},
                "labels": {
                    "type": "kwok",
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            },
            "spec": {},
            "status": {"capacity": capacity, "allocatable": capacity},
        }

    def _wait_nodes_ready(self, deadline: float) -> None:
        def ready() -> bool:
            nodes = self.get_json("nodes")["items"]
            ok = [
                n
                for n in nodes
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n.get("status", {}).get("conditions", [])
                )
            ]
            return len(ok) >= self.nodes

        self._poll("kwok nodes", ready, deadline, interval=0.3)

    def _wait_default_service_account(self, deadline: float) -> None:
        # the serviceaccount controller creates `default` in each namespace; pods need it
        self._poll(
            "default ServiceAccount",
            lambda: (
                self.kubectl("get", "sa", "default", "-n", "default", check=False).returncode == 0
            ),
            deadline,
            interval=0.3,
        )

    def logs(self, tail: int = 4000) -> str:
        """The tail of each component's log, for a failing test's message."""
        out = []
        for p in self.procs:
            text = p.log.read_text(errors="replace") if p.log.exists() else ""
            out.append(f"--- {p.name} (exit {p.popen.poll()}) ---\n{text[-tail:]}")
        return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a local Kubernetes control plane (etcd, kube-apiserver, "
        "kube-controller-manager, kube-scheduler, kwok) in the foreground until Ctrl-C."
    )
    parser.add_argument("--dir", type=Path, help="work directory (default: a fresh temp dir)")
    parser.add_argument("--nodes", type=int, default=2, help="fake kwok Nodes (default 2)")
    args = parser.parse_args(argv)
    workdir = args.dir or Path(tempfile.mkdtemp(prefix="dynamograph-cluster-"))
    if args.dir and workdir.exists():
        shutil.rmtree(workdir)  # a stale etcd would carry the last run's objects and certs
    try:
        cp = ControlPlane(workdir.resolve(), nodes=args.nodes)
        cp.start()
    except Missing as exc:
        print(f"cluster: {exc}", file=sys.stderr)
        return 2
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(f"cluster: up in {cp.started_s:.1f}s, {cp.server}, {args.nodes} kwok nodes")
    print(f"export KUBECONFIG={cp.kubeconfig}")
    print("cluster: Ctrl-C stops it", flush=True)
    try:
        while not stop:
            time.sleep(0.5)
            cp._check_alive()
    except KeyboardInterrupt:
        pass
    finally:
        cp.stop()
        print("cluster: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
