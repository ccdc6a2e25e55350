"""Where the field's own Go components are, once scripts/build-counterparts.sh has built them.

The same rule as that script (its header documents it): the versions pinned in
scripts/counterparts.versions, each component in
`${DYNAMOGRAPH_COUNTERPARTS_CACHE:-${XDG_CACHE_HOME:-~/.cache}/dynamograph/counterparts}/
<name>-<version>/bin/<binary>`, built only when its VERSIONS stamp (written last) names the pinned
`package@version` and the pinned replaces, if any (`package@version replace old=new@v,...`). Names: "sim" (llm-d-inference-sim), "gaie-epp" (GAIE's reference EPP),
"llmd-epp" (llm-d's inference scheduler). `make counterparts` builds all three.

- `versions() -> dict[str, str]`: the versions file's KEY=VALUE pairs.
- `binary(name) -> Path | None`: the built binary, None when it is not built for the pinned
  version (a test then skips naming `make counterparts`).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERSIONS_FILE = REPO / "scripts" / "counterparts.versions"
# component name → the key prefix of its lines in the versions file
PREFIXES = {"sim": "SIM", "gaie-epp": "GAIE_EPP", "llmd-epp": "LLMD_EPP"}


def read_versions(path: Path) -> dict[str, str]:
    """A pinned-versions file's KEY=VALUE lines (scripts/*.versions, which bash sources too)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip()
    return out


def versions() -> dict[str, str]:
    return read_versions(VERSIONS_FILE)


def cache_root() -> Path:
    root = os.environ.get("DYNAMOGRAPH_COUNTERPARTS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
        "dynamograph",
        "counterparts",
    )
    return Path(root)


def binary(name: str) -> Path | None:
    try:
        prefix = PREFIXES[name]
    except KeyError:
        raise ValueError(f"unknown counterpart {name!r}; known: {', '.join(PREFIXES)}") from None
    pinned = versions()
    package, version = pinned[f"{prefix}_PACKAGE"], pinned[f"{prefix}_VERSION"]
    home = cache_root() / f"{name}-{version}"
    path = home / "bin" / package.rsplit("/", 1)[1]
    try:
        stamp = (home / "VERSIONS").read_text().strip()
    except OSError:
        return None
    replace = pinned.get(f"{prefix}_REPLACE", "")
    expected = f"{package}@{version}" + (f" replace {replace}" if replace else "")
    if stamp != expected or not os.access(path, os.X_OK):
        return None
    return path
