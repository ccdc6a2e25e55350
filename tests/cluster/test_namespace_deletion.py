"""Deleting the namespace of a reconciled graph, against the real control plane: the namespace
controller removes everything, the operator creates nothing there meanwhile (the apiserver would
refuse it: "unable to create new content in namespace … because it is being terminated") and
logs no error about it. Also when the deletion overtakes a pass that is creating objects: the
pass stops at the first create so refused, writing no status and posting no Event."""

import base64
import contextlib
import datetime
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .conftest import describe, get, wait_for
from .test_operator import OPERATOR_USER, graph_manifest, ready_graph

WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def now() -> str:
    """The audit log's timestamp format, for comparisons with requestReceivedTimestamp."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@contextlib.contextmanager
def held_graph_deletion(cp, namespace: str, graph: str) -> Iterator[None]:
    """A ValidatingAdmissionPolicy refusing to delete DynamoGraphs in `namespace`, in force
    (graph `graph`'s deletion is refused) on entry and removed on exit. The namespace controller,
    which deletes a namespace's kinds in no fixed order, then deletes all the rest first and
    keeps trying: the window in which a pass would re-create the graph's objects (the graph is
    there and not being deleted, its namespace is), held open."""
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
    try:
        cp.kubectl_apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingAdmissionPolicyBinding",
                "metadata": {"name": name},
                "spec": {
                    "policyName": name,
                    "validationActions": ["Deny"],
                    "matchResources": {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": namespace}
                        }
                    },
                },
            }
        )
        wait_for(
            "the hold on the graph's deletion in force",
            lambda: (
                cp.kubectl(
                    "delete", "dg", graph, "-n", namespace, "--dry-run=server", check=False
                ).returncode
                != 0
            ),
            30,
        )
        yield
    finally:  # also when a test failed: the namespace must not stay held
        cp.kubectl(
            "delete", "validatingadmissionpolicybinding,validatingadmissionpolicy", name,
            "--ignore-not-found",
        )  # fmt: skip


@dataclass
class CreateHold:
    """What `held_first_create` saw: `held` is set once the operator's first create is waiting
    in the webhook (`what` names it); setting `release` lets it through."""

    held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    live: threading.Event = field(default_factory=threading.Event)
    what: str = ""


@contextlib.contextmanager
def held_first_create(cp, namespace: str) -> Iterator[CreateHold]:
    """A validating admission webhook on 127.0.0.1 that holds the operator's first create in
    `namespace` until the test releases it (or 20 s pass: under the webhook's and the operator's
    30 s timeouts), and allows everything. It serves the apiserver's own certificate (its SANs
    include 127.0.0.1; the apiserver trusts our CA for the webhook), and is in force on entry.

    Why a webhook: the apiserver's NamespaceLifecycle admission refuses a create in a namespace
    being deleted before webhooks run, so a create held here goes through, while the pass that
    sent it has long read the namespace as not being deleted; its next create is refused."""
    hold = CreateHold()

    class Review(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["request"]
            if request.get("dryRun"):
                hold.live.set()  # the probe below
            elif request["userInfo"]["username"] == OPERATOR_USER and not hold.held.is_set():
                hold.what = f"{request['resource']['resource']} {request.get('name', '')}"
                hold.held.set()
                hold.release.wait(20)
            review = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {"uid": request["uid"], "allowed": True},
            }
            body = json.dumps(review).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # not on the test's stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Review)
    server.daemon_threads = True
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cp.pki / "apiserver.crt", cp.pki / "apiserver.key")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    name = f"hold-first-create-{namespace}"
    try:
        cp.kubectl_apply(
            {
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "ValidatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [
                    {
                        "name": "hold-first-create.test.dynamograph.io",
                        "clientConfig": {
                            "url": f"https://127.0.0.1:{server.server_address[1]}/",
                            "caBundle": base64.b64encode((cp.pki / "ca.crt").read_bytes()).decode(),
                        },
                        "rules": [
                            {
                                "apiGroups": ["*"],
                                "apiVersions": ["*"],
                                "operations": ["CREATE"],
                                "resources": ["*"],
                                "scope": "Namespaced",
                            }
                        ],
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": namespace}
                        },
                        "failurePolicy": "Fail",
                        "sideEffects": "None",
                        "admissionReviewVersions": ["v1"],
                        "timeoutSeconds": 30,
                    }
                ],
            }
        )

        def probed() -> bool:
            cp.kubectl(
                "create", "configmap", "probe", "-n", namespace, "--dry-run=server", check=False
            )  # fmt: skip
            return hold.live.is_set()

        wait_for("the webhook in force", probed, 30)
        yield hold
    finally:
        hold.release.set()
        cp.kubectl("delete", "validatingwebhookconfiguration", name, "--ignore-not-found")
        server.shutdown()
        server.server_close()


def operator_requests(cp, namespace: str, since: str) -> list[dict]:
    return [
        e
        for e in cp.audit_events(OPERATOR_USER)
        if (e.get("objectRef") or {}).get("namespace") == namespace
        and e["requestReceivedTimestamp"] >= since
    ]


def operator_writes(cp, namespace: str, since: str) -> list[dict]:
    """The operator's writes (tried or done) in `namespace` since `since`, but kopf's own patches
    of the graph (its finalizer, its bookkeeping annotations)."""
    return [
        e
        for e in operator_requests(cp, namespace, since)
        if e["verb"] in WRITES
        and (e["objectRef"].get("resource"), e["objectRef"].get("subresource"))
        != ("dynamographs", None)
    ]


def summary(e: dict) -> str:
    ref, status = e["objectRef"], e.get("responseStatus", {})
    what = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
    return f"{e['verb']} {what} {ref.get('name', '')}: {status.get('code')} {status.get('message', '')}"


def complaints(operator, offset: int) -> list[str]:
    """The operator's WARNING, ERROR and CRITICAL log lines after `offset` characters."""
    return [
        ln
        for ln in operator.log_tail(10**8)[offset:].splitlines()
        if ln.split()[2:3] in (["WARNING"], ["ERROR"], ["CRITICAL"])
    ]


def test_a_namespace_being_deleted_is_left_to_the_namespace_controller(
    control_plane, operator, namespace
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl_apply(graph_manifest("g", namespace))
    wait_for("graph g Ready", lambda: ready_graph(cp, namespace, "g"), 120, describe=show)
    with held_graph_deletion(cp, namespace, "g"):
        offset = len(operator.log_tail(10**8))
        since = now()
        cp.kubectl("delete", "namespace", namespace, "--wait=false")
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
        mark = now()
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
    wait_for(
        f"namespace {namespace} gone", lambda: get(cp, "namespace", namespace) is None, 120,
        describe=show,
    )  # fmt: skip

    # What the operator wrote in the namespace since its deletion began: nothing.
    writes = [summary(e) for e in operator_writes(cp, namespace, since)]
    assert writes == [], "the operator wrote into the namespace being deleted:\n" + "\n".join(
        writes
    )
    assert complaints(operator, offset) == [], "the operator complained:\n" + "\n".join(
        complaints(operator, offset)
    )


def test_a_pass_the_namespace_deletion_overtakes_stops_at_the_refused_create(
    control_plane, operator, namespace
):
    cp = control_plane
    show = lambda: describe(cp, namespace, operator)  # noqa: E731
    cp.kubectl_apply(graph_manifest("g", namespace))
    before = wait_for("graph g Ready", lambda: ready_graph(cp, namespace, "g"), 120, describe=show)
    with held_graph_deletion(cp, namespace, "g"), held_first_create(cp, namespace) as hold:
        # A second worker service: the pass over the new spec creates its Deployment, then its
        # PodDisruptionBudget. The webhook holds the first create while the namespace's deletion
        # begins, after the pass read the namespace as not being deleted.
        services = {"w2": {"componentType": "worker", "replicas": 2, "resources": {"gpu": 1}}}
        cp.kubectl(
            "patch", "dg", "g", "-n", namespace, "--type=merge",
            "-p", json.dumps({"spec": {"services": services}}),
        )  # fmt: skip
        wait_for("the operator's first create held", hold.held.is_set, 60, describe=show)
        offset = len(operator.log_tail(10**8))
        since = now()
        cp.kubectl("delete", "namespace", namespace, "--wait=false")
        wait_for(
            f"namespace {namespace} Terminating",
            lambda: get(cp, "namespace", namespace)["status"]["phase"] == "Terminating",
            30,
        )
        hold.release.set()
        stopped = f"graph {namespace}/g: its namespace is being deleted"
        wait_for(
            "the pass to stop",
            lambda: stopped in operator.log_tail(10**8)[offset:],
            30,
            describe=show,
        )
        after = get(cp, "dg", "g", "-n", namespace)
        # no status written for the new generation (nor any other change of it)
        assert after["metadata"]["generation"] > before["metadata"]["generation"]
        assert after["status"] == before["status"], show()
    wait_for(
        f"namespace {namespace} gone", lambda: get(cp, "namespace", namespace) is None, 120,
        describe=show,
    )  # fmt: skip

    # Since the deletion began, the operator's one write: the create that stopped the pass,
    # refused (no status patch, no Event, not the rest of the pass's plan).
    writes = operator_writes(cp, namespace, since)
    assert [(e["verb"], e["responseStatus"]["code"]) for e in writes] == [("create", 403)], (
        f"after the held create of {hold.what}:\n" + "\n".join(map(summary, writes))
    )
    causes = writes[0]["responseStatus"].get("details", {}).get("causes", [])
    assert [c["reason"] for c in causes] == ["NamespaceTerminating"], summary(writes[0])
    assert complaints(operator, offset) == [], "the operator complained:\n" + "\n".join(
        complaints(operator, offset)
    )
