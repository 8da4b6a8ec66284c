"""pytest fixtures of the Kubernetes API emulator (registered by tests/conftest.py).

def test_something(kube_api: KubeApi) -> None:
    with kube_api.api_client() as client:
        kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(...)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kubernetes.config.kube_config
import pytest

from tests.kube.runner import KubeApi, start_kube_api


@pytest.fixture
def kube_api() -> Iterator[KubeApi]:
    """A fresh emulator per test, on a free 127.0.0.1 port, with charts/kvshm/crds/ loaded."""
    api = start_kube_api()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
def kubeconfig(kube_api: KubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A kubeconfig file for kube_api, made the default for this test.

    KUBECONFIG is set for subprocesses, and the kubernetes package's default location too: it
    reads KUBECONFIG once at import, and kopf's login (load_kube_config()) uses that default.
    """
    path = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    return path
