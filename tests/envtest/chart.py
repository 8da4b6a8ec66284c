"""The chart's own objects in a real API server: its CRDs (server-side apply, as
`kubectl apply --server-side` does), the RBAC `helm template` renders, and ServiceAccount tokens
(TokenRequest), so a process runs with exactly the permissions the chart grants."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from kubernetes.dynamic import DynamicClient

from tests.envtest.server import REPO

CHART = REPO / "charts" / "kvshm"
CRDS = CHART / "crds"
HELM = REPO / ".tools" / "bin" / "helm"
RELEASE = "kvshm"
FIELD_MANAGER = "kvshm-tests"
RBAC_KINDS = frozenset(
    {"ServiceAccount", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
)


def load_documents(text: str) -> list[dict[str, Any]]:
    """The objects of a YAML stream; a List's items in its place (the chart's CRD upgrade hook
    is one), as the API server sees them."""
    objects = []
    for doc in yaml.safe_load_all(text):
        if isinstance(doc, dict) and doc:
            objects += doc["items"] if doc.get("kind") == "List" else [doc]
    return objects


def apply(api_client: kubernetes.client.ApiClient, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply of one object (any kind the server serves), conflicts forced."""
    dynamic = DynamicClient(api_client)
    resource = dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
    metadata = manifest.get("metadata") or {}
    result = dynamic.server_side_apply(
        resource,
        body=dict(manifest),
        name=metadata["name"],
        namespace=metadata.get("namespace") if resource.namespaced else None,
        field_manager=FIELD_MANAGER,
        force_conflicts=True,
    )
    applied: dict[str, Any] = result.to_dict()
    return applied


def apply_crds(api_client: kubernetes.client.ApiClient, timeout: float = 30.0) -> list[str]:
    """charts/kvshm/crds/*.yaml, applied server-side; returns their names once Established."""
    names = []
    for path in sorted(CRDS.glob("*.yaml")):
        for manifest in load_documents(path.read_text()):
            names.append(apply(api_client, manifest)["metadata"]["name"])
    extensions = kubernetes.client.ApiextensionsV1Api(api_client)
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            crd = extensions.read_custom_resource_definition(name)
            conditions = {c.type: c.status for c in (crd.status.conditions or ())}
            if conditions.get("Established") == "True":
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {name} not Established: {conditions}")
            time.sleep(0.1)
    return names


def render_chart(
    namespace: str,
    values_files: Sequence[Path] = (),
    release: str = RELEASE,
    extra_args: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Every object `helm template` renders (hooks included), for this namespace."""
    command = [str(HELM), "template", release, str(CHART), "--namespace", namespace]
    for values in values_files:
        command += ["--values", str(values)]
    output = subprocess.run(
        [*command, *extra_args], check=True, capture_output=True, text=True
    ).stdout
    return load_documents(output)


def ensure_namespace(api_client: kubernetes.client.ApiClient, namespace: str) -> None:
    """Create the namespace unless it exists."""
    try:
        kubernetes.client.CoreV1Api(api_client).create_namespace({"metadata": {"name": namespace}})
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise


def install_rbac(
    api_client: kubernetes.client.ApiClient, namespace: str, release: str = RELEASE
) -> list[dict[str, Any]]:
    """The chart's ServiceAccounts, Roles, ClusterRoles and bindings, exactly as rendered.

    The namespace is created when missing. Returns the objects applied.
    """
    ensure_namespace(api_client, namespace)
    objects = [o for o in render_chart(namespace, release=release) if o["kind"] in RBAC_KINDS]
    for manifest in objects:
        apply(api_client, manifest)
    return objects


def service_account_token(
    api_client: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    expiration_seconds: int = 3600,
) -> str:
    """A real token of the ServiceAccount (TokenRequest, what `kubectl create token` does)."""
    core = kubernetes.client.CoreV1Api(api_client)
    request = core.create_namespaced_service_account_token(
        name, namespace, {"spec": {"expirationSeconds": expiration_seconds}}
    )
    token: str = request.status.token
    return token
