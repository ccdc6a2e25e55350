"""Run mypy over the dynamograph packages under the names they are installed as.

The component folders (protocol/, router/, ...) carry no __init__.py: they become
`dynamograph.protocol`, `dynamograph.router`, ... only through pyproject.toml's
[tool.setuptools.package-dir] and the editable install's import hook, which mypy cannot follow
(`mypy -p dynamograph.router` finds nothing, and `mypy router/` would name the modules
`router.x`, so every `from dynamograph.protocol ...` would be missing). This script reads that
same table, names each file's module itself and hands mypy the list; everything else (strictness
per package, packages not checked yet, third-party modules without types) is configured in
[tool.mypy] in pyproject.toml. Every package is handed over, so that each import of ours
resolves to the module itself (mypy's cache makes a second run take seconds).

Exit status: 0 clean, 1 type errors, 2 mypy could not run.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

from mypy import build
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, Path]:
    """Each installed package name and the folder its modules live in (pyproject.toml)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table = pyproject["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in table.items()}


def sources() -> list[BuildSource]:
    """One BuildSource per module of each package (subpackages are mapped separately)."""
    out = [BuildSource(".", "dynamograph", None)]  # the namespace the packages live in
    for package, folder in package_dirs().items():
        # The folder itself stands for the namespace package, so that `from
        # dynamograph.protocol import hashing` resolves (mypy reads a directory as one).
        out.append(BuildSource(str(folder.relative_to(ROOT)), package, None))
        for path in sorted(folder.glob("*.py")):
            module = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out.append(BuildSource(str(path.relative_to(ROOT)), module, None))
    return out


def main() -> int:
    os.chdir(ROOT)  # relative paths in messages, .mypy_cache at the root
    # process_options reads [tool.mypy] from pyproject.toml; the module list is ours. The
    # throwaway `-c` target only satisfies its "nothing to check" test.
    _, options = process_options(["--config-file", str(ROOT / "pyproject.toml"), "-c", ""])
    targets = sources()
    try:
        result = build.build(targets, options, stdout=sys.stdout, stderr=sys.stderr)
    except build.CompileError as e:
        print("\n".join(e.messages), file=sys.stderr)
        return 2
    for line in result.errors:
        print(line)
    modules = sum(source.path.endswith(".py") for source in targets if source.path)
    errors = sum(": error:" in line for line in result.errors)
    files = len({line.split(":", 1)[0] for line in result.errors if ": error:" in line})
    if errors:
        print(f"Found {errors} errors in {files} files (checked {modules} modules)")
        return 1
    print(f"Success: no issues found in {modules} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
