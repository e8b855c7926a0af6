# Tandem — the two commands that matter: `make up` (run locally) and `make test` (install + whole suite).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test bootstrap lint typecheck unit bench verify format clean

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/tandem up

## test: install everything, then lint, type-check and run every test (inside a loopback-only netns).
test: bootstrap lint typecheck
	scripts/in-netns.sh $(PY) -m pytest $(PYTEST_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: bootstrap
	$(VENV)/bin/mypy

format: bootstrap
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## bench: benchmarks that print tables (ratios measured side by side in one run).
bench: bootstrap
	scripts/in-netns.sh $(VENV)/bin/tandem bench

## verify: generated files are up to date.
verify: bootstrap
	$(PY) scripts/gen_sglang_flags.py --check

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
