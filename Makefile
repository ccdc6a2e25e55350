# The commands the README names. `make setup` is idempotent; `make test` is what CI runs.
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test lint up down e2e-kind

setup:
	scripts/setup.sh

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest

up:
	$(BIN)/dynamograph up

down:
	$(BIN)/dynamograph down
