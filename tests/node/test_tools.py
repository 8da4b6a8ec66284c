"""Without the node's programs the node tier fails, naming each missing one and where to get it
(it never skips)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.node import tools


def test_missing_programs_are_named_with_their_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tools, "KUBE_TOOLS", tmp_path / "kube")
    monkeypatch.setattr(tools, "CNI_DIR", tmp_path / "cni")
    monkeypatch.setattr(tools, "BUSYBOX", tmp_path / "busybox")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.setattr(tools.shutil, "which", lambda name, path=None: None)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path / "envtest"))
    with pytest.raises(tools.MissingNodeToolsError) as raised:
        tools.check_tools()
    message = str(raised.value)
    for name in tools.KUBE_BINARIES:
        assert f"{tmp_path / 'kube' / name} (Kubernetes v1.28.7 node program)" in message
    for name, package in tools.DEBIAN_PROGRAMS.items():
        assert f"{name} (Debian package {package})" in message
    assert "containernetworking-plugins" in message and "busybox-static" in message
    assert "kube-apiserver" in message and "etcd" in message
    assert "scripts/install-node.sh" in message and "KVSHM_KUBE_SOURCE" in message
