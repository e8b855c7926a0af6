#!/usr/bin/env bash
# Installs everything Tandem needs on a fresh Debian 12 machine: Debian packages, then the pinned Python
# environment in .venv. Idempotent: a second run only checks. Used by `make test`, `make up` and CI.
set -euo pipefail
cd "$(dirname "$0")/.."

# libibverbs1/librdmacm1/libnuma1: shared libraries the Mooncake transfer engine loads even for TCP.
# etcd-server: the registry of the local stack and tests. wrk: the benchmarks' load generator.
# iproute2 + util-linux: loopback-only network namespaces for the tests (Mooncake listens on all interfaces).
# openssl: certificates of the test Kubernetes control plane (tandem_dev/devcluster/pki.py).
# prometheus (+ promtool): the chart tests scrape the running stack and run every dashboard query and alert rule.
DEB_PACKAGES=(libibverbs1 librdmacm1 libnuma1 etcd-server wrk iproute2 util-linux openssl prometheus)
# debootstrap (pinned, the version bookworm ships): `make images` builds the tandem image's root filesystem with it.
# `scripts/bootstrap.sh --images` installs only what the image build needs.
IMAGE_PACKAGES=(debootstrap=1.0.128+nmu2+deb12u2 coreutils util-linux mount)
if [ "${1:-}" = "--images" ]; then DEB_PACKAGES=("${IMAGE_PACKAGES[@]}"); else DEB_PACKAGES+=("${IMAGE_PACKAGES[@]}"); fi

missing=()
for spec in "${DEB_PACKAGES[@]}"; do
  pkg="${spec%%=*}"; want_version="${spec#*=}"
  [ "$want_version" != "$spec" ] || want_version=""
  have="$(dpkg-query -W -f='${Status} ${Version}' "$pkg" 2>/dev/null || true)"
  case "$have" in
    "install ok installed ${want_version}"*) ;;
    *) missing+=("$spec") ;;
  esac
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || { echo "bootstrap: could not install Debian packages: ${missing[*]}" >&2; exit 1; }
fi
[ "${1:-}" != "--images" ] || { echo "bootstrap: image tools ready"; exit 0; }

PYTHON="${PYTHON:-python3.11}"
stamp=.venv/.tandem-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "bootstrap: creating .venv and installing pinned Python packages"
  [ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install -q --disable-pip-version-check "pip==25.3"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[dev]'
  echo "$want" > "$stamp"
fi
# tandem_dev (dev cluster, benches, chaos, local stack, test helpers) is not in the tandem wheel, so the runtime
# image leaves it out; the development venv imports it from this checkout.
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
[ "$(cat "$site/tandem_dev.pth" 2>/dev/null)" = "$PWD" ] || echo "$PWD" > "$site/tandem_dev.pth"
echo "bootstrap: ready"
