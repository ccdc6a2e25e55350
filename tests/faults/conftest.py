"""One supervised graph for the fault suite, with a TCP proxy on each link it partitions.

The graph (three workers, KV routing) is planned and started by `dynamograph up`'s own code
(`local.up.new_stack`, `local.supervisor.supervised`: restarts with back-off), with four
proxies (`proxy.TcpProxy`) spliced in:

- `envoy`: the clients → Envoy's listener (the load is sent through it);
- `epp`: Envoy → the EPP's ext_proc port (Envoy's config names the proxy);
- `frontend`: Envoy → worker-0's sidecar (the EPP's static discovery names the proxy as that
  worker's serving endpoint, so Envoy connects there);
- `worker`: worker-1's sidecar → its engine (the sidecar's `--engine-url`).
"""

import dataclasses
from pathlib import Path

import pytest
import pytest_asyncio
import yaml

from dynamograph.local import envoy as envoy_module
from dynamograph.local.procs import PortPool
from dynamograph.local.stack import Running, Stack
from dynamograph.local.supervisor import Supervisor, supervised
from dynamograph.local.up import new_stack
from dynamograph.protocol.graph import load_graph

from .proxy import TcpProxy

# Mock engines simulate GPU time this many times faster, as in tests/local.
SPEEDUP = 20.0

GRAPH = {
    "apiVersion": "dynamograph.io/v1alpha1",
    "kind": "DynamoGraph",
    "metadata": {"name": "faults"},
    "spec": {
        "model": {"name": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"},
        "services": {
            "worker": {"componentType": "worker", "replicas": 3},
            "epp": {"componentType": "epp", "router": {"mode": "kv"}},
        },
    },
}


@dataclasses.dataclass
class FaultStack:
    stack: Stack
    supervisor: Supervisor
    proxies: dict[str, TcpProxy]
    base_url: str  # through the `envoy` proxy
    model: str

    def proc(self, name: str) -> Running:
        return next(p for p in self.stack.running if p.spec.name == f"faults-{name}")

    @property
    def logs(self) -> Path:
        return self.stack.run_dir / "logs"


def _address(url_or_address: str) -> tuple[str, int]:
    host, _, port = url_or_address.removeprefix("http://").rpartition(":")
    return host, int(port)


def _splice(stack: Stack, name: str, old: str, new: str) -> None:
    """Replace `old` with `new` in the command line of process `name` (exactly one argument)."""
    processes = stack.plan.processes
    index = next(i for i, p in enumerate(processes) if p.name == name)
    argv = [a.replace(old, new) for a in processes[index].argv]
    assert sum(old in a for a in processes[index].argv) == 1, (name, old)
    processes[index] = dataclasses.replace(processes[index], argv=tuple(argv))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def faults(tmp_path_factory):
    try:
        envoy_module.find_envoy()
    except envoy_module.EnvoyNotFound as exc:
        pytest.skip(f"needs a real Envoy: {exc}")
    root = tmp_path_factory.mktemp("faults")
    path = root / "faults.yaml"
    path.write_text(yaml.safe_dump(GRAPH))
    pool = PortPool()  # held while the graph is planned, so its ports differ from these
    ports = {link: pool.take() for link in ("envoy", "epp", "frontend", "worker")}
    epp_address: list[str] = []

    def envoy_config_via_proxy(**kw):
        epp_address.append(kw["epp_address"])
        return envoy_module.envoy_config(**{**kw, "epp_address": f"127.0.0.1:{ports['epp']}"})

    try:
        stack = new_stack(
            load_graph(path), root / "faults", SPEEDUP, envoy_config=envoy_config_via_proxy
        )
    finally:
        pool.release()
    engines = {p.name: p for p in stack.plan.engines()}
    sidecar0 = str(engines["faults-worker-0"].serving)
    engine1 = str(engines["faults-worker-1"].engine_url)
    _splice(stack, "faults-epp", f"={sidecar0}", f"=127.0.0.1:{ports['frontend']}")
    _splice(stack, "faults-worker-1-frontend", engine1, f"http://127.0.0.1:{ports['worker']}")
    envoy_listener = _address(stack.plan.base_url.removesuffix("/v1"))
    proxies = {
        "envoy": TcpProxy(ports["envoy"], envoy_listener),
        "epp": TcpProxy(ports["epp"], _address(epp_address[0])),
        "frontend": TcpProxy(ports["frontend"], _address(sidecar0)),
        "worker": TcpProxy(ports["worker"], _address(engine1)),
    }
    try:
        for proxy in proxies.values():
            await proxy.start()
        async with supervised(stack) as supervisor:
            yield FaultStack(
                stack,
                supervisor,
                proxies,
                f"http://127.0.0.1:{ports['envoy']}/v1",
                stack.plan.model,
            )
    finally:
        for proxy in proxies.values():
            await proxy.close()
