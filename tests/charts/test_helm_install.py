"""The chart installed into a real kube-apiserver: `helm install` for the defaults and every
values file of charts/kvshm/ci, every object accepted (Pods never run: there is no kubelet or
controller), and the CRD upgrade hook's own command run with its own ServiceAccount's token.

Monitoring objects (ServiceMonitor, PodMonitor, PrometheusRule) are rendered only where the
Prometheus Operator's API exists (helm asks the server); this server has none, so they are
checked by tests/charts/test_kubernetes_schemas.py and tests/monitoring instead.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.dynamic import DynamicClient

from tests.charts.rendering import EXAMPLE_VALUES, find, helm_args, values_id
from tests.charts.tools import CHART, run, tool
from tests.envtest.chart import ensure_namespace, load_documents, render_chart
from tests.envtest.fixtures import ChartAccounts
from tests.envtest.server import EnvTest


def helm(kubeconfig: Path, *args: str) -> str:
    result = run(tool("helm"), "--kubeconfig", str(kubeconfig), *args, timeout=120)
    assert result.returncode == 0, f"helm {' '.join(args)} failed:\n{result.stderr}"
    return result.stdout


def stored(client: kubernetes.client.ApiClient, manifest: dict[str, Any]) -> dict[str, Any]:
    dynamic = DynamicClient(client)
    resource = dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
    metadata = manifest["metadata"]
    namespace = metadata.get("namespace") if resource.namespaced else None
    found: dict[str, Any] = resource.get(name=metadata["name"], namespace=namespace).to_dict()
    return found


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_helm_install_creates_every_object(
    values: Path | None,
    envtest: EnvTest,
    envtest_admin: kubernetes.client.ApiClient,
    envtest_namespace: str,
    tmp_path: Path,
) -> None:
    kubeconfig = envtest.write_kubeconfig(tmp_path / "admin.kubeconfig")
    release = f"kvshm-{values_id(values)}"  # cluster-scoped names differ per release
    rendered = render_chart(envtest_namespace, () if values is None else (values,), release)
    for namespace in {o["metadata"].get("namespace") for o in rendered} - {None}:
        ensure_namespace(envtest_admin, namespace)  # e.g. Grafana's, for the dashboards
    helm(
        kubeconfig, "install", release, str(CHART), "--namespace", envtest_namespace,
        *helm_args(values), "--timeout", "60s",
    )  # fmt: skip
    objects = load_documents(helm(kubeconfig, "get", "manifest", release, "-n", envtest_namespace))
    kinds = {obj["kind"] for obj in objects}
    assert {"DaemonSet", "Deployment", "ServiceAccount", "ClusterRole"} <= kinds, kinds
    for manifest in objects:
        found = stored(envtest_admin, manifest)
        assert found["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
    status = helm(kubeconfig, "status", release, "-n", envtest_namespace, "-o", "yaml")
    assert yaml.safe_load(status)["info"]["status"] == "deployed"
    helm(kubeconfig, "uninstall", release, "-n", envtest_namespace, "--timeout", "60s")


def test_crd_upgrade_hook_command_applies_the_crds_with_its_own_token(
    envtest: EnvTest,
    envtest_admin: kubernetes.client.ApiClient,
    chart_accounts: ChartAccounts,
    tmp_path: Path,
) -> None:
    """The pre-upgrade Job's container command, as rendered, with the hook ServiceAccount's
    token (its ClusterRole as rendered) and the CRD files of its ConfigMap."""
    objects = tuple(render_chart(chart_accounts.namespace))
    job = find(objects, "Job", "crd-upgrade")
    config_map = find(objects, "ConfigMap", "crd-upgrade")
    container = job["spec"]["template"]["spec"]["containers"][0]
    (mount,) = (m for m in container["volumeMounts"] if m["name"] == "crds")
    crds = tmp_path / "crds"
    crds.mkdir()
    for name, text in config_map["data"].items():
        (crds / name).write_text(text)
    command = [*container["command"], *container["args"]]
    assert command[0] == "kubectl"
    command = [
        tool("kubectl"),
        *(arg.replace(mount["mountPath"], f"{crds}/") for arg in command[1:]),
    ]
    kubeconfig = chart_accounts.kubeconfig("crd-upgrade", tmp_path / "hook.kubeconfig")
    env = {e["name"]: e["value"] for e in container.get("env", ())}
    env["HOME"] = str(tmp_path)  # the Job's HOME is its /tmp emptyDir
    result = subprocess.run(
        [*command, "--kubeconfig", str(kubeconfig)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for name in ("offloadregions.kvshm.dev", "offloadnodes.kvshm.dev"):
        assert f"customresourcedefinition.apiextensions.k8s.io/{name} serverside-applied" in (
            result.stdout
        )
        crd = kubernetes.client.ApiextensionsV1Api(envtest_admin).read_custom_resource_definition(
            name
        )
        managers = {entry.manager for entry in crd.metadata.managed_fields}
        assert "kvshm-crd-upgrade" in managers, managers
