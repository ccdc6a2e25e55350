"""What the process kubelet makes of a Deployment: pod manifests, argv, env, files (pure).

A real pod has its own network namespace: `127.0.0.1` inside it means the pod itself, and its
containers bind `0.0.0.0` without colliding with other pods. Here each "pod" is a set of local
processes sharing one loopback address 127.x.y.z (the whole 127/8 is loopback on Linux), so the
kubelet rewrites loopback and wildcard hosts in the containers' arguments to the pod's address
and makes `dynamograph worker|frontend|epp` bind it explicitly. Mounted ConfigMap and emptyDir
volumes become per-pod directories, and paths under a mount point are rewritten to them.
"""

import base64
import hashlib
import re
import sys
from dataclasses import dataclass
from typing import Any

import orjson

ENTRYPOINT = "dynamograph"
# Subcommands with a `--host` bind flag (docs/contracts: worker, frontend, epp).
BINDING_COMMANDS = frozenset({"worker", "frontend", "epp"})
_LOOPBACK = re.compile(r"(?<![\w.])(?:127\.0\.0\.1|localhost|0\.0\.0\.0)(?=:\d)")
_ANY_HOST = frozenset({"0.0.0.0", "127.0.0.1", "localhost", "::", "[::]"})
TEMPLATE_HASH_LABEL = "pod-template-hash"
NODE_NAME = "process-kubelet"


class PodSpecError(ValueError):
    """A pod spec this kubelet cannot run (names the field and what to do)."""


def template_hash(template: dict[str, Any]) -> str:
    """A stable short hash of a pod template (like the ReplicaSet's pod-template-hash)."""
    digest = hashlib.sha256(orjson.dumps(template, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return digest[:10]


def service_selects(selector: dict[str, str] | None, labels: dict[str, str]) -> bool:
    """A Service's plain `selector` map."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    """Port name (or the number as text when unnamed) -> container port."""
    out: dict[str, int] = {}
    for port in container.get("ports") or []:
        number = int(port["containerPort"])
        out[port.get("name") or str(number)] = number
    return out


def pod_ports(spec: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for container in spec.get("containers") or []:
        for name, number in container_ports(container).items():
            out.setdefault(name, number)
    return out


def resolve_port(port: int | str, spec: dict[str, Any]) -> int:
    """A probe's or Service's target port: a number, or a container port's name."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    ports = pod_ports(spec)
    if port not in ports:
        raise PodSpecError(f"port {port!r} is not a named container port (have {sorted(ports)})")
    return ports[port]


def pod_manifest(
    deployment: dict[str, Any], name: str, ip: str, uid: str, hash_: str
) -> dict[str, Any]:
    """The Pod object a Deployment's template stands for, owned by the Deployment."""
    meta = deployment["metadata"]
    template = deployment["spec"]["template"]
    tmeta = template.get("metadata") or {}
    labels = dict(tmeta.get("labels") or {})
    labels[TEMPLATE_HASH_LABEL] = hash_
    spec = dict(template.get("spec") or {})
    spec["nodeName"] = NODE_NAME
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": meta["name"],
        "uid": meta.get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": meta.get("namespace", "default"),
            "uid": uid,
            "labels": labels,
            "annotations": dict(tmeta.get("annotations") or {}),
            "ownerReferences": [owner],
        },
        "spec": spec,
        "status": {"phase": "Pending", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip},
    }


def pod_status(
    spec: dict[str, Any], ip: str, ready: dict[str, bool], restarts: dict[str, int]
) -> dict[str, Any]:
    """The status block for a running pod whose containers are `ready` (by name)."""
    all_ready = bool(ready) and all(ready.values())
    flag = "True" if all_ready else "False"
    return {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "hostIP": ip,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": flag},
            {"type": "Ready", "status": flag},
        ],
        "containerStatuses": [
            {
                "name": c["name"],
                "ready": ready.get(c["name"], False),
                "restartCount": restarts.get(c["name"], 0),
                "started": True,
                "image": c.get("image", ""),
                "state": {"running": {}},
            }
            for c in spec.get("containers") or []
        ],
    }


@dataclass(frozen=True)
class PodRefs:
    """The downward-API facts of one pod."""

    name: str
    namespace: str
    ip: str
    uid: str
    service_account: str = "default"


def secret_names(spec: dict[str, Any]) -> set[str]:
    """The Secrets the pod's containers read env values from (secretKeyRef)."""
    return {
        var["valueFrom"]["secretKeyRef"]["name"]
        for c in spec.get("containers") or []
        for var in c.get("env") or []
        if "secretKeyRef" in (var.get("valueFrom") or {})
    }


def secret_values(secret: dict[str, Any]) -> dict[str, str]:
    """A Secret's keys and values: `data` (base64, what an API server stores) and `stringData`
    (what a client writes; an emulator may keep it as written)."""
    values = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    values.update(secret.get("stringData") or {})
    return values


def container_env(
    container: dict[str, Any],
    refs: PodRefs,
    base: dict[str, str],
    secrets: dict[str, dict[str, str]] | None = None,
) -> dict[str, str]:
    """`base` plus the container's env: literal values, downward-API fieldRefs and
    secretKeyRefs into `secrets` (name -> values, the pod's namespace's Secrets)."""
    fields = {
        "metadata.name": refs.name,
        "metadata.namespace": refs.namespace,
        "metadata.uid": refs.uid,
        "status.podIP": refs.ip,
        "status.hostIP": refs.ip,
        "spec.nodeName": NODE_NAME,
        "spec.serviceAccountName": refs.service_account,
    }
    env = dict(base)
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
        elif "valueFrom" in var and "fieldRef" in var["valueFrom"]:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            if path not in fields:
                raise PodSpecError(f"env {var['name']}: fieldRef {path} is not supported here")
            env[var["name"]] = fields[path]
        elif "valueFrom" in var and "resourceFieldRef" in var["valueFrom"]:
            env[var["name"]] = "1"
        elif "valueFrom" in var and "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            value = (secrets or {}).get(ref["name"], {}).get(ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                raise PodSpecError(
                    f"env {var['name']}: key {ref['key']!r} of Secret {ref['name']!r} not found"
                )
            env[var["name"]] = value
        elif "valueFrom" in var:
            raise PodSpecError(
                f"env {var['name']}: only literal values, fieldRef and secretKeyRef are "
                f"supported by the process kubelet, got {sorted(var['valueFrom'])}"
            )
        else:
            env[var["name"]] = ""
    return env


def _rewrite_arg(arg: str, ip: str, mounts: dict[str, str]) -> str:
    if arg in _ANY_HOST:
        return ip
    flag, eq, value = arg.partition("=")
    if eq and flag.startswith("-") and value in _ANY_HOST:
        return f"{flag}={ip}"
    arg = _LOOPBACK.sub(ip, arg)
    # Longest mount point first, so /etc/a/b wins over /etc/a.
    for mount_path in sorted(mounts, key=len, reverse=True):
        local = mounts[mount_path]
        for prefix in ("", "="):
            needle = prefix + mount_path
            at = arg.find(needle)
            if at == -1:
                continue
            end = at + len(needle)
            if end == len(arg) or arg[end] == "/":
                if prefix == "" and at != 0:
                    continue
                arg = arg[:at] + prefix + local + arg[end:]
                break
    return arg


def container_argv(
    container: dict[str, Any],
    ip: str,
    mounts: dict[str, str] | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The local command line of a container (argv), running as the pod at `ip`.

    A container without `command` runs the image's entrypoint, which for the project image is
    `dynamograph`; `dynamograph` itself runs as `python -m dynamograph.cli` from this
    environment. Binding subcommands get `--host <ip>` unless their arguments set a host.
    """
    mounts = mounts or {}
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    argv = command + args if command else [ENTRYPOINT, *args]
    if not argv:
        raise PodSpecError(f"container {container.get('name')!r} has no command or args")
    argv = [argv[0]] + [_rewrite_arg(a, ip, mounts) for a in argv[1:]]
    if argv[0].rsplit("/", 1)[-1] != ENTRYPOINT:
        raise PodSpecError(
            f"container {container.get('name')!r} runs {argv[0]!r}; the process kubelet runs "
            f"only the project's `{ENTRYPOINT}` command"
        )
    rest = argv[1:]
    sub = next((i for i, a in enumerate(rest) if a in BINDING_COMMANDS), None)
    if sub is not None and not any(a == "--host" or a.startswith("--host=") for a in rest):
        rest[sub + 1 : sub + 1] = ["--host", ip]
    return [python, "-m", "dynamograph.cli", *rest]


def volume_dirs(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Volumes this kubelet can provide: name -> volume, for configMap and emptyDir only."""
    out = {}
    for volume in spec.get("volumes") or []:
        if "configMap" in volume or "emptyDir" in volume:
            out[volume["name"]] = volume
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise PodSpecError(
                f"volume {volume['name']!r}: only configMap and emptyDir volumes run under the "
                f"process kubelet, got {kinds}"
            )
    return out


def configmap_files(volume: dict[str, Any], configmap: dict[str, Any]) -> dict[str, str]:
    """File name -> content for a configMap volume (honouring `items` when given)."""
    data = dict(configmap.get("data") or {})
    items = volume["configMap"].get("items")
    if not items:
        return data
    out = {}
    for item in items:
        if item["key"] not in data:
            raise PodSpecError(
                f"configMap {configmap['metadata']['name']!r} has no key {item['key']!r}"
            )
        out[item["path"]] = data[item["key"]]
    return out
