# Tandem — the two commands that matter: `make up` (run locally) and `make test` (install + whole suite).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test bootstrap k8s-binaries lint typecheck unit bench verify format clean

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/tandem up

## k8s-binaries: build the test control plane (kube-apiserver, controller-manager, scheduler, etcd, kwok) and
## unpack helm/kubectl when missing; cached in ~/.cache/tandem/k8s/<version>/bin, so a rerun only checks.
k8s-binaries:
	@scripts/build-k8s.sh

## test: install everything, then lint, type-check and run every test (inside a loopback-only netns).
test: bootstrap k8s-binaries lint typecheck
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
	@echo "verify: nothing generated yet"

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
