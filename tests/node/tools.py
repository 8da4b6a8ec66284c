"""Where the node tier finds its programs, and what it says when one is missing.

Kubernetes' node programs (v1.28.7, the API server's release) come from .tools/kube, unpacked
there by scripts/install-node.sh from $KVSHM_KUBE_SOURCE (default ../shared/kube); the API
server and etcd from .tools/envtest (or $KUBEBUILDER_ASSETS); containerd, runc, the CNI
plugins, iptables, docker, debootstrap and busybox from Debian's packages, which the same
script installs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.envtest.server import REPO, MissingAssetsError, assets_dir

KUBE_TOOLS = REPO / ".tools" / "kube"
KUBE_BINARIES = ("kubelet", "kube-controller-manager", "kube-scheduler", "kube-proxy", "kube-dns")
CNI_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback", "portmap")
# program -> the Debian package that has it
DEBIAN_PROGRAMS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "dockerd": "docker.io",
    "docker": "docker.io",
    "debootstrap": "debootstrap",
    "ip": "iproute2",
    "openssl": "openssl",
}
BUSYBOX = Path("/bin/busybox")
HOW_TO_INSTALL = (
    "run scripts/install-node.sh as root (scripts/test.sh does): it installs the Debian packages "
    "and unpacks Kubernetes' node programs from $KVSHM_KUBE_SOURCE (default ../shared/kube: "
    "kubelet, kube-controller-manager, kube-scheduler, kube-proxy and kube-dns v1.28.7 as .gz, "
    "see tests/node/README.md for where to get them elsewhere)"
)


class MissingNodeToolsError(RuntimeError):
    """A program the node needs is not installed; the message lists each one and its source."""


def kube_binary(name: str) -> Path:
    return KUBE_TOOLS / name


def program(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if found is None:
        raise MissingNodeToolsError(f"{name} not found ({DEBIAN_PROGRAMS.get(name, name)})")
    return found


def check_tools() -> Path:
    """Every program the node needs is here; returns the folder of kube-apiserver and etcd.

    Raises MissingNodeToolsError listing everything missing and how to provide it.
    """
    missing: list[str] = []
    if os.geteuid() != 0:
        missing.append("root: a node mounts, makes network interfaces and runs containers")
    for name in KUBE_BINARIES:
        if not os.access(kube_binary(name), os.X_OK):
            missing.append(f"{kube_binary(name)} (Kubernetes v1.28.7 node program)")
    for name, package in DEBIAN_PROGRAMS.items():
        if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None:
            missing.append(f"{name} (Debian package {package})")
    for plugin in CNI_PLUGINS:
        if not os.access(CNI_DIR / plugin, os.X_OK):
            missing.append(f"{CNI_DIR / plugin} (Debian package containernetworking-plugins)")
    if not os.access(BUSYBOX, os.X_OK):
        missing.append(f"{BUSYBOX} (Debian package busybox-static)")
    try:
        assets = assets_dir()
    except MissingAssetsError as exc:
        missing.append(str(exc))
        assets = Path()
    if missing:
        raise MissingNodeToolsError(
            "the real node cannot start; missing:\n  - " + "\n  - ".join(missing) + "\n"
            + HOW_TO_INSTALL
        )  # fmt: skip
    return assets
