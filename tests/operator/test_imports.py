"""The operator uses one Kubernetes client stack: kopf's, whose aiohttp transport and
credentials `operator/kube.py` shares (docs/operator.md). Which of our packages it may import
is import-linter's contract (`.importlinter`, run by `make lint`)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

OPERATOR = Path(__file__).resolve().parents[2] / "operator"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, absolute (relative imports resolved within the operator)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "dynamograph.operator" if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def operator_imports() -> dict[str, set[str]]:
    return {path.name: imported_modules(path) for path in sorted(OPERATOR.glob("*.py"))}


def test_one_kubernetes_client_stack():
    # kubernetes_asyncio is the EPP's and frontend's discovery client, not the operator's; the
    # official `kubernetes` package only lends its PodSpec model (kopf's login_via_client uses its
    # kubeconfig loader too), never its API client.
    offending = sorted(
        f"{name}: {module}"
        for name, modules in operator_imports().items()
        for module in modules
        if module.split(".")[0] in ("kubernetes_asyncio", "kubernetes", "pykube", "lightkube")
        and module not in ("kubernetes.client", "kubernetes.client.V1PodSpec")
    )
    assert not offending
