"""Instance id → engine: the only addresses the frontend ever sends to.

Two sets of workers, both from `epp.discovery` (no second discovery): this pod's own engine
(`--engine-url`, its id learned from its `/v1/engine`, retried until it answers) and the graph's
workers (static flags or the Kubernetes pod watch). A request names workers by id only; an id
that is in neither set is refused with 503, never resolved from anything the request carries.
"""

from collections.abc import Iterable

from dynamograph.protocol.engine import Role
from dynamograph.protocol.openai import OpenAIError
from dynamograph.router.discovery import (
    Discovery,
    Listener,
    StaticSource,
    WorkerRecord,
    parse_worker_flag,
)

from .routing import Target

DECODE_ROLES = (Role.AGGREGATED, Role.DECODE)


class WorkerDirectory:
    def __init__(self, engine_url: str | None, graph: Discovery | None):
        self._local_target = parse_worker_flag(engine_url) if engine_url else None
        self.local = Discovery(StaticSource([self._local_target])) if self._local_target else None
        self.graph = graph

    async def start(self) -> None:
        for discovery in self._discoveries():
            await discovery.start()

    async def stop(self) -> None:
        for discovery in self._discoveries():
            await discovery.stop()

    def _discoveries(self) -> list[Discovery]:
        return [d for d in (self.local, self.graph) if d is not None]

    @property
    def local_record(self) -> WorkerRecord | None:
        if self.local is None or not self.local.records:
            return None
        return next(iter(self.local.records.values()))

    def not_ready(self) -> str | None:
        """Why the frontend cannot serve yet, or None. A sidecar waits for its own engine's
        `/v1/engine`; a standalone frontend for a decode or aggregated worker."""
        if self.local is not None:
            if not self.local.records:
                return f"engine at {self.local_url} has not answered /v1/engine yet"
            return None
        if not self.with_roles(DECODE_ROLES):
            return "no decode or aggregated workers are discovered yet"
        return None

    def ready(self) -> bool:
        return self.not_ready() is None

    def get(self, instance_id: int) -> WorkerRecord | None:
        local = self.local_record
        if local is not None and local.instance_id == instance_id:
            return local
        return self.graph.get(instance_id) if self.graph is not None else None

    def records(self) -> list[WorkerRecord]:
        """Every known worker once (the local engine may also be in the graph's set)."""
        found: dict[int, WorkerRecord] = {}
        for discovery in self._discoveries():
            for record in discovery.records.values():
                found.setdefault(record.instance_id, record)
        return list(found.values())

    def with_roles(self, roles: Iterable[Role]) -> list[WorkerRecord]:
        roles = set(roles)
        return sorted(
            (r for r in self.records() if r.config.role in roles), key=lambda r: r.instance_id
        )

    def resolve(self, target: Target, leg: str) -> WorkerRecord:
        """The discovered worker a target names; 503 when unknown, 400 for a DP rank it lacks."""
        record = self.get(target.worker_id)
        if record is None:
            if self.local is not None and not self.local.records:
                raise OpenAIError(
                    503,
                    f"frontend not ready: its engine at {self.local_url} has not answered "
                    "/v1/engine yet, so the local worker id is not known",
                )
            raise OpenAIError(
                503,
                f"unknown {leg} worker instance id {target.worker_id}: not among the "
                f"{len(self.records())} discovered workers (not ready, removed, or never part "
                "of this graph)",
            )
        size = record.config.data_parallel_size
        if target.dp_rank is not None and target.dp_rank >= size:
            raise OpenAIError(
                400,
                f"{leg} data-parallel rank {target.dp_rank} is out of range for worker "
                f"{record.name} ({target.worker_id}), which has data_parallel_size {size}",
            )
        return record

    @property
    def local_url(self) -> str | None:
        return self._local_target.engine_url if self._local_target else None

    def add_listener(self, on_added: Listener, on_removed: Listener) -> None:
        """Worker appeared / went away, from either set (a worker may be in both)."""
        for discovery in self._discoveries():
            discovery.add_listener(on_added, on_removed)

    def mark_unreachable(self, instance_id: int) -> None:
        """Connection refused: drop the worker until its `/v1/engine` answers again."""
        for discovery in self._discoveries():
            discovery.mark_unreachable(instance_id)
