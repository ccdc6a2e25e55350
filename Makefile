# The commands the README names. `make setup` is idempotent; `make test` is what CI runs.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test lint up down soak e2e-kind control-plane cluster counterparts

setup:
	scripts/setup.sh

# ruff; mypy (strict on protocol/ and router/) and the import rules between packages (.importlinter),
# each through a script that maps the component folders to their dynamograph.* names.
lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/typecheck.py
	$(BIN)/python scripts/lint_imports.py

# The control plane of the operator tier (tests/cluster/) is built first: tens of minutes the
# first time on a machine, cached by version after (a no-op).
test: lint control-plane
	$(BIN)/python -m pytest

up:
	$(BIN)/dynamograph up

down:
	$(BIN)/dynamograph down

# The long mode of the fault suite (tests/faults is the quick one, in `make test`): 10 minutes
# at 80% of measured capacity, a worker SIGKILLed every minute; prints requests lost, leaked
# bookings and memory growth (RSS; Envoy's live heap), writes results/soak.json, exits 1 when a target is missed.
soak:
	$(BIN)/dynamograph bench soak --duration 600

# The kind suite (docs/running.md, "End-to-end tests"): needs docker, kind, kubectl and helm;
# creates the kind cluster `dynamograph-e2e` (E2E_KEEP_CLUSTER=1 keeps it for another run).
e2e-kind:
	DYNAMOGRAPH_E2E_KIND=1 $(BIN)/python -m pytest e2e/kind -m e2e -v -p no:cacheprovider

# The real control plane of the operator tier (tests/cluster/, docs/operator.md "Running the
# control-plane tier"): build it once (cached by version outside the clone; `make test` runs this;
# without Go it says so and tests/cluster skips),
# then `make cluster` runs etcd, kube-apiserver, controller-manager, scheduler and kwok on
# 127.0.0.1 in the foreground and prints the KUBECONFIG to use; Ctrl-C stops everything.
control-plane:
	@if command -v go >/dev/null 2>&1; then scripts/build-control-plane.sh; \
	else echo "control-plane: go not found: not built (tests/cluster will skip)"; fi

cluster: control-plane
	$(BIN)/python tests/cluster/controlplane.py --dir .local/cluster

# The field's own Go components that benchmarks and interop tests run beside ours (issue 22):
# llm-d-inference-sim, GAIE's reference EPP, llm-d's inference scheduler, pinned in
# scripts/counterparts.versions and cached by version outside the clone. Bench-only: neither
# `make setup` nor `make test` builds them (tests that need one skip, naming this target).
counterparts:
	scripts/build-counterparts.sh
