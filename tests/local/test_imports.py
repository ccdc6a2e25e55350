"""`dynamograph up` reads graphs through `protocol`, never through the operator package."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

LOCAL = Path(__file__).resolve().parents[2] / "local"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, absolute (relative imports resolved within `local`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = "dynamograph.local" if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            out.add(module)
            out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def test_local_does_not_import_the_operator():
    offending = {
        f"{path.name}: {module}"
        for path in sorted(LOCAL.glob("*.py"))
        for module in imported_modules(path)
        if module == "dynamograph.operator" or module.startswith("dynamograph.operator.")
    }
    assert not offending, sorted(offending)
