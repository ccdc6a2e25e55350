"""Worker discovery: which engines exist and what each says about itself.

A *source* finds worker targets (engine URL + serving endpoint); `Discovery` turns each target
into a `WorkerRecord` by fetching the worker's `GET /v1/engine` (block size, role, DP size and KV
event endpoints come from there, never from a guess) and tells its listeners when workers come
and go. The EPP and the frontend both use it.

API:
- `WorkerTarget(key, engine_url, serving_endpoint)`: what a source found; `key` is the pod
  (`namespace/name`) or, for static workers, the engine URL.
- `WorkerRecord(name, instance_id, engine_url, serving_endpoint, config)`: a live worker;
  `serving_endpoint` is `host:port` Envoy sends to (None for prefill-only workers), `config` the
  worker's `protocol.engine.EngineConfig` (with its LoRA adapters, `lora_adapters`, which the
  router core registers through `Router.add_engine` and the picker maps `model` names with).
- `parse_worker_flag("http://h:8001=h:9001") -> WorkerTarget`, `load_workers_file(path)`.
- `pod_target(pod: dict, foreign=False) -> WorkerTarget | None`: a Pod (API JSON) that is
  Ready, not terminating and has a container port named `engine` (`foreign`: or only `http`);
  serving endpoint from the port `http`.
- `StaticSource(targets)`, `KubernetesSource(namespace, selector, configuration=None)`: sources.
- `KubernetesWatch(namespace, lister, target, what=...)`: the list-and-watch loop of any
  namespaced kind, feeding a `Sink` (the pod source is one; the EPP's InferenceObjectives
  another).
- `Discovery(source)`: `await start()`, `await stop()`, `records` (instance id → record),
  `get(instance_id)`, `endpoint_of(instance_id)`, `add_listener(on_added, on_removed)` (plain
  callables taking a WorkerRecord), `mark_unreachable(instance_id)` (drop it and re-fetch
  `/v1/engine` until it answers again), `await wait_for(predicate, within)`.
- `EngineTemplate.load(path)` (protocol.engine, re-exported here): what workers that serve no
  `/v1/engine` are (unmodified vLLM pods, llm-d-inference-sim): EngineConfig fields from YAML
  whose KV-event addresses and topic are templates of the worker's `{host}` and `{port}`;
  `Discovery` uses it
  for every worker whose `/v1/engine` answers 404 (ours keep describing themselves); a source
  carries it (`StaticSource(..., fallback=)`, `KubernetesSource(..., fallback=)`).
- `add_discovery_arguments(parser)` and `source_from_args(args)`: the shared command-line flags
  (`--discovery`, `--worker`, `--workers-file`, `--namespace`, `--selector`,
  `--engine-config`); `engine_template_from_args(args)`.
"""

import argparse
import asyncio
import functools
import logging
import os
import random
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import orjson
import yaml
from pydantic import ValidationError

from dynamograph.protocol.engine import ENGINE_PATH, EngineConfig, EngineTemplate

from .tasks import cancel_all

log = logging.getLogger(__name__)

ENGINE_PORT_NAME = "engine"
SERVING_PORT_NAME = "http"


@dataclass(frozen=True, slots=True)
class WorkerTarget:
    key: str
    engine_url: str
    serving_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    name: str
    instance_id: int
    engine_url: str
    serving_endpoint: str | None
    config: EngineConfig


# ---- static targets -------------------------------------------------------------------------


def _normalise_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


def parse_worker_flag(value: str) -> WorkerTarget:
    """`ENGINE_URL[=HOST:PORT]`: the engine, then where Envoy should send (absent for prefill)."""
    engine, sep, endpoint = value.partition("=")
    if not engine.strip():
        raise ValueError(f"--worker {value!r}: expected ENGINE_URL[=HOST:PORT]")
    endpoint = endpoint.strip()
    if sep and (not endpoint or ":" not in endpoint):
        raise ValueError(f"--worker {value!r}: the serving endpoint must be HOST:PORT")
    url = _normalise_url(engine)
    return WorkerTarget(key=url, engine_url=url, serving_endpoint=endpoint or None)


def load_workers_file(path: str | Path) -> list[WorkerTarget]:
    """YAML or JSON list of `{engine: URL, endpoint: HOST:PORT}` (endpoint optional)."""
    raw = yaml.safe_load(Path(path).read_text())
    if raw is None:
        return []
    if isinstance(raw, dict) and "workers" in raw:
        raw = raw["workers"]
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of {{engine, endpoint}} entries")
    targets = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("engine"), str):
            raise ValueError(f"{path}: entry {i} needs an 'engine' URL, got {entry!r:.80}")
        spec = entry["engine"]
        if entry.get("endpoint"):
            spec += "=" + str(entry["endpoint"])
        targets.append(parse_worker_flag(spec))
    return targets


# ---- Kubernetes pods ------------------------------------------------------------------------


def _pod_ready(pod: dict[str, Any]) -> bool:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return bool(condition.get("status") == "True")
    return False


def _named_ports(pod: dict[str, Any]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") and port.get("containerPort"):
                ports.setdefault(port["name"], int(port["containerPort"]))
    return ports


def pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def pod_target(pod: dict[str, Any], *, foreign: bool = False) -> WorkerTarget | None:
    """The worker a Pod stands for, or None when it must not receive traffic (yet). The engine
    is at the port named `engine`. With `foreign` (discovery given `--engine-config`), a pod
    with only an `http` port (an engine we did not launch: vLLM, llm-d-inference-sim) is asked
    there too; not by default, since a graph's selector also matches its frontends, which
    serve `http` and are no engines."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp") or not _pod_ready(pod):
        return None
    ip = (pod.get("status") or {}).get("podIP")
    ports = _named_ports(pod)
    engine = ports.get(ENGINE_PORT_NAME) or (ports.get(SERVING_PORT_NAME) if foreign else None)
    if not ip or not engine:
        return None
    host = f"[{ip}]" if ":" in ip else ip
    serving = ports.get(SERVING_PORT_NAME)
    return WorkerTarget(
        key=pod_key(pod),
        engine_url=f"http://{host}:{engine}",
        serving_endpoint=f"{host}:{serving}" if serving else None,
    )


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality and existence label selectors (`a=b,c!=d,e,!f`), checked on our side as well:
    some API emulators ignore `labelSelector`. Set-based terms are left to the server."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if " in " in term or " notin " in term or "(" in term:
            continue
        if "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:].strip() in labels:
                return False
        elif term not in labels:
            return False
    return True


# ---- sources --------------------------------------------------------------------------------


T = TypeVar("T")
T_contra = TypeVar("T_contra", contravariant=True)


class Sink(Protocol[T_contra]):
    """What a watch feeds: the whole set after a list, then each change (`remove` by the
    object's `namespace/name`)."""

    def sync(self, targets: Iterable[T_contra]) -> None: ...

    def upsert(self, target: T_contra) -> None: ...

    def remove(self, key: str) -> None: ...


TargetSink = Sink[WorkerTarget]


class StaticSource:
    """A fixed list of workers (flags or a workers file): `dynamograph up` and tests. A source's
    `fallback` describes the workers it finds that serve no `/v1/engine` (`EngineTemplate`)."""

    def __init__(self, targets: Iterable[WorkerTarget], *, fallback: EngineTemplate | None = None):
        self.targets = list(targets)
        self.fallback = fallback

    async def run(self, sink: TargetSink) -> None:
        sink.sync(self.targets)


Lister = Callable[[Any], Callable[..., Awaitable[Any]]]  # ApiClient → list_namespaced_X(ns, **kw)


def _list_pods(api: Any) -> Callable[..., Awaitable[Any]]:
    from kubernetes_asyncio import client

    return client.CoreV1Api(api).list_namespaced_pod


class KubernetesWatch(Generic[T]):
    """Watch one kind of namespaced object with the Kubernetes client: list, then watch from
    the list's resourceVersion, resume from the last seen version when a watch ends, relist when
    the server answers 410 Gone. `target` says what an object stands for (None: nothing, and a
    known one of its name is removed)."""

    def __init__(
        self,
        namespace: str,
        lister: Lister,
        target: Callable[[dict[str, Any]], T | None],
        *,
        what: str,
        selector: str = "",
        configuration: Any = None,
        watch_timeout: int = 300,
        retry_interval: float = 1.0,
        missing_interval: float = 30.0,
    ):
        self.namespace = namespace
        self.lister = lister
        self.target = target
        self.what = what  # for the logs: "pod", "inferenceobjective"
        self.selector = selector
        self.configuration = configuration
        self.watch_timeout = watch_timeout
        self.retry_interval = retry_interval
        # a kind the API does not serve (404: an optional CRD not installed) is looked for
        # again this often, said once in the log
        self.missing_interval = missing_interval
        self.missing = 0  # 404s answered so far
        self.relists = 0

    async def _configuration(self) -> Any:
        from kubernetes_asyncio import client, config

        if self.configuration is not None:
            return self.configuration
        configuration = client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            await config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        return configuration

    def _target(self, obj: dict[str, Any]) -> T | None:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        if self.selector and not selector_matches(self.selector, labels):
            return None
        return self.target(obj)

    async def run(self, sink: Sink[T]) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        configuration = await self._configuration()
        async with client.ApiClient(configuration) as api:
            list_call = self.lister(api)
            version: str | None = None
            while True:
                try:
                    if version is None:
                        version = await self._list(list_call, sink)
                    version = await self._watch(list_call, version, sink)
                except ApiException as exc:
                    if exc.status == 410:
                        log.info("%s watch expired (410 Gone); relisting", self.what)
                        version = None
                        continue
                    if exc.status == 404:
                        if not self.missing:
                            log.warning(
                                "the API does not serve %s objects (404: is its CRD "
                                "installed?); looking again every %g s",
                                self.what,
                                self.missing_interval,
                            )
                        self.missing += 1
                        version = None
                        await asyncio.sleep(self.missing_interval)
                        continue
                    log.warning(
                        "%s watch failed: %s %s; retrying", self.what, exc.status, exc.reason
                    )
                    await asyncio.sleep(self.retry_interval)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    log.warning("%s watch connection failed: %s; retrying", self.what, exc)
                    await asyncio.sleep(self.retry_interval)

    async def _list(self, list_call: Any, sink: Sink[T]) -> str | None:
        response = await list_call(
            self.namespace, label_selector=self.selector, _preload_content=False
        )
        _raise_for_status(response)
        body = orjson.loads(await response.read())
        self.relists += 1
        targets = [t for obj in body.get("items") or [] if (t := self._target(obj)) is not None]
        sink.sync(targets)
        return (body.get("metadata") or {}).get("resourceVersion")

    async def _watch(self, list_call: Any, version: str | None, sink: Sink[T]) -> str | None:
        """One watch request, read line by line; returns the version to resume from.

        The watch is read raw (not through `kubernetes_asyncio.watch.Watch`): it spells query
        booleans `True`, which strict emulators do not take for `true`, and it would build a
        model object per event that we do not need.
        """
        from kubernetes_asyncio.client.exceptions import ApiException

        kwargs: dict[str, Any] = {
            "label_selector": self.selector,
            "timeout_seconds": self.watch_timeout,
            "allow_watch_bookmarks": "true",
            "watch": "true",
            "_preload_content": False,
        }
        if version:
            kwargs["resource_version"] = version
        response = await list_call(self.namespace, **kwargs)
        _raise_for_status(response)
        try:
            async for line in response.content:
                if not line.strip():
                    continue
                event = orjson.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiException(status=obj.get("code"), reason=obj.get("reason"))
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if kind == "BOOKMARK":
                    continue
                target = self._target(obj) if kind != "DELETED" else None
                if target is None:
                    sink.remove(pod_key(obj))
                else:
                    sink.upsert(target)
        finally:
            response.release()
        return version


def _raise_for_status(response: Any) -> None:
    """A refusal (403, 404, …) as the ApiException the client raises only when it reads the
    body itself: unread (`_preload_content=False`), the answer would pass for an empty list."""
    from kubernetes_asyncio.client.exceptions import ApiException

    if response.status >= 400:
        response.release()
        raise ApiException(status=response.status, reason=response.reason)


class KubernetesSource(KubernetesWatch[WorkerTarget]):
    """Watch the graph's Pods (`pod_target`: the workers; replica sync: the peer EPPs)."""

    def __init__(
        self,
        namespace: str,
        selector: str = "",
        configuration: Any = None,
        *,
        watch_timeout: int = 300,
        retry_interval: float = 1.0,
        target: Callable[[dict[str, Any]], WorkerTarget | None] = pod_target,
        fallback: EngineTemplate | None = None,
    ):
        self.fallback = fallback  # as StaticSource's
        super().__init__(
            namespace,
            _list_pods,
            target,
            what="pod",
            selector=selector,
            configuration=configuration,
            watch_timeout=watch_timeout,
            retry_interval=retry_interval,
        )


# ---- the live worker set --------------------------------------------------------------------


async def fetch_engine_config(
    session: aiohttp.ClientSession,
    engine_url: str,
    fetch_timeout: float = 2.0,
    name: str | None = None,
    fallback: EngineTemplate | None = None,
) -> EngineConfig:
    """The worker's `/v1/engine`; with `fallback`, a worker answering 404 there (an engine that
    does not serve our document) is what the fallback says."""
    # an engine that does not name itself is named by where it was found: the pod's name,
    # or host:port (EngineConfig fills its other missing fields itself)
    name = engine_url.rstrip("/").rpartition("/")[2] if name is None else name
    async with session.get(
        engine_url + ENGINE_PATH, timeout=aiohttp.ClientTimeout(total=fetch_timeout)
    ) as response:
        if response.status == 404 and fallback is not None:
            log.info(
                "engine %s serves no %s; described by %s", engine_url, ENGINE_PATH, fallback.source
            )
            return fallback.config_for(engine_url, name)
        if response.status == 404:
            log.warning(
                "engine %s serves no %s (404): not one of ours; describe such engines with "
                "--engine-config",
                engine_url,
                ENGINE_PATH,
            )
        response.raise_for_status()
        try:
            config = EngineConfig.model_validate_json(await response.read(), context={"name": name})
        except ValidationError as exc:  # unlike an engine still starting, not fixed by waiting
            log.warning("engine %s: its %s cannot be used: %s", engine_url, ENGINE_PATH, exc)
            raise
        if "kv_cache_block_size" not in config.model_fields_set:
            log.warning(
                "engine %s does not say its KV block size; assuming %d (vLLM's default)",
                engine_url,
                config.kv_cache_block_size,
            )
        return config


Listener = Callable[[WorkerRecord], None]


class Discovery:
    """The live set of workers: targets from a source, each confirmed by its `/v1/engine`."""

    def __init__(
        self,
        source: StaticSource | KubernetesSource,
        *,
        fetch_timeout: float = 2.0,
        retry_interval: float = 0.5,
        max_retry_interval: float = 5.0,
    ):
        self.source = source
        self.fetch_timeout = fetch_timeout
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self.records: dict[int, WorkerRecord] = {}
        self._targets: dict[str, WorkerTarget] = {}
        self._by_key: dict[str, WorkerRecord] = {}
        self._fetchers: dict[str, asyncio.Task[None]] = {}
        self._listeners: list[tuple[Listener | None, Listener | None]] = []
        self._changed = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._source_task: asyncio.Task[None] | None = None

    # -- lifecycle --
    async def start(self) -> None:
        self._session = aiohttp.ClientSession()
        self._source_task = asyncio.create_task(self._run_source(), name="discovery-source")

    async def _run_source(self) -> None:
        try:
            await self.source.run(self)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker discovery source failed")
            raise

    async def stop(self) -> None:
        tasks = [t for t in (self._source_task, *self._fetchers.values()) if t is not None]
        await cancel_all(tasks)
        self._fetchers.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- queries --
    def get(self, instance_id: int) -> WorkerRecord | None:
        return self.records.get(instance_id)

    def endpoint_of(self, instance_id: int) -> str | None:
        record = self.records.get(instance_id)
        return record.serving_endpoint if record else None

    def add_listener(
        self, on_added: Listener | None = None, on_removed: Listener | None = None
    ) -> None:
        """Called for every worker that appears or goes away; current workers count as added."""
        self._listeners.append((on_added, on_removed))
        if on_added is not None:
            for record in list(self.records.values()):
                on_added(record)

    async def wait_for(self, predicate: Callable[[], bool], within: float) -> bool:
        """Wait (bounded by `within` seconds) until predicate() holds."""
        async with asyncio.timeout(within):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()
        return True

    # -- the sink a source feeds --
    def sync(self, targets: Iterable[WorkerTarget]) -> None:
        wanted = {t.key: t for t in targets}
        for key in list(self._targets):
            if key not in wanted:
                self.remove(key)
        for target in wanted.values():
            self.upsert(target)

    def upsert(self, target: WorkerTarget) -> None:
        current = self._targets.get(target.key)
        if current == target:
            return
        if current is not None:
            self.remove(target.key)
        self._targets[target.key] = target
        self._start_fetch(target)

    def remove(self, key: str) -> None:
        self._targets.pop(key, None)
        task = self._fetchers.pop(key, None)
        if task is not None:
            task.cancel()
        self._unregister(key)

    def mark_unreachable(self, instance_id: int) -> None:
        """A worker stopped answering (scrapes failing): drop it and re-fetch until it is back."""
        record = self.records.get(instance_id)
        if record is None:
            return
        key = next((k for k, r in self._by_key.items() if r is record), None)
        if key is None or key not in self._targets:
            return
        log.warning("worker %s (%s) unreachable; removed", record.name, record.engine_url)
        self._unregister(key)
        self._start_fetch(self._targets[key])

    # -- internals --
    def _start_fetch(self, target: WorkerTarget) -> None:
        old = self._fetchers.pop(target.key, None)
        if old is not None:
            old.cancel()
        self._fetchers[target.key] = asyncio.create_task(
            self._fetch(target), name=f"discovery-fetch {target.key}"
        )

    async def _fetch(self, target: WorkerTarget) -> None:
        delay = self.retry_interval
        while True:
            assert self._session is not None, "Discovery.start() first"
            try:
                config = await fetch_engine_config(
                    self._session,
                    target.engine_url,
                    self.fetch_timeout,
                    name=target.key.rpartition("/")[2] if target.key != target.engine_url else None,
                    fallback=self.source.fallback,
                )
                break
            except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError) as exc:
                log.debug("engine %s not answering /v1/engine yet: %s", target.engine_url, exc)
            await asyncio.sleep(delay * (0.75 + random.random() / 2))
            delay = min(delay * 2, self.max_retry_interval)
        self._fetchers.pop(target.key, None)
        if self._targets.get(target.key) != target:
            return  # replaced or removed while fetching
        self._register(
            target.key,
            WorkerRecord(
                name=config.name,
                instance_id=config.instance_id,
                engine_url=target.engine_url,
                serving_endpoint=target.serving_endpoint,
                config=config,
            ),
        )

    def _register(self, key: str, record: WorkerRecord) -> None:
        previous = self.records.get(record.instance_id)
        if previous is not None:  # same worker under another key (pod moved): the new one wins
            old_key = next((k for k, r in self._by_key.items() if r is previous), None)
            if old_key is not None:
                self._unregister(old_key)
        self._by_key[key] = record
        self.records[record.instance_id] = record
        log.info(
            "worker added",
            extra={
                "worker": record.name,
                "instance_id": record.instance_id,
                "role": record.config.role.value,
                "endpoint": record.serving_endpoint,
            },
        )
        self._notify(record, added=True)

    def _unregister(self, key: str) -> None:
        record = self._by_key.pop(key, None)
        if record is None:
            return
        if self.records.get(record.instance_id) is record:
            del self.records[record.instance_id]
        log.info("worker removed", extra={"worker": record.name, "instance_id": record.instance_id})
        self._notify(record, added=False)

    def _notify(self, record: WorkerRecord, *, added: bool) -> None:
        for on_added, on_removed in self._listeners:
            callback = on_added if added else on_removed
            if callback is None:
                continue
            try:
                callback(record)
            except Exception:
                log.exception("discovery listener failed for %s", record.name)
        self._changed.set()


# ---- command line ---------------------------------------------------------------------------


def add_discovery_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("worker discovery")
    group.add_argument(
        "--discovery",
        choices=["static", "kubernetes"],
        default=os.environ.get("DYNAMOGRAPH_DISCOVERY", "static"),
        help="where workers come from (default: static, or $DYNAMOGRAPH_DISCOVERY)",
    )
    group.add_argument(
        "--worker",
        action="append",
        default=[],
        metavar="ENGINE_URL[=HOST:PORT]",
        help="static worker: its engine URL, then the serving endpoint Envoy sends to (repeat)",
    )
    group.add_argument(
        "--workers-file", help="YAML/JSON list of {engine: URL, endpoint: HOST:PORT}"
    )
    group.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "default"),
        help="Kubernetes namespace to watch (default: $POD_NAMESPACE or 'default')",
    )
    group.add_argument(
        "--selector",
        default=os.environ.get("DYNAMOGRAPH_SELECTOR", ""),
        help="label selector of the graph's worker pods, e.g. dynamograph.io/graph=g1",
    )
    group.add_argument(
        "--engine-config",
        metavar="FILE",
        default=os.environ.get("DYNAMOGRAPH_ENGINE_CONFIG") or None,
        help="YAML of EngineConfig fields (model, kv_cache_block_size, tokenizer, kv_events, "
        "...) describing workers whose /v1/engine answers 404 (engines we did not launch: vLLM, "
        "llm-d-inference-sim); kv_events addresses and topic may name the worker's {host} and "
        "{port}. Workers that serve /v1/engine keep their own (default: $DYNAMOGRAPH_ENGINE_CONFIG)",
    )


def source_from_args(args: argparse.Namespace) -> StaticSource | KubernetesSource:
    fallback = engine_template_from_args(args)
    if args.discovery == "kubernetes":
        target = functools.partial(pod_target, foreign=True) if fallback else pod_target
        return KubernetesSource(args.namespace, args.selector, target=target, fallback=fallback)
    targets = [parse_worker_flag(w) for w in args.worker]
    if args.workers_file:
        targets += load_workers_file(args.workers_file)
    if not targets:
        raise ValueError("static discovery needs --worker ENGINE_URL[=HOST:PORT] or --workers-file")
    return StaticSource(targets, fallback=fallback)


def engine_template_from_args(args: argparse.Namespace) -> EngineTemplate | None:
    return EngineTemplate.load(args.engine_config) if args.engine_config else None
