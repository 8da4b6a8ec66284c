"""pytest fixtures of the real API server (registered by tests/conftest.py); see README.md.

One etcd + kube-apiserver per test session, with the chart's CRDs and the chart's RBAC
(release `kvshm` in namespace `kvshm-system`). Each test gets a fresh namespace; Nodes and
OffloadNodes (cluster-scoped) are deleted after each test that used envtest_namespace.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes
import pytest

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.envtest.audit import AuditPolicy
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
    """etcd + kube-apiserver v1.28 for the session, with charts/kvshm/crds applied; its audit
    log holds every write of kvshm.dev objects and Events (tests count the operator's)."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(start_envtest(audit=AuditPolicy.WRITES))
        except MissingAssetsError as exc:
            pytest.fail(str(exc), pytrace=False)
        with server.api_client() as client:
            apply_crds(client)
        yield server


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
    """Delete the namespace's OffloadRegions and every OffloadNode and Node, finalizers (the
    operator's, on regions and, for its timers, on OffloadNodes) stripped first."""
    custom = kubernetes.client.CustomObjectsApi(client)
    core = kubernetes.client.CoreV1Api(client)
    regions = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, REGION_PLURAL)
    for region in regions["items"]:
        _force_delete(custom, REGION_PLURAL, region["metadata"]["name"], namespace)
    for offload_node in custom.list_cluster_custom_object(GROUP, VERSION, NODE_PLURAL)["items"]:
        _force_delete(custom, NODE_PLURAL, offload_node["metadata"]["name"])
    for node in core.list_node().items:
        _ignore_missing(core.delete_node, node.metadata.name)


def _force_delete(
    custom: kubernetes.client.CustomObjectsApi, plural: str, name: str, namespace: str = ""
) -> None:
    where = (GROUP, VERSION, namespace, plural) if namespace else (GROUP, VERSION, plural)
    patch = (
        custom.patch_namespaced_custom_object if namespace else custom.patch_cluster_custom_object
    )
    delete = (
        custom.delete_namespaced_custom_object if namespace else custom.delete_cluster_custom_object
    )
    _ignore_missing(patch, *where, name, {"metadata": {"finalizers": None}})
    _ignore_missing(delete, *where, name)


def _ignore_missing(call: object, *args: object) -> None:
    try:
        call(*args)  # type: ignore[operator]
    except kubernetes.client.ApiException as exc:
        if exc.status != 404:
            raise
