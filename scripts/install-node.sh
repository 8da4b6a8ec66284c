#!/usr/bin/env bash
# Installs what the node tier (tests/node: a real single-node Kubernetes on this machine) runs:
#   kubelet, kube-controller-manager, kube-scheduler, kube-proxy, kube-dns (Kubernetes v1.28.7,
#       the API server's release) into .tools/kube, unpacked from $KVSHM_KUBE_SOURCE (default
#       ../shared/kube, a folder beside the clone holding <name>.gz; sha256 checked)
#   containerd, runc, the CNI plugins, iptables, docker (to build images), debootstrap (a base
#       image) and busybox-static (a pause image) from Debian's packages, when missing
# Needs root (apt-get). Idempotent and quick when everything is there. A missing source folder
# is reported and leaves the node tests to fail, naming what is missing (tests/node/tools.py).
# Usage: scripts/install-node.sh
set -euo pipefail
cd "$(dirname "$0")/.."

KUBE_SOURCE="${KVSHM_KUBE_SOURCE:-$PWD/../shared/kube}"
KUBE="$PWD/.tools/kube"
declare -A KUBE_SHA256=(
    [kubelet]=9f034a604c1e11a9d29a2fefa80c6774f7185decfc43a361fe580212548bfa37
    [kube-controller-manager]=208b2700d193537c10976343036d05d88d19c3021c0c91fd3ec564d08b869c73
    [kube-scheduler]=7f26d15e21390fd9659f216d0ae70e10ac655b9a8203ac7b030ed4156d6d1998
    [kube-proxy]=eb446cf95b0a596eb92e6585c8de3172ac8b46e5fd29fc96b0559cb8246fd05b
    [kube-dns]=08a15a12e8d5293826006781f631c0891760faa522e99150298888de2c093381
)
# program -> Debian package
declare -A DEBIAN=(
    [containerd]=containerd [runc]=runc [iptables]=iptables [dockerd]=docker.io
    [debootstrap]=debootstrap [busybox]=busybox-static
)

install_debian() {
    local missing=() program
    for program in "${!DEBIAN[@]}"; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$program" >/dev/null || missing+=("${DEBIAN[$program]}")
    done
    [[ -x /usr/lib/cni/bridge ]] || missing+=(containernetworking-plugins)
    [[ -x /bin/busybox ]] || missing+=(busybox-static)
    ((${#missing[@]})) || return 0
    echo "== installing Debian packages for the node tier: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >/dev/null
}

install_kube() {
    mkdir -p "$KUBE"
    local name archive work
    work=$(mktemp -d)
    trap 'rm -rf "$work"' RETURN
    for name in "${!KUBE_SHA256[@]}"; do
        echo "${KUBE_SHA256[$name]}  $KUBE/$name" | sha256sum --check --status 2>/dev/null && continue
        archive="$KUBE_SOURCE/$name.gz"
        if [[ ! -f $archive ]]; then
            echo "install-node: $archive is missing: the node tests will fail. Put Kubernetes" \
                "v1.28.7's $name (gzip) there, or set KVSHM_KUBE_SOURCE to its folder" \
                "(tests/node/README.md)" >&2
            continue
        fi
        echo "== installing $name v1.28.7 into $KUBE"
        gunzip -c "$archive" >"$work/$name"
        echo "${KUBE_SHA256[$name]}  $work/$name" | sha256sum --check --quiet
        install -m 0755 "$work/$name" "$KUBE/$name"
    done
}

install_debian
install_kube
