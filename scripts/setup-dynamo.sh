#!/usr/bin/env bash
# Installs NVIDIA Dynamo's frontend + KV router (PyPI ai-dynamo, pinned) into a bench-only
# virtualenv, .local/dynamo-venv, for the `bench route` policy dynamo-kv. Not part of
# `make setup`: Dynamo pins transformers/aiohttp/etc. that must not move our .venv.
# Idempotent: a venv whose stamp matches the pins is left alone.
#
# ai-dynamo declares a dependency on a simulator package (aisimulate) that the frontend does
# not import, so ai-dynamo goes in with --no-deps and its real runtime dependencies are listed
# here by hand.
set -euo pipefail

DYNAMO_VERSION=1.6.1
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${DYNAMO_VENV:-$ROOT/.local/dynamo-venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.dynamograph-stamp"
WANT="ai-dynamo==$DYNAMO_VERSION"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "dynamo venv up to date: $VENV ($WANT)"
  exit 0
fi

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --quiet)
"${PIP[@]}" "ai-dynamo-runtime==$DYNAMO_VERSION"
"${PIP[@]}" --no-deps "ai-dynamo==$DYNAMO_VERSION"
# ai-dynamo's own requirements minus the simulator (aisimulate) and the k8s client.
"${PIP[@]}" \
  "aiohttp>=3.14.3,<4" "msgspec>=0.19" "prometheus-client>=0.23.1,<1" "pyzmq>=26" \
  "transformers>=4.56" "typing-extensions>=4.10" "zstandard>=0.23,<1" "tqdm>=4" \
  "certifi" "redis>=6.2,<9" "psutil"
"$VENV/bin/python" -c "import dynamo._core, dynamo.frontend, dynamo.llm" >/dev/null
echo "$WANT" >"$STAMP"
echo "dynamo venv ready: $VENV ($WANT)"
