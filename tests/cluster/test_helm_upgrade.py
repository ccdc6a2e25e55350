"""`helm upgrade` from the previous chart version applies the CRD changes, on a control plane
of its own (the session's already has the current CRD).

The chart as it was at PREVIOUS (the last revision before the vLLM fields and the /scale
subresource, 5eec880) is installed; the graph those fields describe is refused by its CRD.
`helm upgrade` to the working tree's chart leaves the CRD as it was (Helm skips crds/ on
upgrade, which this test pins as the reason for the rest); the upgraded operator, started with
the chart's ServiceAccount token, applies its CRD on start (operator/crd_upgrade.py), after
which the graph is accepted and the /scale subresource is served. A CRD a newer operator
applied is kept as it is.
"""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from .conftest import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    WORKLOAD_IMAGE,
    Operator,
    get,
    helm,
    service_account_kubeconfig,
    wait_for,
)
from .controlplane import REPO, ControlPlane, Missing, find_binaries

PREVIOUS = "b4e23c20d71f7db0d1a378e8929a90a641d7ad01"
CRD = "crd/dynamographs.dynamograph.io"


def assert_watched_without_429(op: Operator) -> None:
    """kopf has watched the graphs (it reconciled the test's graph, created or resumed) and no
    list or watch of them was refused while the apiserver rebuilt their storage."""
    wait_for("the operator to reconcile the graph",
             lambda: re.search(r"Handler '(create|resume)' succeeded", op.log_tail(10**7)), 90,
             describe=op.log_tail)  # fmt: skip
    early = [ln for ln in op.log_tail(10**7).splitlines() if "(re)initializing" in ln]
    assert early == [], "\n".join(early)


@pytest.fixture(scope="module")
def fresh_plane(tmp_path_factory):
    try:
        find_binaries()
        cp = ControlPlane(tmp_path_factory.mktemp("upgrade-plane"), nodes=1)
        cp.kubectl_argv()
    except Missing as exc:
        pytest.skip(str(exc))
    if not shutil.which("helm", path=str(REPO / ".local" / "bin")):
        pytest.skip("helm not found in .local/bin (scripts/fetch-helm.sh)")
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def previous_chart(dest) -> str:
    """The chart folder as committed at PREVIOUS, extracted with git archive."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", PREVIOUS, "charts/dynamograph"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"revision {PREVIOUS} not in this clone: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return str(dest / "charts" / "dynamograph")


def crd_spec_fields(cp) -> set[str]:
    crd = get(cp, CRD)
    (version,) = crd["spec"]["versions"]
    return set(version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def vllm_graph(namespace: str) -> dict:
    body = yaml.safe_load((REPO / "examples" / "vllm-tp.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    return body


def test_helm_upgrade_then_operator_start_applies_the_new_crd(fresh_plane, tmp_path):
    cp = fresh_plane
    old = previous_chart(tmp_path)
    helm(
        cp, "install", RELEASE, old, "--namespace", RELEASE_NAMESPACE, "--create-namespace",
        "--set", f"workload.image={WORKLOAD_IMAGE}", "--wait=false",
    )  # fmt: skip
    cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", CRD)
    assert "replicas" not in crd_spec_fields(cp)
    cp.kubectl("create", "namespace", "serving")
    refused = cp.kubectl("apply", "-f", "-", input=json.dumps(vllm_graph("serving")), check=False)
    assert refused.returncode != 0 and "unknown field" in refused.stderr, refused.stderr

    helm(
        cp, "upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        "--set", f"workload.image={WORKLOAD_IMAGE}", "--wait=false",
    )  # fmt: skip
    # Helm left the CRD alone: what the operator's start is for.
    assert "replicas" not in crd_spec_fields(cp)
    assert get(cp, "clusterrole", f"{RELEASE}-crd")  # the upgrade added the operator's grant

    kubeconfig = service_account_kubeconfig(cp, RELEASE_NAMESPACE, RELEASE, tmp_path / "kc")
    op = Operator(cp, kubeconfig, tmp_path / "operator.log")
    op.start()
    try:
        wait_for("the operator to apply its CRD", lambda: "replicas" in crd_spec_fields(cp), 90,
                 describe=op.log_tail)  # fmt: skip
        crd = cp.get_json(CRD, "--show-managed-fields")
        (version,) = crd["spec"]["versions"]
        assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
        managers = {m["manager"] for m in crd["metadata"]["managedFields"]}
        assert "dynamograph-operator" in managers, managers
        assert crd["metadata"]["annotations"]["dynamograph.io/operator-version"]
        cp.kubectl("wait", "--for=condition=Established", "--timeout=60s", CRD)
        res = wait_for(
            "the vLLM graph accepted",
            lambda: (
                (
                    r := cp.kubectl(
                        "apply", "-f", "-", input=json.dumps(vllm_graph("serving")), check=False
                    )
                ).returncode
                == 0
                and r
            ),
            30,
        )
        assert "created" in res.stdout or "configured" in res.stdout, res.stdout
        stored = get(cp, "dg", "llama70b", "-n", "serving")
        assert stored["spec"]["services"]["worker"]["tensorParallelSize"] == 4
        assert op.forbidden() == [], "\n".join(op.forbidden())
        # kopf's watches began once the rebuilt storage was served (the operator waits for it
        # after applying the CRD): no 429 "storage is (re)initializing" logged as an ERROR
        assert_watched_without_429(op)
    finally:
        op.stop()

    # A CRD applied by a newer operator is left alone by this one (a stale replica or a
    # rollback never strips what the newer one added): mark it newer, change it, restart.
    cp.kubectl("annotate", CRD, "--overwrite", "dynamograph.io/operator-version=99.0.0")
    cp.kubectl("patch", CRD, "--type=json",
               "-p", '[{"op": "remove", "path": "/spec/versions/0/subresources/scale"}]')  # fmt: skip
    op = Operator(cp, kubeconfig, tmp_path / "operator-2.log")
    op.start()
    try:
        wait_for("the operator to keep the newer CRD", lambda: "newer than" in op.log_tail(), 90,
                 describe=op.log_tail)  # fmt: skip
        (version,) = get(cp, CRD)["spec"]["versions"]
        assert "scale" not in version["subresources"]
        # the CRD changed just before this start (the patch above): kopf still waited for it
        assert_watched_without_429(op)
    finally:
        op.stop()
