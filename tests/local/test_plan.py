"""The pure plan: a DynamoGraph becomes the right processes, ports and command lines."""

import argparse
import importlib
import json
from pathlib import Path

import pytest
import yaml

from dynamograph.local.envoy import EPP_STREAMS_PER_CONNECTION
from dynamograph.local.plan import plan_graph
from dynamograph.local.spec import STAGE_ENGINES, STAGE_GATEWAY, STAGE_ROUTERS
from dynamograph.local.up import DEFAULT_GRAPH, EXAMPLES
from dynamograph.protocol.graph import load_graph
from dynamograph.protocol.kv_curve import KV_CURVE_ENV
from dynamograph.protocol.launch import ADMIN_TOKEN_ENV, admin_token_env
from dynamograph.protocol.router_config import RouterConfig

pytestmark = pytest.mark.unit

RUN = Path("/run/dg")


class Ports:
    """A deterministic allocator: consecutive numbers, so tests can see overlaps."""

    def __init__(self, start=20000):
        self.next = start
        self.calls = []

    def __call__(self, n):
        self.calls.append(n)
        first = self.next
        self.next += n
        return first


def fake_envoy_config(**kwargs):
    return {"envoy": kwargs}


def plan(source, **kw):
    graph = load_graph(source)
    return plan_graph(
        graph, RUN, Ports(), envoy_binary="/bin/envoy", envoy_config=fake_envoy_config, **kw
    )


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


def args_of(argv, flag):
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def graph_dict(**services):
    return {
        "apiVersion": "dynamograph.io/v1alpha1",
        "kind": "DynamoGraph",
        "metadata": {"name": "t"},
        "spec": {
            "model": {"name": "Qwen/Qwen3-0.6B", "servedModelName": "qwen"},
            "services": services,
        },
    }


def test_default_graph_is_the_bundled_aggregated_example():
    assert DEFAULT_GRAPH == EXAMPLES / "agg.yaml" and DEFAULT_GRAPH.is_file()


def test_aggregated_example_engines_sidecars_epp_envoy():
    p = plan(DEFAULT_GRAPH)
    kinds = [x.kind for x in p.processes]
    assert kinds.count("engine") == 4 and kinds.count("frontend") == 4
    assert kinds.count("epp") == 1 and kinds.count("envoy") == 1
    stages = {x.kind: x.stage for x in p.processes}
    assert stages == {
        "engine": STAGE_ENGINES,
        "frontend": STAGE_ROUTERS,
        "epp": STAGE_ROUTERS,
        "envoy": STAGE_GATEWAY,
    }
    names = [x.name for x in p.processes]
    assert len(set(names)) == len(names)
    assert [e.name for e in p.engines()] == [f"agg-worker-{i}" for i in range(4)]
    assert p.model == "qwen"
    # Every port is distinct.
    ports = [port for x in p.processes for port in x.ports.values()]
    assert len(set(ports)) == len(ports)


def test_engine_command_line_follows_the_graph():
    p = plan(DEFAULT_GRAPH, speedup=50.0)
    engine = p.engines()[0]
    argv = engine.argv
    assert argv[1:4] == ("-m", "dynamograph.cli", "worker")
    assert arg(argv, "--engine") == "mock"
    assert arg(argv, "--model") == "Qwen/Qwen3-0.6B"
    assert arg(argv, "--served-model-name") == "qwen"
    assert arg(argv, "--role") == "aggregated"
    assert arg(argv, "--name") == engine.name
    assert arg(argv, "--host") == "127.0.0.1"
    assert arg(argv, "--block-size") == "16"
    assert arg(argv, "--num-gpu-blocks") == "2048"
    assert arg(argv, "--max-num-seqs") == "64"
    assert arg(argv, "--speedup") == "50.0"  # the override wins over engine.speedup
    assert int(arg(argv, "--port")) == engine.ports["engine"]
    assert int(arg(argv, "--kv-events-port")) == engine.ports["kv-events"]
    assert engine.engine_url == f"http://127.0.0.1:{engine.ports['engine']}"
    assert engine.ready.target == engine.engine_url + "/health"


def test_sidecars_and_epp_point_at_the_engines():
    p = plan(DEFAULT_GRAPH)
    engines = {e.engine_url: e for e in p.engines()}
    sidecars = [x for x in p.processes if x.kind == "frontend"]
    for sidecar in sidecars:
        engine = engines[arg(sidecar.argv, "--engine-url")]
        assert engine.serving == f"127.0.0.1:{sidecar.ports['http']}"
        assert "--discovery" not in sidecar.argv  # aggregated: no prefill workers to find
    epp = next(x for x in p.processes if x.kind == "epp")
    workers = args_of(epp.argv, "--worker")
    assert sorted(workers) == sorted(f"{e.engine_url}={e.serving}" for e in p.engines())
    assert arg(epp.argv, "--discovery") == "static"
    assert arg(epp.argv, "--overlap-weight") == "1.0"
    assert arg(epp.argv, "--kv-events") == "on"
    assert p.notes == []
    config = yaml.safe_load(p.files[arg(epp.argv, "--config")])
    assert config["picker"]["type"] == "kv" and config["use_kv_events"] is True


def test_envoy_fronts_the_epp_and_is_the_base_url():
    p = plan(DEFAULT_GRAPH)
    envoy = next(x for x in p.processes if x.kind == "envoy")
    epp = next(x for x in p.processes if x.kind == "epp")
    config_path = arg(envoy.argv, "-c")
    assert envoy.argv[0] == "/bin/envoy" and "--disable-hot-restart" in envoy.argv
    assert config_path == str(RUN / "envoy.json")
    config = json.loads(p.files[config_path])["envoy"]
    assert config == {
        "listen_port": envoy.ports["http"],
        "admin_port": envoy.ports["admin"],
        "epp_address": f"127.0.0.1:{epp.ports['grpc']}",
        "failure_mode_allow": False,  # the example's gateway.failureMode: FailClose
    }
    assert p.base_url == f"http://127.0.0.1:{envoy.ports['http']}/v1"
    assert envoy.ready.target == f"http://127.0.0.1:{envoy.ports['admin']}/ready"


def test_disaggregated_example_prefill_without_sidecar():
    p = plan(EXAMPLES / "disagg.yaml")
    engines = p.engines()
    prefill = [e for e in engines if e.role == "prefill"]
    decode = [e for e in engines if e.role == "decode"]
    assert len(prefill) == 2 and len(decode) == 2
    assert all(e.serving is None for e in prefill) and all(e.serving for e in decode)
    assert all(arg(e.argv, "--max-num-batched-tokens") == "8192" for e in prefill)
    epp = next(x for x in p.processes if x.kind == "epp")
    workers = args_of(epp.argv, "--worker")
    assert sorted(workers) == sorted(
        [e.engine_url for e in prefill] + [f"{e.engine_url}={e.serving}" for e in decode]
    )
    sidecars = [x for x in p.processes if x.kind == "frontend"]
    assert len(sidecars) == 2
    for sidecar in sidecars:
        assert arg(sidecar.argv, "--discovery") == "static"
        assert sorted(args_of(sidecar.argv, "--worker")) == sorted(e.engine_url for e in prefill)


def test_data_parallel_engines_get_a_port_per_rank():
    ports = Ports()
    graph = load_graph(
        graph_dict(worker={"componentType": "worker", "replicas": 2, "dataParallelSize": 3})
    )
    p = plan_graph(graph, RUN, ports, envoy_binary="e", envoy_config=fake_envoy_config)
    assert 3 in ports.calls
    first, second = p.engines()
    assert arg(first.argv, "--data-parallel-size") == "3"
    events = {first.ports["kv-events"] + r for r in range(3)}
    replay = {first.ports["kv-replay"] + r for r in range(3)}
    others = {port for x in p.processes for port in x.ports.values()} - {
        first.ports["kv-events"],
        first.ports["kv-replay"],
    }
    assert not (events & replay) and not (events & others) and not (replay & others)
    assert second.ports["engine"] not in events | replay


def test_an_engine_config_is_not_passed_to_the_local_epp_and_the_plan_says_so():
    services = {"w": {"componentType": "worker", "replicas": 1}, "epp": {"componentType": "epp"}}
    source = graph_dict(**services)
    source["spec"]["engineConfig"] = {"total_kv_blocks": 4096, "engine": "llm-d-inference-sim"}
    p = plan(source)
    assert any(n.startswith("engineConfig: not used locally") for n in p.notes)
    (epp,) = [x for x in p.processes if x.kind == "epp"]
    assert "--engine-config" not in epp.argv
    # the same processes as without it: the graph's own engines describe themselves
    assert [x.argv[2:] for x in p.processes if x.kind != "envoy"] == [
        x.argv[2:] for x in plan(graph_dict(**services)).processes if x.kind != "envoy"
    ]


def test_graph_without_epp_runs_a_default_one_and_says_so():
    p = plan(graph_dict(w={"componentType": "worker", "replicas": 1}))
    assert any("no epp service" in n for n in p.notes)
    assert sum(x.kind == "epp" for x in p.processes) == 1


def test_router_settings_reach_the_epp_flags_and_config_file():
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            epp={
                "componentType": "epp",
                "router": {
                    "mode": "round-robin",
                    "temperature": 0.5,
                    "enforceDisagg": True,
                    "kvEvents": False,
                },
            },
        )
    )
    epp = next(x for x in p.processes if x.kind == "epp")
    assert arg(epp.argv, "--temperature") == "0.5"
    assert arg(epp.argv, "--kv-events") == "off"
    assert "--enforce-disagg" in epp.argv
    sidecar = next(x for x in p.processes if x.kind == "frontend")
    assert "--enforce-disagg" in sidecar.argv
    config = yaml.safe_load(p.files[arg(epp.argv, "--config")])
    assert config["picker"]["type"] == "round-robin" and config["use_kv_events"] is False
    assert config["temperature"] == 0.5 and config["enforce_disagg"] is True
    RouterConfig.model_validate(config)  # the EPP accepts the file


def test_approx_mode_is_kv_without_events():
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            epp={"componentType": "epp", "router": {"mode": "approx", "busyThreshold": 0.9}},
        )
    )
    epp = next(x for x in p.processes if x.kind == "epp")
    assert arg(epp.argv, "--kv-events") == "off"
    config = yaml.safe_load(p.files[arg(epp.argv, "--config")])
    assert config["picker"]["type"] == "kv" and config["busy_threshold"] == 0.9


def test_standalone_frontend_service_routes_by_itself():
    p = plan(
        graph_dict(
            w={"componentType": "worker", "replicas": 2},
            fe={"componentType": "frontend", "router": {"mode": "round-robin"}},
        )
    )
    front = next(x for x in p.processes if x.name == "t-fe-0")
    assert arg(front.argv, "--mode") == "round-robin"
    assert "--engine-url" not in front.argv
    assert sorted(args_of(front.argv, "--worker")) == sorted(
        f"{e.engine_url}={e.serving}" for e in p.engines()
    )
    assert any(f"http://127.0.0.1:{front.ports['http']}/v1" in n for n in p.notes)


def test_a_kv_standalone_frontend_gets_its_own_router_config():
    """As the operator renders it: the service's `router` section, not the EPP's, in a
    config file of its own, and its KV events switch."""
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            epp={"componentType": "epp", "router": {"overlapWeight": 5.0}},
            fe={"componentType": "frontend", "router": {"busyThreshold": 0.9, "kvEvents": False}},
        )
    )
    front = next(x for x in p.processes if x.name == "t-fe-0")
    assert arg(front.argv, "--mode") == "kv" and arg(front.argv, "--kv-events") == "off"
    config = RouterConfig.model_validate(
        yaml.safe_load(p.files[arg(front.argv, "--router-config")])
    )
    assert config.busy_threshold == 0.9 and not config.use_kv_events
    epp = next(x for x in p.processes if x.kind == "epp")
    assert arg(epp.argv, "--config") != arg(front.argv, "--router-config")
    assert "--replica-peers" not in front.argv  # one replica: nobody to share bookings with


def test_admission_limits_reach_the_epp_and_a_kv_frontend():
    """`router.maxPendingPicks` and `maxLoopLagSeconds` become each router process's flags, as
    the operator renders them; unset, the processes keep their own defaults."""
    limits = {"maxPendingPicks": 32, "maxLoopLagSeconds": 0}
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            epp={"componentType": "epp", "router": limits},
            fe={"componentType": "frontend", "router": {"maxPendingPicks": 8}},
            rr={"componentType": "frontend", "router": {"mode": "round-robin"}},
        )
    )
    epp = next(x for x in p.processes if x.kind == "epp")
    assert (arg(epp.argv, "--max-pending-picks"), arg(epp.argv, "--max-loop-lag")) == ("32", "0")
    front = next(x for x in p.processes if x.name == "t-fe-0")
    assert arg(front.argv, "--max-pending-picks") == "8" and "--max-loop-lag" not in front.argv
    for process in p.processes:
        if process.kind == "frontend" and process is not front:
            assert "--max-pending-picks" not in process.argv, process.name


def test_kv_standalone_frontend_replicas_share_their_bookings():
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            fe={"componentType": "frontend", "replicas": 3},
        )
    )
    fronts = [x for x in p.processes if x.kind == "frontend" and x.name.startswith("t-fe-")]
    own = [int(arg(f.argv, "--replica-port")) for f in fronts]
    assert len(set(own)) == 3
    for front, port in zip(fronts, own, strict=True):
        peers = arg(front.argv, "--replica-peers").split(",")
        assert sorted(peers) == sorted(f"127.0.0.1:{p}" for p in own if p != port)


def test_fail_open_gateway():
    p = plan(
        {
            **graph_dict(w={"componentType": "worker"}),
            "spec": {
                **graph_dict(w={"componentType": "worker"})["spec"],
                "gateway": {"failureMode": "FailOpen"},
            },
        }
    )
    envoy = next(x for x in p.processes if x.kind == "envoy")
    config = json.loads(p.files[arg(envoy.argv, "-c")])["envoy"]
    assert config["failure_mode_allow"] is True
    # Without the EPP Envoy may only choose among the pool's endpoints: the serving sidecars.
    assert config["pool_endpoints"] == [e.serving for e in p.engines()]


def test_service_env_reaches_the_engine():
    p = plan(
        graph_dict(
            w={"componentType": "worker", "envs": [{"name": "FOO", "value": "bar"}]},
        )
    )
    env = p.engines()[0].env
    assert env["FOO"] == "bar" and set(env) == {"FOO", ADMIN_TOKEN_ENV}


def test_a_graphs_engines_share_one_admin_token_that_only_they_get():
    """Decode engines pull KV from prefill engines with it; a new one on every `up`."""
    graph = graph_dict(p={"componentType": "prefill"}, d={"componentType": "decode", "replicas": 2})
    first, second = plan(graph), plan(graph)
    tokens = {e.env[ADMIN_TOKEN_ENV] for e in first.engines()}
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert first.engines()[0].env != second.engines()[0].env
    assert all(ADMIN_TOKEN_ENV not in p.env for p in first.processes if p.kind != "engine")


def test_on_kubernetes_the_admin_token_comes_from_the_graphs_secret():
    """What the operator is to put into engine pods (protocol.launch), by the same name."""
    graph = load_graph(graph_dict(w={"componentType": "worker"}))
    assert admin_token_env(graph) == {
        "name": ADMIN_TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": "t-admin-token", "key": "token"}},
    }


@pytest.mark.parametrize("example", ["agg.yaml", "disagg.yaml"])
def test_command_lines_parse_with_the_components_own_parsers(example):
    """The plan speaks each component's real CLI (docs/contracts.md), not a guess of it."""
    modules = {
        "worker": "dynamograph.worker.cli",
        "frontend": "dynamograph.frontend.cli",
        "epp": "dynamograph.epp.cli",
    }
    p = plan(EXAMPLES / example)
    for proc in p.processes:
        if proc.kind == "envoy":
            continue
        command = proc.argv[3]
        module = importlib.import_module(modules[command])
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        parser.parse_args(list(proc.argv[4:]))  # SystemExit (a failure) on any unknown flag


def test_kv_curve_gives_every_process_but_envoy_the_runs_key_folder():
    p = plan(DEFAULT_GRAPH, kv_curve=True)
    folder = RUN / "kv-curve"
    for process in p.processes:
        expected = None if process.kind == "envoy" else str(folder)
        assert process.env.get(KV_CURVE_ENV) == expected, process.name
    keys = {Path(path).name for path in p.files if Path(path).parent == folder}
    assert keys == {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    # off by default
    p = plan(DEFAULT_GRAPH)
    assert all(KV_CURVE_ENV not in process.env for process in p.processes)
    assert not any("kv-curve" in path for path in p.files)
    # the graph's own spec.kvEvents.curve turns it on as --kv-curve does
    spec = graph_dict(w={"componentType": "worker"}, epp={"componentType": "epp"})
    spec["spec"]["kvEvents"] = {"curve": True}
    p = plan(spec)
    assert {x.env.get(KV_CURVE_ENV) for x in p.processes if x.kind != "envoy"} == {str(folder)}


def test_epp_replicas_and_processes_run_active_active_behind_envoy():
    p = plan(
        graph_dict(
            w={"componentType": "worker"},
            epp={"componentType": "epp", "replicas": 2, "router": {"processes": 2}},
        )
    )
    epps = [x for x in p.processes if x.kind == "epp"]
    assert [e.name for e in epps] == ["t-epp-0", "t-epp-1"] and p.notes == []
    first, second = (e.ports["replica-sync"] for e in epps)
    assert arg(epps[0].argv, "--processes") == "2"
    # each replica's two processes sync with the other replica's two
    assert arg(epps[0].argv, "--replica-port") == str(first)
    assert arg(epps[0].argv, "--replica-peers") == f"127.0.0.1:{second},127.0.0.1:{second + 1}"
    assert arg(epps[1].argv, "--replica-peers") == f"127.0.0.1:{first},127.0.0.1:{first + 1}"
    # each process of an EPP serves /metrics at --metrics-port + 1 + i: ports no one else gets
    taken = {port for x in p.processes for port in x.ports.values()}
    taken |= {port + 1 for port in (first, second)}  # the replica-sync blocks' second ports
    for epp in epps:
        children = {int(arg(epp.argv, "--metrics-port")) + 1 + i for i in range(2)}
        assert not children & taken, (children, taken)
    envoy = next(x for x in p.processes if x.kind == "envoy")
    config = json.loads(p.files[arg(envoy.argv, "-c")])["envoy"]
    assert config["epp_address"] == f"127.0.0.1:{epps[0].ports['grpc']}"
    assert config["epp_replicas"] == [f"127.0.0.1:{epps[1].ports['grpc']}"]
    # several processes per port: Envoy must open several connections for all to get requests
    assert config["epp_streams_per_connection"] == EPP_STREAMS_PER_CONNECTION
    for epp in epps:  # the flags parse as `dynamograph epp` reads them
        parser = argparse.ArgumentParser()
        importlib.import_module("dynamograph.epp.cli").add_arguments(parser)
        parser.parse_args(list(epp.argv[4:]))
