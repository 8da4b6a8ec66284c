"""pytest fixtures of the real API server (registered by tests/conftest.py); see README.md.

One etcd + kube-apiserver per test session, with the chart's CRDs and the chart's RBAC
(release `kvshm` in namespace `kvshm-system`). Each test gets a fresh namespace; Nodes and
OffloadNodes (cluster-scoped) are deleted after each test that used envtest_namespace.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.envtest.chart import RELEASE, apply_crds, install_rbac, service_account_token
from tests.envtest.server import EnvTest, MissingAssetsError, start_envtest

CHART_NAMESPACE = "kvshm-system"
TOKEN_SECONDS = 24 * 3600


@dataclass(frozen=True)
class ChartAccounts:
    """Tokens of the chart's ServiceAccounts (as installed by install_rbac)."""

    server: EnvTest
    namespace: str
    tokens: dict[str, str]  # component (agent, operator, crd-upgrade) -> token

    def token(self, component: str) -> str:
        return self.tokens[component]

    def kubeconfig(self, component: str, path: Path) -> Path:
        """A kubeconfig file that authenticates as the chart's ServiceAccount of `component`."""
        return self.server.write_kubeconfig(path, self.tokens[component], self.namespace)


@pytest.fixture(scope="session")
def envtest() -> Iterator[EnvTest]:
    """etcd + kube-apiserver v1.28 for the session, with charts/kvshm/crds applied."""
    try:
        manager = start_envtest()
        server = manager.__enter__()
    except MissingAssetsError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        with server.api_client() as client:
            apply_crds(client)
        yield server
    finally:
        manager.__exit__(None, None, None)


@pytest.fixture(scope="session")
def chart_accounts(envtest: EnvTest) -> ChartAccounts:
    """The chart's RBAC (helm template of charts/kvshm) in kvshm-system, and a token per
    ServiceAccount: processes run with exactly the chart's permissions."""
    with envtest.api_client() as client:
        objects = install_rbac(client, CHART_NAMESPACE)
        accounts = [o["metadata"]["name"] for o in objects if o["kind"] == "ServiceAccount"]
        tokens = {
            name.removeprefix(f"{RELEASE}-"): service_account_token(
                client, CHART_NAMESPACE, name, TOKEN_SECONDS
            )
            for name in accounts
        }
    return ChartAccounts(envtest, CHART_NAMESPACE, tokens)


@pytest.fixture
def envtest_admin(envtest: EnvTest) -> Iterator[kubernetes.client.ApiClient]:
    """An ApiClient as the admin (system:masters)."""
    with envtest.api_client() as client:
        yield client


@pytest.fixture
def agent_kubeconfig(chart_accounts: ChartAccounts, tmp_path: Path) -> Path:
    return chart_accounts.kubeconfig("agent", tmp_path / "agent.kubeconfig")


@pytest.fixture
def operator_kubeconfig(chart_accounts: ChartAccounts, tmp_path: Path) -> Path:
    return chart_accounts.kubeconfig("operator", tmp_path / "operator.kubeconfig")


@pytest.fixture
def envtest_namespace(envtest: EnvTest, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for this test (namespaces are never finalised here, so none is reused).

    After the test: its OffloadRegions are deleted with their finalizers stripped (no operator
    of a later test should find them), and every Node and OffloadNode is deleted.
    """
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{secrets.token_hex(3)}"
    with envtest.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": name}})
    yield name
    with envtest.api_client() as client:
        clean_up(client, name)


def clean_up(client: kubernetes.client.ApiClient, namespace: str) -> None:
    custom = kubernetes.client.CustomObjectsApi(client)
    core = kubernetes.client.CoreV1Api(client)
    regions = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, REGION_PLURAL)
    for region in regions["items"]:
        name = region["metadata"]["name"]
        _ignore_missing(
            custom.patch_namespaced_custom_object,
            GROUP, VERSION, namespace, REGION_PLURAL, name, {"metadata": {"finalizers": None}},
        )  # fmt: skip
        _ignore_missing(
            custom.delete_namespaced_custom_object, GROUP, VERSION, namespace, REGION_PLURAL, name
        )
    for offload_node in custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)["items"]:
        _ignore_missing(
            custom.delete_cluster_custom_object,
            GROUP, VERSION, NODE_PLURAL, offload_node["metadata"]["name"],
        )  # fmt: skip
    for node in core.list_node().items:
        _ignore_missing(core.delete_node, node.metadata.name)


def _ignore_missing(call: object, *args: object) -> None:
    try:
        call(*args)  # type: ignore[operator]
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
