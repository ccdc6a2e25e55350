"""The Helm chart with the real helm: lint --strict, template, and strict schema validation.

helm comes from `scripts/fetch-helm.sh` (run by `scripts/setup.sh`) into `.local/bin/`.
"""

import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kopf._cogs.structs import references as peering_refs

from dynamograph.operator import crds

from .emulator import REPO

pytestmark = [
    pytest.mark.integration,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:kubernetes_validate"),
]

CHART = REPO / "charts" / "dynamograph"
PEERING_CRDS = "kopfpeerings.kopf.dev.yaml"
PEERING = ("operator.replicas=2", "operator.peering=dg-operator")
K8S_VERSION = "1.33"


def find_helm() -> Path | None:
    local = REPO / ".local" / "bin" / "helm"
    if local.exists():
        return local
    found = shutil.which("helm")
    return Path(found) if found else None


@pytest.fixture(scope="module")
def helm(tmp_path_factory):
    binary = find_helm()
    if binary is None:
        pytest.skip("helm is missing: run scripts/fetch-helm.sh (scripts/setup.sh runs it)")
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / "cache"),
        "XDG_CONFIG_HOME": str(home / "config"),
        "XDG_DATA_HOME": str(home / "data"),
        "PATH": "/usr/bin:/bin",
    }

    def run(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [str(binary), *args], capture_output=True, text=True, env=env, timeout=60
        )
        if ok:
            assert result.returncode == 0, result.stdout + result.stderr
        return result

    return run


def render(helm, *sets: str) -> list[dict]:
    args = ["template", "dg", str(CHART), "--namespace", "dynamograph-system", "--include-crds"]
    for value in sets:
        args += ["--set", value]
    docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
    assert docs
    return docs


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / crds.CRD_FILE).read_text() == crds.render_crd()
    assert (REPO / "crds" / crds.CRD_FILE).read_text() == crds.render_crd()


def test_kopf_peering_crds_are_what_kopf_watches():
    """The vendored peering CRDs: the chart's copy is the repo's, and they serve the resources
    kopf looks for (kopf.dev/v1 clusterkopfpeerings and kopfpeerings)."""
    shipped = (CHART / "crds" / PEERING_CRDS).read_text()
    assert shipped == (REPO / "crds" / PEERING_CRDS).read_text()
    served = {}
    for crd in yaml.safe_load_all(shipped):
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
        spec = crd["spec"]
        (version,) = spec["versions"]
        served[spec["group"], version["name"], spec["names"]["plural"]] = spec["scope"]
    cluster, namespaced = peering_refs.CLUSTER_PEERINGS_K, peering_refs.NAMESPACED_PEERINGS_K
    assert served == {
        (cluster.group, cluster.version, cluster.any_name): "Cluster",
        (namespaced.group, namespaced.version, namespaced.any_name): "Namespaced",
    }


@pytest.mark.parametrize("sets", [(), PEERING])
def test_lint_strict(helm, sets):
    result = helm("lint", "--strict", str(CHART), *[arg for v in sets for arg in ("--set", v)])
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


def peering_schemas() -> dict[str, dict]:
    return {
        crd["spec"]["names"]["kind"]: crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for crd in yaml.safe_load_all((REPO / "crds" / PEERING_CRDS).read_text())
    }


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("watchNamespaces={team-a,team-b}", "resyncSeconds=10"),
        PEERING,
        (*PEERING, "watchNamespaces={team-a}"),
    ],
)
def test_rendered_manifests_validate_strictly(helm, sets):
    docs = render(helm, *sets)
    schemas = peering_schemas()
    for doc in docs:
        if doc["apiVersion"] == "kopf.dev/v1":  # a custom resource: its CRD's schema
            jsonschema.validate(doc, schemas[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = [d["kind"] for d in docs]
    assert kinds.count("CustomResourceDefinition") == 3  # DynamoGraph + kopf's two peerings
    assert "Deployment" in kinds and "ServiceAccount" in kinds


def test_kubernetes_validate_cli_on_rendered_chart(helm, tmp_path):
    """The command CI documents: `kubernetes-validate --strict` on `helm template` output."""
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(
        helm(
            "template", "dg", str(CHART), "--namespace", "dynamograph-system", "--include-crds"
        ).stdout
    )
    cli = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(cli), "--strict", "--quiet", "-k", K8S_VERSION, str(rendered)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_cluster_wide_rbac_is_least_privilege(helm):
    docs = render(helm)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    rules = roles["dg-dynamograph"]["rules"]
    verbs = {
        (g, r): set(rule["verbs"])
        for rule in rules
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    assert verbs[("dynamograph.io", "dynamographs")] == {"get", "list", "watch", "patch"}
    assert verbs[("dynamograph.io", "dynamographs/status")] == {"get", "patch"}
    assert verbs[("apps", "deployments")] == {"get", "list", "watch", "create", "patch", "delete"}
    assert verbs[("", "pods")] == {"get", "list", "watch"}
    assert verbs[("", "events")] == {"create"}
    assert verbs[("inference.networking.k8s.io", "inferencepools")] >= {"create", "patch"}
    for rule in rules:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert not {"update", "deletecollection", "escalate", "bind", "impersonate"} & set(
            rule["verbs"]
        )
    assert not any(d["kind"] in ("Role", "RoleBinding") for d in docs)


def test_namespaced_install_uses_roles(helm):
    docs = render(helm, "watchNamespaces={team-a,team-b}")
    roles = [
        (d["kind"], d["metadata"]["namespace"])
        for d in docs
        if d["kind"] in ("Role", "RoleBinding")
    ]
    assert sorted(roles) == [
        ("Role", "team-a"),
        ("Role", "team-b"),
        ("RoleBinding", "team-a"),
        ("RoleBinding", "team-b"),
    ]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["WATCH_NAMESPACE"] == "team-a,team-b"


def test_operator_deployment(helm):
    docs = render(helm, "workload.image=registry.example/dg:9")
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (main,) = pod["containers"]
    assert main["command"] == ["dynamograph"] and main["args"][0] == "operator"
    assert main["image"] == "ghcr.io/dynamograph/dynamograph:0.1.0"
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["DYNAMOGRAPH_IMAGE"] == "registry.example/dg:9"
    assert env["DYNAMOGRAPH_RESYNC_SECONDS"] == "30"
    assert main["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["serviceAccountName"] == "dg-dynamograph"


def test_peered_replicas(helm):
    docs = render(helm, *PEERING)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert env["DYNAMOGRAPH_PEERING"]["value"] == "dg-operator"
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    (peering,) = [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    assert peering["metadata"]["name"] == "dg-operator"
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "dg-dynamograph"
    ]
    kopf_rules = [r for r in role["rules"] if r["apiGroups"] == ["kopf.dev"]]
    assert kopf_rules == [
        {
            "apiGroups": ["kopf.dev"],
            "resources": ["clusterkopfpeerings"],
            "verbs": ["list", "watch"],
        },
        {
            "apiGroups": ["kopf.dev"],
            "resources": ["clusterkopfpeerings"],
            "resourceNames": ["dg-operator"],
            "verbs": ["get", "patch"],
        },
    ]


def test_peered_replicas_watching_namespaces(helm):
    docs = render(helm, *PEERING, "watchNamespaces={team-a,team-b}")
    peerings = sorted(
        (d["metadata"]["namespace"], d["metadata"]["name"])
        for d in docs
        if d["kind"] == "KopfPeering"
    )
    assert peerings == [("team-a", "dg-operator"), ("team-b", "dg-operator")]
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    for role in [d for d in docs if d["kind"] == "Role"]:
        resources = {r for rule in role["rules"] for r in rule["resources"]}
        assert "kopfpeerings" in resources and "clusterkopfpeerings" not in resources


def test_standalone_has_no_peering(helm):
    docs = render(helm)
    assert not [d for d in docs if d["apiVersion"] == "kopf.dev/v1"]
    roles = [d for d in docs if d["kind"] in ("ClusterRole", "Role")]
    assert all("kopf.dev" not in rule["apiGroups"] for role in roles for rule in role["rules"])


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        ("resyncSeconds=0", "/resyncSeconds"),
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
        ("watchNamespaces={Bad_NS}", "/watchNamespaces/0"),
        ("unknownKey=1", "unknownKey"),
        ("operator.replicas=2", "/operator/peering"),  # two standalone operators would fight
        ("operator.peering=Not_A_Name", "/operator/peering"),
    ],
)
def test_values_schema_refuses_bad_values(helm, bad, where):
    result = helm("template", "dg", str(CHART), "--set", bad, ok=False)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert where in result.stderr


def test_notes_render(helm):
    result = helm(
        "install",
        "dg",
        str(CHART),
        "--dry-run=client",
        "--namespace",
        "dynamograph-system",
        ok=False,
    )
    if result.returncode != 0 and "cluster" in result.stderr.lower():
        pytest.skip(f"helm install --dry-run=client needs a cluster here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    assert "kubectl get dynamographs" in result.stdout
