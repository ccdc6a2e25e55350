"""Deleting the namespace of a reconciled graph, against the real control plane: the namespace
controller removes everything, the operator creates nothing there meanwhile (the apiserver would
refuse it: "unable to create new content in namespace … because it is being terminated") and
logs no error about it."""

import datetime

from .conftest import describe, get, wait_for
from .test_operator import OPERATOR_USER, graph_manifest, ready_graph

WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def hold_graph_deletion(cp, namespace: str) -> str:
    """A ValidatingAdmissionPolicy refusing to delete DynamoGraphs in `namespace`, so that the
    namespace controller, which deletes a namespace's kinds in no fixed order, deletes all the
    rest first and keeps trying: the window in which a pass would re-create the graph's objects
    (the graph is there and not being deleted, its namespace is), held open. Returns its name."""
    name = f"hold-graphs-{namespace}"
    cp.kubectl_apply(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": ["dynamograph.io"],
                            "apiVersions": ["*"],
                            "operations": ["DELETE"],
                            "resources": ["dynamographs"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": "held by the test"}],
            },
        }
    )
    cp.kubectl_apply(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
                },
            },
        }
    )
    return name


def operator_requests(cp, namespace: str, since: str) -> list[dict]:
    return [
        e
        for e in cp.audit_events(OPERATOR_USER)
        if (e.get("objectRef") or {}).get("namespace") == namespace
        and e["requestReceivedTimestamp"] >= since
    ]


def summary(e: dict) -> str:
    ref, status = e["objectRef"], e.get("responseStatus", {})
    what = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
    return f"{e['verb']} {what} {ref.get('name', '')}: {status.get('code')} {status.get('message', '')}"


def test_a_namespace_being_deleted_is_left_to_the_namespace_controller(
    control_plane, operator, namespace
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl_apply(graph_manifest("g", namespace))
    wait_for("graph g Ready", lambda: ready_graph(cp, namespace, "g"), 120, describe=show)
    hold = hold_graph_deletion(cp, namespace)
    wait_for(
        "the hold on the graph's deletion in force",
        lambda: (
            cp.kubectl(
                "delete", "dg", "g", "-n", namespace, "--dry-run=server", check=False
            ).returncode
            != 0
        ),
        30,
    )

    offset = len(operator.log_tail(10**8))
    since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    cp.kubectl("delete", "namespace", namespace, "--wait=false")
    try:
        # The namespace controller deletes what it can (the graph's Deployments among it); the
        # graph itself stays, alive, while its namespace is being deleted.
        wait_for(
            "the namespace controller to delete the graph's Deployments",
            lambda: get(cp, "deployments", "-n", namespace)["items"] == [],
            90,
            describe=show,
        )
        assert get(cp, "dg", "g", "-n", namespace)["metadata"].get("deletionTimestamp") is None
        # Passes of the operator over the graph meanwhile (its timer runs every 2 s): each
        # reads it.
        mark = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        wait_for(
            "two passes of the operator over graph g in the namespace being deleted",
            lambda: (
                sum(
                    e["verb"] == "get" and e["objectRef"].get("resource") == "dynamographs"
                    for e in operator_requests(cp, namespace, mark)
                )
                >= 2
            ),
            30,
            describe=show,
        )
    finally:  # also when a wait above failed: the namespace must not stay held
        cp.kubectl("delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", hold)
    wait_for(
        f"namespace {namespace} gone", lambda: get(cp, "namespace", namespace) is None, 120,
        describe=show,
    )  # fmt: skip

    # What the operator wrote in the namespace since its deletion began: nothing but kopf's own
    # patches of the graph (its finalizer, removed once the graph was deleted).
    writes = [
        summary(e)
        for e in operator_requests(cp, namespace, since)
        if e["verb"] in WRITES
        and (e["objectRef"].get("resource"), e["objectRef"].get("subresource"))
        != ("dynamographs", None)
    ]
    assert writes == [], "the operator wrote into the namespace being deleted:\n" + "\n".join(
        writes
    )
    complaints = [
        ln
        for ln in operator.log_tail(10**8)[offset:].splitlines()
        if ln.split()[2:3] in (["WARNING"], ["ERROR"], ["CRITICAL"])
    ]
    assert complaints == [], "the operator complained:\n" + "\n".join(complaints)
