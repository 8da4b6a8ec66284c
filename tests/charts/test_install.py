"""The chart in a real API server (tests/envtest, Kubernetes 1.28): `helm install` for the default
values and every values file in charts/kvshm/ci/, with and without the Prometheus Operator's
API, and the CRD upgrade hook's own command with its own ServiceAccount's token.

There is no kubelet or controller manager: nothing runs (`--wait=false`), but every object the
chart renders must be accepted and stored by the server as rendered (nothing pruned or
changed; the server may only add its defaults)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from tests.charts.rendering import find, load_yaml_documents, render
from tests.charts.tools import CHART, run, tool
from tests.envtest.chart import apply, ensure_namespace, load_documents, render_chart
from tests.envtest.fixtures import ChartAccounts
from tests.envtest.server import EnvTest
from tests.waiting import wait_for

VALUES_FILES = [CHART / "values-production.yaml", *sorted((CHART / "ci").glob("*.yaml"))]
# namespaces the values files expect to exist (kube-prometheus-stack's; the operator's watch list)
EXPECTED_NAMESPACES = ("monitoring", "default", "kvshm-test")
MONITORING_GROUP = "monitoring.coreos.com"
MONITORING_KINDS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
}


def monitoring_crd(kind: str, plural: str) -> dict[str, Any]:
    """A stand-in for the Prometheus Operator's CRD of `kind`: the API exists (the chart checks
    .Capabilities for it), its schema is open (tests/charts/validate_monitoring.mjs checks the
    chart's objects against the Prometheus Operator's own schemas)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{MONITORING_GROUP}"},
        "spec": {
            "group": MONITORING_GROUP,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


@pytest.fixture(
    scope="module", params=[False, True], ids=["no-prometheus-operator", "prometheus-operator"]
)
def prometheus_operator(request: pytest.FixtureRequest, envtest: EnvTest) -> Iterator[bool]:
    """Whether the server serves monitoring.coreos.com/v1 (module-scoped: its CRDs are made
    once, when discovery lists them, and removed, until gone, after the module)."""
    if not request.param:
        yield False
        return
    names = [f"{plural}.{MONITORING_GROUP}" for plural in MONITORING_KINDS.values()]
    with envtest.api_client() as admin:
        extensions = kubernetes.client.ApiextensionsV1Api(admin)
        for kind, plural in MONITORING_KINDS.items():
            apply(admin, monitoring_crd(kind, plural))
        wait_for(lambda: _served(admin) >= set(MONITORING_KINDS.values()), 30, "discovery")
        try:
            yield True
        finally:
            for name in names:
                extensions.delete_custom_resource_definition(name)
            wait_for(lambda: not _served(admin), 60, "the monitoring CRDs to be gone")


def _served(admin: kubernetes.client.ApiClient) -> set[str]:
    """The resources discovery lists under monitoring.coreos.com/v1 (what helm sees)."""
    try:
        answer = kubernetes.client.CustomObjectsApi(admin).get_api_resources(MONITORING_GROUP, "v1")
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return set()
        raise
    return {resource.name for resource in answer.resources}


def helm_command(envtest: EnvTest, home: Path, *args: str) -> list[str]:
    """The command line of helm as the admin, with caches and config of its own."""
    kubeconfig = envtest.write_kubeconfig(home / "admin.kubeconfig")
    env_args = [
        f"HELM_CACHE_HOME={home / 'cache'}",
        f"HELM_CONFIG_HOME={home / 'config'}",
        f"HELM_DATA_HOME={home / 'data'}",
    ]
    return ["env", *env_args, tool("helm"), *args, "--kubeconfig", str(kubeconfig)]


def helm(envtest: EnvTest, home: Path, *args: str) -> str:
    """helm as the admin; fails the test on an error."""
    result = run(*helm_command(envtest, home, *args), timeout=120)
    assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result.stdout


def stored(admin: kubernetes.client.ApiClient, manifest: dict[str, Any]) -> dict[str, Any]:
    """The object the server keeps for a rendered manifest."""
    dynamic = kubernetes.dynamic.DynamicClient(admin)
    resource = dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
    metadata = manifest["metadata"]
    namespace = metadata.get("namespace") if resource.namespaced else None
    found: dict[str, Any] = resource.get(name=metadata["name"], namespace=namespace).to_dict()
    return found


def differences(rendered: Any, kept: Any, path: str = "") -> list[str]:
    """Where the stored object lacks or changed what was rendered (the server may only add:
    defaults, status, metadata of its own)."""
    if isinstance(rendered, dict) and isinstance(kept, dict):
        return [
            found
            for key, value in rendered.items()
            for found in differences(value, kept.get(key), f"{path}.{key}")
        ]
    if isinstance(rendered, list) and isinstance(kept, list) and len(rendered) == len(kept):
        return [
            found
            for index, (item, stored_item) in enumerate(zip(rendered, kept, strict=True))
            for found in differences(item, stored_item, f"{path}[{index}]")
        ]
    if kept is None and rendered in (False, 0, "", [], {}):
        return []  # an empty value of an `omitempty` field: the server does not echo it
    return [] if rendered == kept else [f"{path}: rendered {rendered!r}, stored {kept!r}"]


@pytest.mark.parametrize(
    "values", [None, *VALUES_FILES], ids=["default", *(p.stem for p in VALUES_FILES)]
)
def test_helm_install_is_accepted_by_the_api_server(
    values: Path | None,
    prometheus_operator: bool,
    envtest: EnvTest,
    envtest_admin: kubernetes.client.ApiClient,
    envtest_namespace: str,
    tmp_path: Path,
) -> None:
    # cluster-scoped objects are named after the release: one of its own per install
    release = f"kvshm-{secrets.token_hex(3)}"
    rendered = render_chart(envtest_namespace, () if values is None else (values,), release)
    rendered_namespaces = {o["metadata"].get("namespace") for o in rendered} - {None}
    for namespace in {*EXPECTED_NAMESPACES, *rendered_namespaces}:  # e.g. Grafana's
        ensure_namespace(envtest_admin, namespace)
    args = ["install", release, str(CHART), "--namespace", envtest_namespace, "--wait=false"]
    if values is not None:
        args += ["--values", str(values)]
    helm(envtest, tmp_path, *args)
    try:
        manifests = load_documents(
            helm(envtest, tmp_path, "get", "manifest", release, "-n", envtest_namespace)
        )
        kinds = {m["kind"] for m in manifests}
        assert {"DaemonSet", "Deployment", "ClusterRole", "ServiceAccount"} <= kinds
        monitoring = {m["kind"] for m in manifests if m["apiVersion"].startswith(MONITORING_GROUP)}
        enabled = values is None or "production" in values.name  # kind-values turns it off
        assert bool(monitoring) == (prometheus_operator and enabled), monitoring
        for manifest in manifests:
            kept = stored(envtest_admin, manifest)
            assert kept["metadata"]["uid"], manifest["metadata"]["name"]
            assert kept["metadata"]["annotations"]["meta.helm.sh/release-name"] == release
            changed = differences(manifest, kept)
            assert changed == [], f"{manifest['kind']} {manifest['metadata']['name']}: {changed}"
        status = helm(envtest, tmp_path, "status", release, "-n", envtest_namespace, "-o", "yaml")
        assert yaml.safe_load(status)["info"]["status"] == "deployed"
    finally:
        helm(envtest, tmp_path, "uninstall", release, "-n", envtest_namespace, "--wait=false")


def crd_hook_objects(admin: kubernetes.client.ApiClient, release: str, namespace: str) -> set[str]:
    """kind/name of the CRD upgrade hook's objects the server holds."""
    name = f"{release}-crd-upgrade"
    reads = {
        "ServiceAccount": lambda: kubernetes.client.CoreV1Api(
            admin
        ).read_namespaced_service_account(name, namespace),
        "ConfigMap": lambda: kubernetes.client.CoreV1Api(admin).read_namespaced_config_map(
            name, namespace
        ),
        "ClusterRole": lambda: kubernetes.client.RbacAuthorizationV1Api(admin).read_cluster_role(
            name
        ),
        "ClusterRoleBinding": lambda: kubernetes.client.RbacAuthorizationV1Api(
            admin
        ).read_cluster_role_binding(name),
        "Job": lambda: kubernetes.client.BatchV1Api(admin).read_namespaced_job(name, namespace),
    }
    held = set()
    for kind, read in reads.items():
        try:
            read()
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
        else:
            held.add(f"{kind}/{name}")
    return held


@pytest.mark.parametrize("job_succeeds", [False, True], ids=["job-fails", "job-succeeds"])
def test_the_crd_upgrade_hook_leaves_nothing_behind(
    job_succeeds: bool,
    envtest: EnvTest,
    envtest_admin: kubernetes.client.ApiClient,
    envtest_namespace: str,
    tmp_path: Path,
) -> None:
    """`helm upgrade` runs the pre-upgrade hook: its ServiceAccount, ClusterRole (a cluster-wide
    grant on CRDs), binding, ConfigMap and Job exist while the Job runs, and none is left once
    the Job has completed or failed. There is no kubelet here: the Job fails by running past
    helm's --timeout, or is marked Complete as its controller would."""
    release = f"kvshm-{secrets.token_hex(3)}"
    helm(envtest, tmp_path, "install", release, str(CHART), "-n", envtest_namespace, "--wait=false")
    every = {
        f"{kind}/{release}-crd-upgrade"
        for kind in ("ServiceAccount", "ConfigMap", "ClusterRole", "ClusterRoleBinding", "Job")
    }
    timeout = "120s" if job_succeeds else "10s"
    upgrade = subprocess.Popen(
        helm_command(envtest, tmp_path, "upgrade", release, str(CHART), "-n", envtest_namespace,
                     "--timeout", timeout),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        wait_for(
            lambda: crd_hook_objects(envtest_admin, release, envtest_namespace) == every,
            timeout=30,
            what="the hook's objects while its Job runs",
        )
        if job_succeeds:
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            complete = {"type": "Complete", "status": "True", "lastTransitionTime": now}
            kubernetes.client.BatchV1Api(envtest_admin).patch_namespaced_job_status(
                f"{release}-crd-upgrade",
                envtest_namespace,
                {"status": {"conditions": [complete], "startTime": now, "completionTime": now,
                            "succeeded": 1}},
            )  # fmt: skip
        output, _ = upgrade.communicate(timeout=180)
    finally:
        if upgrade.poll() is None:
            upgrade.kill()
            upgrade.wait()
    try:
        assert (upgrade.returncode == 0) == job_succeeds, output
        if not job_succeeds:
            assert "pre-upgrade hooks failed" in output, output
        left = crd_hook_objects(envtest_admin, release, envtest_namespace)
        assert left == set(), (
            f"left behind after the Job {'succeeded' if job_succeeds else 'failed'}"
        )
    finally:
        helm(envtest, tmp_path, "uninstall", release, "-n", envtest_namespace, "--wait=false")


def test_the_crd_upgrade_hooks_command_with_its_own_token(
    envtest: EnvTest, chart_accounts: ChartAccounts, tmp_path: Path
) -> None:
    """The pre-upgrade Job's container command, as rendered (kvshm-apply-crds in the chart's own
    image), run as its ServiceAccount (RBAC by the chart: get/patch of kvshm's two CRDs,
    create) on the files its ConfigMap mounts."""
    objects = render()
    job = find(objects, "Job", "-crd-upgrade")
    container = job["spec"]["template"]["spec"]["containers"][0]
    deployment = find(objects, "Deployment", "-operator")
    assert container["image"] == deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "crds")["mountPath"]
    crds = tmp_path / "crds"
    crds.mkdir()
    for name, text in find(objects, "ConfigMap", "-crd-upgrade")["data"].items():
        (crds / name).write_text(text)
    command = [str(crds) if arg == mount else arg for arg in container["command"]]
    assert command == ["kvshm-apply-crds", str(crds)], command
    kubeconfig = chart_accounts.kubeconfig("crd-upgrade", tmp_path / "hook.kubeconfig")
    result = run(
        "env", f"KUBECONFIG={kubeconfig}", str(Path(sys.executable).parent / command[0]),
        *command[1:],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    shipped = {
        doc["metadata"]["name"]
        for path in sorted((CHART / "crds").glob("*.yaml"))
        for doc in load_yaml_documents(path)
    }
    assert {line.split()[0] for line in result.stdout.splitlines()} == {
        f"customresourcedefinition.apiextensions.k8s.io/{name}" for name in shipped
    }
    assert all(line.endswith(" serverside-applied") for line in result.stdout.splitlines())
    with envtest.api_client() as admin:
        extensions = kubernetes.client.ApiextensionsV1Api(admin)
        for name in shipped:
            crd = extensions.read_custom_resource_definition(name)
            managers = {entry.manager for entry in crd.metadata.managed_fields}
            assert "kvshm-crd-upgrade" in managers, managers
    # and nothing beyond its own two CRDs: that token cannot even read another one
    refused = run(
        "env", f"HOME={tmp_path}", tool("kubectl"), "get", "crd",
        "customresourcedefinitions.apiextensions.k8s.io", "--kubeconfig", str(kubeconfig),
    )  # fmt: skip
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower(), refused.stderr


def test_the_crd_upgrade_command_refuses_what_is_not_a_kvshm_crd(tmp_path: Path) -> None:
    """A ConfigMap edited to carry anything else (another group's CRD, a ClusterRole) is refused
    before anything is sent, naming the file and what it held."""
    apply_crds = str(Path(sys.executable).parent / "kvshm-apply-crds")
    cases = {
        "role.yaml": "apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\n"
        "metadata: {name: x}\n",
        "other.yaml": "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
        "metadata: {name: a.example.com}\nspec: {group: example.com}\n",
        "list.yaml": "- 1\n- 2\n",
        "broken.yaml": "a: [\n",
    }
    for name, text in cases.items():
        folder = tmp_path / name.removesuffix(".yaml")
        folder.mkdir()
        (folder / name).write_text(text)
        result = run(apply_crds, str(folder))
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert (f"{folder / name}:" in result.stderr and "kvshm.dev" in result.stderr) or (
            name == "broken.yaml" and "not YAML" in result.stderr
        ), result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run(apply_crds, str(empty))
    assert result.returncode == 2 and "no *.yaml file" in result.stderr, result.stderr


def test_the_chart_refuses_kubernetes_older_than_the_tested_1_28() -> None:
    """kubeVersion: the API servers the chart is tested on (1.28) and later; see docs/deploy.md."""
    for version, accepted in (("1.27.16", False), ("1.28.0", True), ("1.33.1", True)):
        result = run(tool("helm"), "template", "kvshm", str(CHART), "--kube-version", version)
        assert (result.returncode == 0) == accepted, (version, result.stderr)
        if not accepted:
            assert "incompatible with Kubernetes v1.27.16" in result.stderr, result.stderr


def test_the_agents_priority_quota_covers_the_agents_pods_and_nothing_else(
    envtest_admin: kubernetes.client.ApiClient, envtest_namespace: str
) -> None:
    """The ResourceQuota rendered with the agent's system-node-critical class, in a real API
    server: an agent pod (the DaemonSet's template, as its controller would create it) is
    admitted and counted by it (a full quota refuses it, which is what makes the quota satisfy
    platforms that require one for that class), while other pods never count against it."""
    rendered = render_chart(envtest_namespace)
    for manifest in rendered:
        if manifest["kind"] in ("ServiceAccount", "ResourceQuota"):
            apply(envtest_admin, manifest)
    [quota] = [m for m in rendered if m["kind"] == "ResourceQuota"]
    daemonset = find(tuple(rendered), "DaemonSet", "-agent")
    agent_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "agent-", **daemonset["spec"]["template"]["metadata"]},
        "spec": {**daemonset["spec"]["template"]["spec"], "nodeName": "gpu-node-1"},
    }
    other_pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "other-"},
        "spec": {
            # an account that exists (the server has no controller to make "default")
            "serviceAccountName": daemonset["spec"]["template"]["spec"]["serviceAccountName"],
            "containers": [{"name": "c", "image": "registry.example.com/other:1"}],
        },
    }
    core = kubernetes.client.CoreV1Api(envtest_admin)
    name, hard = quota["metadata"]["name"], quota["spec"]["hard"]["pods"]

    def quota_used(pods: str) -> None:  # what the quota controller (absent here) would write
        core.patch_namespaced_resource_quota_status(
            name, envtest_namespace, {"status": {"hard": {"pods": hard}, "used": {"pods": pods}}}
        )

    def create(pod: dict[str, Any]) -> kubernetes.client.V1Pod:
        return core.create_namespaced_pod(envtest_namespace, pod, dry_run="All")

    quota_used("0")
    admitted = create(agent_pod)
    assert admitted.spec.priority_class_name == "system-node-critical"
    assert admitted.spec.priority >= 2_000_000_000  # the kubelet never evicts such pods
    quota_used(hard)
    with pytest.raises(kubernetes.client.ApiException) as refused:
        create(agent_pod)
    assert refused.value.status == 403 and "exceeded quota" in str(refused.value.body)
    assert create(other_pod).spec.priority in (None, 0)  # a full quota leaves other pods alone


def test_the_notes_warn_of_taints_the_agent_does_not_tolerate(
    envtest: EnvTest, envtest_namespace: str, tmp_path: Path
) -> None:
    """NOTES.txt looks the nodes up: with the default values (no toleration) a GPU node's
    taint means no agent there, and helm install says so; the production values tolerate it."""
    with envtest.api_client() as admin:
        core = kubernetes.client.CoreV1Api(admin)
        for name, taint in (
            ("gpu-1", "nvidia.com/gpu"),
            ("gpu-2", "nvidia.com/gpu"),
            ("cpu", None),
        ):
            spec = {"taints": [{"key": taint, "value": "present", "effect": "NoSchedule"}]}
            core.create_node(
                {
                    "metadata": {"name": name, "labels": {"nvidia.com/gpu.present": "true"}},
                    "spec": spec if taint else {},
                }
            )
    cases = {"defaults": [], "production": ["-f", str(CHART / "values-production.yaml")]}
    for case, values in cases.items():
        release = f"notes-{case}"
        output = helm(
            envtest, tmp_path, "install", release, str(CHART), "-n", envtest_namespace,
            "--dry-run=server", *values,
        )  # fmt: skip
        warned = "WARNING: 2 node(s) matching agent.nodeSelector carry the taint nvidia.com/gpu"
        assert (warned in output) == (case == "defaults"), output[output.find("NOTES") :]
        assert "KVSHM_INSTANCE_ID" not in output


def test_the_notes_warn_where_no_tenant_policy_can_be_created(
    envtest: EnvTest, envtest_namespace: str, tmp_path: Path
) -> None:
    """This API server (1.28, feature gate off) serves no ValidatingAdmissionPolicy: the chart
    renders no tenant policy, and helm install says that nothing confines the tenants."""
    warned = "WARNING: no tenant policy was created"
    for enabled in (True, False):
        output = helm(
            envtest, tmp_path, "install", f"tenants-{str(enabled).lower()}", str(CHART),
            "-n", envtest_namespace, "--dry-run=server", f"--set=tenantPolicy.enabled={enabled}",
        )  # fmt: skip
        assert "kind: ValidatingAdmissionPolicy" not in output
        assert (warned in output) == enabled, output[output.find("NOTES") :]
