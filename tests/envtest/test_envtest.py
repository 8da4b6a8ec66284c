"""The real API server fixture itself: it runs, enforces the chart's RBAC, and says what is
missing when it cannot run."""

from __future__ import annotations

from pathlib import Path

import kubernetes
import pytest

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.envtest import manifests
from tests.envtest.fixtures import ChartAccounts, clean_up
from tests.envtest.server import EnvTest, MissingAssetsError, assets_dir


def test_missing_binaries_are_named_with_how_to_get_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "etcd").write_text("#!/bin/sh\n")
    (tmp_path / "etcd").chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    with pytest.raises(MissingAssetsError) as raised:
        assets_dir()
    message = str(raised.value)
    assert f"kube-apiserver not found in {tmp_path}" in message
    assert "etcd," not in message
    assert "scripts/install-tools.sh" in message and "KUBEBUILDER_ASSETS" in message


def test_server_is_kubernetes_1_28_with_the_crds(
    envtest_admin: kubernetes.client.ApiClient,
) -> None:
    version = kubernetes.client.VersionApi(envtest_admin).get_code()
    assert (version.major, version.minor) == ("1", "28")
    crds = kubernetes.client.ApiextensionsV1Api(envtest_admin).list_custom_resource_definition()
    assert {crd.metadata.name for crd in crds.items} >= {
        f"{REGION_PLURAL}.{GROUP}",
        f"{NODE_PLURAL}.{GROUP}",
    }


def test_chart_accounts_have_exactly_the_charts_permissions(
    envtest: EnvTest, chart_accounts: ChartAccounts, envtest_namespace: str
) -> None:
    with envtest.api_client(chart_accounts.token("agent")) as client:
        custom = kubernetes.client.CustomObjectsApi(client)
        listed = custom.list_namespaced_custom_object(
            GROUP, VERSION, envtest_namespace, REGION_PLURAL
        )
        assert listed["items"] == []
        with pytest.raises(kubernetes.client.ApiException) as refused:  # status only, never spec
            custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                envtest_namespace,
                REGION_PLURAL,
                manifests.region("r", envtest_namespace),
            )
        assert refused.value.status == 403
        with pytest.raises(kubernetes.client.ApiException) as refused:
            kubernetes.client.CoreV1Api(client).list_namespaced_secret(envtest_namespace)
        assert refused.value.status == 403
    assert set(chart_accounts.tokens) >= {"agent", "operator"}


def test_clean_up_leaves_no_region_offload_node_or_node_behind(
    envtest_admin: kubernetes.client.ApiClient, envtest_namespace: str
) -> None:
    """Finalizers included: the operator's stay on objects after its process is gone."""
    custom = kubernetes.client.CustomObjectsApi(envtest_admin)
    core = kubernetes.client.CoreV1Api(envtest_admin)
    finalizers = {"metadata": {"finalizers": ["kvshm.dev/operator"]}}
    region = manifests.region("r", envtest_namespace)
    region["metadata"].update(finalizers["metadata"])
    custom.create_namespaced_custom_object(GROUP, VERSION, envtest_namespace, REGION_PLURAL, region)
    node = manifests.offload_node("n1")
    node["metadata"].update(finalizers["metadata"])
    custom.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, node)
    core.create_node(manifests.node("n1"))
    clean_up(envtest_admin, envtest_namespace)
    assert (
        custom.list_namespaced_custom_object(GROUP, VERSION, envtest_namespace, REGION_PLURAL)[
            "items"
        ]
        == []
    )
    assert custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)["items"] == []
    assert core.list_node().items == []
