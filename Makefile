# Tandem — the two commands that matter: `make up` (run locally) and `make test` (install + whole suite).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
## pytest keeps bytecode (and its assertion-rewritten test modules) under ~/.cache/tandem/pycache, also where the
## environment sets PYTHONDONTWRITEBYTECODE: compiling every module afresh cost each pytest process ~5 s of CPU.
PYTEST := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(HOME)/.cache/tandem/pycache $(PY) -m pytest

.PHONY: up test bootstrap setup peers k8s-binaries images images-relock lint typecheck unit bench chaos chaos-dev-cluster generate verify format clean

bootstrap:
	@scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/tandem up $(if $(PORT),--port $(PORT))

## peers: install the pinned benchmark/conformance peers (smg, the sglang wheel, a venv with SGLang's real argument
## parser and torch) into ~/.cache/tandem/, outside the network namespace where PyPI is reachable; a rerun only checks.
peers: bootstrap
	$(PY) -m tandem_dev.peers_install install

## k8s-binaries: build the test control plane (kube-apiserver, controller-manager, scheduler, etcd, kwok) and
## unpack helm/kubectl when missing; cached in ~/.cache/tandem/k8s/<version>/bin, so a rerun only checks.
k8s-binaries:
	@scripts/build-k8s.sh

## setup: the slow installs side by side: the peers and the image (network and disk) next to the control-plane
## build (CPU).
setup: bootstrap
	@$(MAKE) --no-print-directory -j3 peers k8s-binaries images

## images: build the tandem image as an OCI archive in build/images/ (debootstrap + chroot, needs root); cached
## in ~/.cache/tandem/images/<inputs>, so a rerun with the same inputs only copies it. images-relock: re-pin the
## Debian packages (images/tandem/debian.lock) when the mirror has moved on; then `make generate` and commit.
images: bootstrap
	@scripts/bootstrap.sh --images
	$(PY) -m tandem_dev.images.build
images-relock: bootstrap
	@scripts/bootstrap.sh --images
	$(PY) -m tandem_dev.images.build --relock

## test: install everything, then lint, type-check and run every test (inside a loopback-only netns). Two
## pytest-xdist workers, each in a loopback-only netns of its own (tests/conftest.py): one starts on the k8s tests (one
## dev cluster), the other on the timer-bound own_cluster k8s tests (a dev cluster of its own); then both take the rest,
## a module at a time (tests/plumbing/xdist_groups.py); the serial suite left ~60 % of the 2 cores idle.
## TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
test: setup lint typecheck
	TANDEM_FAIL_UNEXPECTED_SKIPS=1 scripts/in-netns.sh $(PYTEST) -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

## unit: the pure tests only (no netns, k8s, slow or process-starting tests); no netns needed. Two
## xdist workers (helm renders and Python overlap on 2 cores); modules that -m deselects whole are not even imported
## (tests/plumbing/markfilter.py), nor are the plugins that only process-tier tests use (UNUSED_IN_UNIT_PLUGINS there).
UNIT_MARKERS := not (netns or k8s or slow or procs)
UNIT_WORKERS ?= 2
unit: bootstrap
	$(PYTEST) -m "$(UNIT_MARKERS)" -n $(UNIT_WORKERS) -p no:cacheprovider -p no:schemathesis -p no:hypothesispytest \
		$(PYTEST_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: bootstrap
	$(VENV)/bin/mypy

format: bootstrap
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## bench: benchmarks that print tables (ratios measured side by side in one run) and save them as JSON + PNG under
## build/bench/<timestamp>/. BENCH_ARGS=--allow-missing-peers reports a peer that cannot run as "not measured".
BENCH_ARGS ?=
bench: setup
	scripts/in-netns.sh $(VENV)/bin/tandem bench $(BENCH_ARGS)

## chaos: a bounded chaos run on the local stack (3-member etcd, 2 prefill + 2 decode simulated workers, 2 routers):
## random faults under load, printed as tables and saved as JSON + PNG under build/chaos/<timestamp>/ (about 2 min).
## CHAOS_ARGS="--streams N --concurrency C --duration S --seed K" (tandem chaos --help).
CHAOS_ARGS ?=
chaos: bootstrap
	scripts/in-netns.sh $(VENV)/bin/tandem chaos $(CHAOS_ARGS)

## chaos-dev-cluster: the same on the dev cluster with the operator (2 replicas, leader election, 2 prefill + 2 decode
## simulated pods, 3-member etcd, 2 routers), the operator leader's kill included (about 4 min).
chaos-dev-cluster: bootstrap
	scripts/in-netns.sh $(VENV)/bin/tandem chaos --setting dev-cluster $(CHAOS_ARGS)

## generate: rewrite every generated file from its source (one line per generator).
GENERATED := charts/tandem/crds charts/tandem/values.yaml charts/tandem/values.schema.json charts/tandem/README.md \
	charts/tandem/templates/_router_settings.tpl charts/tandem/dashboards deploy/dashboards tandem/data \
	images/tandem/Dockerfile
generate: bootstrap
	$(PY) -m tandem_operator.crdgen
	$(PY) -m tandem_dev.chart.generate
	$(PY) scripts/gen_sglang_flags.py
	$(PY) -m tandem_dev.images.dockerfile

## verify: regenerate, then fail if any generated file differs from what git has committed.
verify: generate
	@git diff --exit-code --stat -- $(GENERATED) && test -z "$$(git status --porcelain -- $(GENERATED))" \
		|| { echo "verify: generated files are out of date: run 'make generate' and commit" >&2; exit 1; }

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
