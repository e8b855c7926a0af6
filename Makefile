# Tandem — the two commands that matter: `make up` (run locally) and `make test` (install + whole suite).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test bootstrap k8s-binaries lint typecheck unit bench generate verify format clean

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

## unit: the pure tests only (no netns, k8s, slow or process-starting tests), in well under 30 s; no netns needed.
UNIT_MARKERS := not (netns or k8s or slow or procs)
unit: bootstrap
	$(PY) -m pytest -m "$(UNIT_MARKERS)" -p no:cacheprovider $(PYTEST_ARGS)

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

## generate: rewrite every generated file from its source (one line per generator).
GENERATED := charts/tandem/crds charts/tandem/values.yaml charts/tandem/values.schema.json charts/tandem/README.md \
	charts/tandem/dashboards deploy/dashboards tandem/data
generate: bootstrap
	$(PY) -m tandem_operator.crdgen
	$(PY) -m tandem.chart.generate
	$(PY) scripts/gen_sglang_flags.py

## verify: regenerate, then fail if any generated file differs from what git has committed.
verify: generate
	@git diff --exit-code --stat -- $(GENERATED) && test -z "$$(git status --porcelain -- $(GENERATED))" \
		|| { echo "verify: generated files are out of date: run 'make generate' and commit" >&2; exit 1; }

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
