"""What the process kubelet makes of a Deployment: pod manifests, argv, env, files (pure).

A real pod has its own network namespace: `127.0.0.1` inside it means the pod itself, and its
containers bind `0.0.0.0` without colliding with other pods. Here each "pod" is a set of local
processes sharing one loopback address 127.x.y.z (the whole 127/8 is loopback on Linux), so the
kubelet rewrites loopback and wildcard hosts in the containers' arguments to the pod's address
and makes `dynamograph worker|frontend|epp` bind it explicitly. Mounted configMap, secret and
emptyDir volumes become per-pod directories (`volume_files`: the files of a configMap or secret
volume, as the kubelet writes them), and paths under a mount point, in the arguments and in
literal env values, are rewritten to them.
"""

import base64
import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import orjson

ENTRYPOINT = "dynamograph"
# Subcommands with a `--host` bind flag (docs/contracts: worker, frontend, epp).
BINDING_COMMANDS = frozenset({"worker", "frontend", "epp"})
_LOOPBACK = re.compile(r"(?<![\w.])(?:127\.0\.0\.1|localhost|0\.0\.0\.0)(?=:\d)")
_ANY_HOST = frozenset({"0.0.0.0", "127.0.0.1", "localhost", "::", "[::]"})
TEMPLATE_HASH_LABEL = "pod-template-hash"
NODE_NAME = "process-kubelet"
DEFAULT_MODE = 0o644  # a configMap or secret volume's file mode without defaultMode (as 420)


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


def object_data(kind: str, obj: dict[str, Any]) -> dict[str, bytes]:
    """The keys and bytes of a ConfigMap (`data` text, `binaryData` base64) or a Secret
    (`data` base64, as an API server stores it, and `stringData`, what a client writes and an
    emulator may keep as written; it wins over `data`, as the API server merges it)."""
    if kind == "configMap":
        text, encoded = obj.get("data") or {}, obj.get("binaryData") or {}
    else:
        encoded, text = obj.get("data") or {}, obj.get("stringData") or {}
    out = {k: base64.b64decode(v) for k, v in encoded.items()}
    out.update({k: v.encode() for k, v in text.items()})
    return out


def container_env(
    container: dict[str, Any],
    refs: PodRefs,
    base: dict[str, str],
    secrets: dict[str, dict[str, bytes]] | None = None,
    mounts: dict[str, str] | None = None,
) -> dict[str, str]:
    """`base` plus the container's env: literal values (paths under the container's `mounts`
    rewritten), downward-API fieldRefs and secretKeyRefs into `secrets` (name -> `object_data`
    of the pod's namespace's Secrets)."""
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
            env[var["name"]] = _rewrite_path(str(var["value"]), mounts or {})
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
            # os.environ's own encoding of bytes: the process gets the Secret's exact bytes.
            env[var["name"]] = value.decode(errors="surrogateescape")
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
    return _rewrite_path(_LOOPBACK.sub(ip, arg), mounts)


def _rewrite_path(arg: str, mounts: dict[str, str]) -> str:
    """A path under a mount point (the whole text, or after `=`) moved to the local directory."""
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
    """Volumes this kubelet can provide: name -> volume, for configMap, secret and emptyDir."""
    out = {}
    for volume in spec.get("volumes") or []:
        if "configMap" in volume or "secret" in volume or "emptyDir" in volume:
            out[volume["name"]] = volume
        else:
            kinds = sorted(k for k in volume if k != "name")
            raise PodSpecError(
                f"volume {volume['name']!r}: only configMap, secret and emptyDir volumes run "
                f"under the process kubelet, got {kinds}"
            )
    return out


def volume_source(volume: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, name) of the object whose keys fill a volume: ("configMap", name) or ("secret",
    secretName); None for an emptyDir."""
    if "configMap" in volume:
        return "configMap", volume["configMap"]["name"]
    if "secret" in volume:
        return "secret", volume["secret"]["secretName"]
    return None


def _relative(path: str, what: str) -> str:
    """A path inside a volume: relative, without `..` (the API server refuses others)."""
    pure = PurePosixPath(path)
    if not path or pure.is_absolute() or ".." in pure.parts:
        raise PodSpecError(f"{what} {path!r}: must be a relative path without '..'")
    return path


def volume_files(
    volume: dict[str, Any], obj: dict[str, Any] | None
) -> dict[str, tuple[bytes, int]]:
    """Path in the volume -> (content, file mode) for a configMap or secret volume whose object
    is `obj` (None: not found), as the kubelet writes them: every key, or only `items` (key ->
    path, each with an optional `mode`), with `defaultMode` (0644 unless given). A missing
    object or item key stops the pod unless the volume is `optional` (then an empty volume, or
    the key left out)."""
    source = volume_source(volume)
    assert source is not None, "volume_files: an emptyDir has no files"
    kind, name = source
    spec = volume[kind]
    where = f"volume {volume['name']!r}: {kind} {name!r}"
    if obj is None:
        if spec.get("optional"):
            return {}
        raise PodSpecError(f"{where} not found")
    data = object_data(kind, obj)
    mode = int(spec.get("defaultMode", DEFAULT_MODE))
    items = spec.get("items")
    if not items:
        return {_relative(key, "key"): (value, mode) for key, value in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            if spec.get("optional"):
                continue
            raise PodSpecError(f"{where} has no key {item['key']!r}")
        path = _relative(item["path"], f"{where}: items path")
        out[path] = (data[item["key"]], int(item.get("mode", mode)))
    return out


def container_mounts(container: dict[str, Any], volumes: dict[str, str]) -> dict[str, str]:
    """The container's mount points -> local paths: its volume's directory (`volumes`, name ->
    directory), or the `subPath` inside it."""
    out = {}
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            raise PodSpecError(f"volumeMount {mount['mountPath']!r}: no volume {mount['name']!r}")
        local = volumes[mount["name"]]
        if mount.get("subPath"):
            local = f"{local}/{_relative(mount['subPath'], 'subPath')}"
        out[mount["mountPath"]] = local
    return out
