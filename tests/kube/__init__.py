"""A Kubernetes API server emulator for tests (built on kmock), with kvshm's CRDs loaded.

Fixtures `kube_api` and `kubeconfig` come from tests.kube.fixtures (tests/conftest.py loads it);
outside pytest, `start_kube_api()` gives a running KubeApi. docs/crds.md describes what it emulates.
"""

from tests.kube.runner import KubeApi, load_crds, start_kube_api

__all__ = ["KubeApi", "load_crds", "start_kube_api"]
