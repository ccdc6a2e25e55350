"""The EPP Deployment the operator renders for active-active replicas (docs/epp.md, replicas
and processes): every EPP pod syncs its bookings with the others, found by the EPP pods' labels,
on the ports the EPP's NetworkPolicy opens to them alone; `router.processes` and
`router.replicaTimeoutSeconds` reach the command line; scaling the EPP keeps its pod template."""

import argparse

from dynamograph.epp.cli import add_arguments
from dynamograph.protocol.launch import EPP_REPLICA_PORT
from dynamograph.router.discovery import selector_matches

from .test_manifests import args_of, build, container
from .test_production_manifests import allows, pod_labels


def epp_router(processes=None, timeout=None, replicas=None):
    def mutate(body):
        epp = body["spec"]["services"]["epp"]
        router = epp.setdefault("router", {})
        if processes is not None:
            router["processes"] = processes
        if timeout is not None:
            router["replicaTimeoutSeconds"] = timeout
        if replicas is not None:
            epp["replicas"] = replicas

    return mutate


def test_epp_pods_sync_with_each_other_on_their_own_ports():
    _, objs = build("disagg.yaml", epp_router(processes=3, timeout=2))
    deployment = objs["Deployment", "disagg-epp"]
    args = args_of(container(deployment, "epp"))
    assert args["--processes"] == "3"
    assert args["--replica-port"] == str(EPP_REPLICA_PORT)
    assert args["--replica-timeout"] == "2"
    # the selector finds the EPP's own pods, and no other pod of the graph
    epp = pod_labels(deployment)
    assert selector_matches(str(args["--replica-selector"]), epp)
    for name in ("disagg-decode", "disagg-prefill"):
        assert not selector_matches(
            str(args["--replica-selector"]), pod_labels(objs["Deployment", name])
        )
    # the EPP's NetworkPolicy lets the other EPP pods reach every process's sync port, only them
    policy = objs["NetworkPolicy", "disagg-epp"]
    decode = pod_labels(objs["Deployment", "disagg-decode"])
    for port in range(EPP_REPLICA_PORT, EPP_REPLICA_PORT + 3):
        assert allows(policy, epp, port)
        assert not allows(policy, decode, port) and not allows(policy, None, port)
    assert not allows(policy, epp, EPP_REPLICA_PORT + 3)
    # the flags parse as `dynamograph epp` reads them
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parsed = parser.parse_args(container(deployment, "epp")["args"][1:])
    assert (parsed.processes, parsed.replica_port, parsed.replica_timeout) == (
        3,
        EPP_REPLICA_PORT,
        2.0,
    )


def test_default_resources_grow_with_the_processes():
    _, objs = build("disagg.yaml", epp_router(processes=4))
    resources = container(objs["Deployment", "disagg-epp"], "epp")["resources"]
    assert resources == {
        "requests": {"cpu": "2000m", "memory": "2048Mi"},
        "limits": {"memory": "8Gi"},
    }


def test_scaling_the_epp_keeps_its_pod_template():
    _, one = build("disagg.yaml", epp_router(replicas=1))
    _, three = build("disagg.yaml", epp_router(replicas=3))
    template = one["Deployment", "disagg-epp"]["spec"]["template"]
    assert three["Deployment", "disagg-epp"]["spec"]["template"] == template
    assert args_of(container(one["Deployment", "disagg-epp"], "epp"))["--processes"] == "1"
