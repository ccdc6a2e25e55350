"""What a local stack is made of: process specs and the plan, as plain data.

Kept apart from the planner (`plan.py`, which needs the DynamoGraph models) so that the
supervisor, `down` and `up --status` load quickly and work from a state file alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

HOST = "127.0.0.1"

# Start order: engines first (the frontends and the EPP read their /v1/engine), then the
# routing tier, then Envoy (whose ext_proc filter needs the EPP).
STAGE_ENGINES, STAGE_ROUTERS, STAGE_GATEWAY = 0, 1, 2


@dataclass(frozen=True)
class Probe:
    """How to tell a process is ready: `http` GET answering 200, or a gRPC health `Check`."""

    kind: str  # "http" | "grpc"
    target: str  # URL (http) or host:port (grpc)
    service: str = ""  # gRPC health service name


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # unique in the plan; for engines also the instance-id source (the "pod name")
    kind: str  # "engine" | "frontend" | "epp" | "envoy"
    argv: tuple[str, ...]
    stage: int
    ready: Probe
    ports: dict[str, int]
    service: str = ""  # the graph service it belongs to
    role: str = ""  # engines: aggregated | prefill | decode
    engine_url: str | None = None  # engines: base URL of the OpenAI server (/metrics, /v1/engine)
    serving: str | None = None  # engines behind a sidecar: the sidecar's host:port
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    graph: str
    model: str  # the served model name clients send
    processes: list[ProcessSpec]
    base_url: str  # OpenAI base URL: Envoy's listener
    files: dict[str, str]  # path -> content to write before starting (Envoy's config)
    notes: list[str]  # things the local run does differently from the cluster, for the user

    def engines(self) -> list[ProcessSpec]:
        return [p for p in self.processes if p.kind == "engine"]
