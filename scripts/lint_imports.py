"""Check the import rules between the dynamograph packages: import-linter's contracts in
`.importlinter`, run over the packages under their installed names.

import-linter builds its graph (with grimp) by walking the root package's folder, and
`dynamograph` has none: the editable install maps dynamograph.protocol to protocol/, and so on,
with an import hook (pyproject.toml, [tool.setuptools.package-dir]). So this script lays out a
throwaway tree, dynamograph/<name> -> <folder>, of symlinks made from that same table, and runs
lint-imports with the tree first on the path. Arguments go to lint-imports (e.g. --verbose).
"""

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def link_tree(into: Path) -> None:
    """into/dynamograph/<name> -> the folder of each top-level package of pyproject.toml;
    a nested package (dynamograph.router.plugins) must live in its parent's folder."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = {name: ROOT / folder for name, folder in table["package-dir"].items()}
    for name, folder in sorted(dirs.items()):
        parent, _, leaf = name.rpartition(".")
        if parent == "dynamograph":
            link = into / "dynamograph" / leaf
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(folder, target_is_directory=True)
        elif dirs.get(parent, ROOT) / leaf != folder:
            sys.exit(f"lint_imports: {name} is not in its parent's folder ({folder})")


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="dynamograph-imports-") as tmp:
        link_tree(Path(tmp))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])),
        }
        lint_imports = Path(sys.executable).parent / "lint-imports"
        # --no-cache: the tree's path is new each run, so grimp's cache would never hit
        command = [str(lint_imports), str(ROOT / ".importlinter"), "--no-cache", "--no-logo", *argv]
        return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
