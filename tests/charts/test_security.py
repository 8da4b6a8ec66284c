"""The rendered securityContexts, host access and RBAC are what docs/deploy.md promises."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes.utils import parse_quantity

from tests.agent.builders import local_agent, manifest
from tests.charts.rendering import EXAMPLE_VALUES, find, pod_specs, render, values_id
from tests.charts.tools import CHART, run, tool

AGENT_DEFAULT_CAPS = {"IPC_LOCK", "CHOWN", "FOWNER", "DAC_OVERRIDE"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _seccomp(spec: dict[str, Any], container: dict[str, Any]) -> str | None:
    profile = container["securityContext"].get("seccompProfile") or spec.get(
        "securityContext", {}
    ).get("seccompProfile", {})
    return profile.get("type")


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_every_container_is_locked_down(values: Path | None) -> None:
    checked = 0
    for name, spec in pod_specs(render(values)):
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), name
        for container in _containers(spec):
            where = f"{name}/{container['name']}"
            context = container.get("securityContext")
            assert context, f"{where} has no securityContext"
            assert context["allowPrivilegeEscalation"] is False, where
            assert context.get("privileged", False) is False, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert _seccomp(spec, container) == "RuntimeDefault", where
            checked += 1
    assert checked >= 4  # agent, operator, CRD hook, helm test


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_only_the_agent_runs_as_root(values: Path | None) -> None:
    for name, spec in pod_specs(render(values)):
        for container in _containers(spec):
            context = {**spec.get("securityContext", {}), **container["securityContext"]}
            if name.startswith("DaemonSet/"):
                assert context["runAsUser"] == 0
            else:
                assert context["runAsNonRoot"] is True, name
                assert context["runAsUser"] != 0, name


def _agent(objects: tuple[dict[str, Any], ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    daemonset = find(objects, "DaemonSet", "-agent")
    return daemonset, daemonset["spec"]["template"]["spec"]


def test_agent_adds_only_the_capabilities_it_needs() -> None:
    _, spec = _agent(render())
    added = set(spec["containers"][0]["securityContext"]["capabilities"]["add"])
    assert added == AGENT_DEFAULT_CAPS
    assert spec["hostPID"] is False


def test_agent_host_pid_is_opt_in_and_brings_ptrace() -> None:
    _, spec = _agent(render(sets=("agent.hostPID=true",)))
    assert spec["hostPID"] is True
    added = spec["containers"][0]["securityContext"]["capabilities"]["add"]
    assert set(added) == AGENT_DEFAULT_CAPS | {"SYS_PTRACE"}
    assert len(added) == len(set(added))


def test_agent_can_be_restricted_to_mlock_only() -> None:
    _, spec = _agent(render(sets=("agent.capabilities=[IPC_LOCK]",)))
    assert spec["containers"][0]["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]


def test_agent_mounts_the_region_root_typed_and_knows_its_node() -> None:
    daemonset, spec = _agent(render(sets=("regionRoot=/dev/shm/kv",)))
    volume = next(v for v in spec["volumes"] if "hostPath" in v)
    assert volume["hostPath"] == {"path": "/dev/shm/kv", "type": "DirectoryOrCreate"}
    container = spec["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount["mountPath"] == "/dev/shm/kv" and not mount.get("readOnly")
    # the hostPaths are the region root and, read-only, the host's lock table (holders)
    host_paths = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == {
        volume["name"]: volume["hostPath"],
        "host-lock-table": {"path": "/proc/locks", "type": "File"},
    }
    [locks] = [m for m in container["volumeMounts"] if m["name"] == "host-lock-table"]
    assert locks["readOnly"] is True
    assert f"--lock-table={locks['mountPath']}" in container["args"]
    node_name = next(e for e in container["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1


def test_agent_probes_use_its_endpoints() -> None:
    _, spec = _agent(render(sets=("agent.port=9999",)))
    container = spec["containers"][0]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9999, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}


def test_gpu_example_places_agents_on_gpu_nodes_with_priority() -> None:
    gpu = next(v for v in EXAMPLE_VALUES if v is not None and v.stem == "values-production")
    _, spec = _agent(render(gpu))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["priorityClassName"] == "system-node-critical"


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_the_agent_is_never_evicted_by_the_kubelet_unless_asked(values: Path | None) -> None:
    """Region pages are charged to the agent, so any evictable class makes it the kubelet's
    first victim under memory pressure, and evicting it frees nothing: system-node-critical
    (which the kubelet never evicts) by default and in the GPU example, with the ResourceQuota
    some platforms require for it outside kube-system."""
    objects = render(values)
    _, spec = _agent(objects)
    if values is not None and values.stem == "kind-values":
        assert "priorityClassName" not in spec  # a test cluster: no class at all
        assert not [o for o in objects if o["kind"] in ("PriorityClass", "ResourceQuota")]
        return
    assert spec["priorityClassName"] == "system-node-critical"
    assert not [o for o in objects if o["kind"] == "PriorityClass"]
    quota = find(objects, "ResourceQuota")
    assert quota["metadata"]["namespace"] == "kvshm-system"
    assert quota["spec"]["scopeSelector"] == {
        "matchExpressions": [
            {"scopeName": "PriorityClass", "operator": "In", "values": ["system-node-critical"]}
        ]
    }
    assert list(quota["spec"]["hard"]) == ["pods"]  # counts pods, asks nothing of their resources
    # one agent per node, in clusters up to the 5000 nodes Kubernetes supports
    assert parse_quantity(quota["spec"]["hard"]["pods"]) >= 5000


def test_the_charts_own_priority_class_is_still_an_option() -> None:
    objects = render(sets=("agent.priorityClass.create=true", 'agent.priorityClass.name=""'))
    _, spec = _agent(objects)
    priority = find(objects, "PriorityClass")
    assert spec["priorityClassName"] == priority["metadata"]["name"] == "kvshm-agent"
    assert priority["value"] == 1000000 and priority["globalDefault"] is False
    assert not [o for o in objects if o["kind"] == "ResourceQuota"]


def test_the_chart_does_not_try_to_create_a_reserved_system_class() -> None:
    result = run(tool("helm"), "template", str(CHART), "--set", "agent.priorityClass.create=true")
    assert result.returncode != 0
    assert "Kubernetes reserves the system- prefix" in result.stderr, result.stderr
    assert 'Set agent.priorityClass.name to ""' in result.stderr


def test_operator_is_a_single_recreated_replica_with_kopf_liveness() -> None:
    deployment = find(render(), "Deployment", "-operator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "add" not in container["securityContext"]["capabilities"]
    probe = container["livenessProbe"]["httpGet"]
    assert probe == {"path": "/healthz", "port": "health"}
    health = next(p for p in container["ports"] if p["name"] == "health")
    assert any(f":{health['containerPort']}/healthz" in arg for arg in container["args"])


# ---------------------------------------------------------------- RBAC


def _grants(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(group, resource, verb) triples a ClusterRole grants; resourceNames-limited ones marked."""
    grants = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    limited = "#named" if rule.get("resourceNames") else ""
                    grants.add((group, resource + limited, verb))
    return grants


WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


def _writes(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {grant for grant in _grants(role) if grant[2] in WRITE_VERBS}


def test_no_role_uses_wildcards_or_touches_secrets_or_pods() -> None:
    roles = [o for o in render() if o["kind"] in ("ClusterRole", "Role")]
    assert len(roles) == 3  # agent, operator, CRD upgrade hook
    for role in roles:
        for group, resource, verb in _grants(role):
            assert "*" not in (group, resource, verb), role["metadata"]["name"]
            assert resource.split("#")[0] not in {"secrets", "pods", "pods/exec", "configmaps"}


def test_agent_may_write_only_region_status_and_offload_nodes() -> None:
    role = find(render(), "ClusterRole", "-agent")
    assert _writes(role) == {
        ("kvshm.dev", "offloadregions/status", "patch"),
        ("kvshm.dev", "offloadnodes", "create"),
        ("kvshm.dev", "offloadnodes/status", "patch"),
        ("", "events", "create"),  # POSTed to core/v1 only (agent/kvshm/agent/cluster/sink.py)
    }
    # reading: its regions, its OffloadNode, its node's labels
    assert ("", "nodes", "get") in _grants(role)
    assert ("", "nodes", "list") not in _grants(role)


# What each component's code calls (agent: kvshm.agent.cluster; operator: kvshm.operator.kube and
# kopf 1.45, which lists and watches objects whole, PATCHes them and their /status, and POSTs
# core/v1 Events): exactly these grants. tests/operator/test_api_server.py,
# tests/operator/test_with_agents.py and tests/agent/test_cluster_mode.py run both programs
# with these roles against a real API server, so a missing grant fails them.
EXACT_GRANTS = {
    "agent": {
        ("kvshm.dev", "offloadregions", "get"),
        ("kvshm.dev", "offloadregions", "list"),
        ("kvshm.dev", "offloadregions", "watch"),
        ("kvshm.dev", "offloadregions/status", "patch"),
        ("kvshm.dev", "offloadnodes", "get"),
        ("kvshm.dev", "offloadnodes", "list"),
        ("kvshm.dev", "offloadnodes", "watch"),
        ("kvshm.dev", "offloadnodes", "create"),
        ("kvshm.dev", "offloadnodes/status", "patch"),
        ("", "nodes", "get"),
        ("", "events", "create"),
    },
    "operator": {
        ("kvshm.dev", "offloadregions", "get"),
        ("kvshm.dev", "offloadregions", "list"),
        ("kvshm.dev", "offloadregions", "watch"),
        ("kvshm.dev", "offloadregions", "patch"),
        ("kvshm.dev", "offloadregions/status", "patch"),
        ("kvshm.dev", "offloadnodes", "get"),
        ("kvshm.dev", "offloadnodes", "list"),
        ("kvshm.dev", "offloadnodes", "watch"),
        ("kvshm.dev", "offloadnodes", "patch"),
        ("kvshm.dev", "offloadnodes", "delete"),
        ("", "nodes", "get"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
        ("", "events", "create"),
    },
}


@pytest.mark.parametrize("component", sorted(EXACT_GRANTS))
def test_each_role_grants_exactly_what_its_code_calls(component: str) -> None:
    role = find(render(), "ClusterRole", f"-{component}")
    assert _grants(role) == EXACT_GRANTS[component]


def test_operator_may_not_write_status_of_nodes_or_create_them() -> None:
    role = find(render(), "ClusterRole", "-operator")
    writes = _writes(role)
    assert ("kvshm.dev", "offloadregions/status", "patch") in writes
    assert ("kvshm.dev", "offloadnodes", "patch") in writes  # reclaim decisions
    assert ("kvshm.dev", "offloadnodes/status", "patch") not in writes  # the agent's report
    assert ("kvshm.dev", "offloadnodes", "create") not in writes
    assert not {w for w in writes if w[0] in ("", "apps") and w[1] != "events"}


def test_crd_hook_may_change_only_kvshm_crds() -> None:
    role = find(render(), "ClusterRole", "-crd-upgrade")
    named = next(r for r in role["rules"] if r.get("resourceNames"))
    assert set(named["resourceNames"]) == {"offloadregions.kvshm.dev", "offloadnodes.kvshm.dev"}
    assert _writes(role) == {
        ("apiextensions.k8s.io", "customresourcedefinitions#named", "patch"),
        ("apiextensions.k8s.io", "customresourcedefinitions", "create"),
    }


@pytest.mark.parametrize("component", ["agent", "operator", "crd-upgrade"])
def test_each_role_is_bound_to_its_own_service_account_only(component: str) -> None:
    objects = render()
    binding = find(objects, "ClusterRoleBinding", f"-{component}")
    assert binding["roleRef"]["name"] == binding["metadata"]["name"]
    [subject] = binding["subjects"]
    assert subject["kind"] == "ServiceAccount" and subject["namespace"] == "kvshm-system"
    account = find(objects, "ServiceAccount", f"-{component}")
    assert subject["name"] == account["metadata"]["name"]
    # no token in pods that did not ask for one
    assert account["automountServiceAccountToken"] is False


@pytest.mark.parametrize("component", ["agent", "operator"])
@pytest.mark.parametrize("schema", [True, False], ids=["schema", "template"])
def test_an_existing_service_account_must_be_named(component: str, schema: bool) -> None:
    """create: false without a name would bind the ClusterRole to the namespace's "default"
    ServiceAccount, which every pod there runs as: refused, by the schema and by the template
    (for `--skip-schema-validation`), naming the value."""
    args = [tool("helm"), "template", "kvshm", str(CHART)]
    args += ["--set", f"{component}.serviceAccount.create=false"]
    if not schema:
        args.append("--skip-schema-validation")
    result = run(*args)
    assert result.returncode != 0, f"{component} would run as the namespace's default account"
    assert f"{component}.serviceAccount.name" in result.stderr, result.stderr
    named = run(*args, "--set", f"{component}.serviceAccount.name=existing")
    assert named.returncode == 0, named.stderr
    [binding] = [
        doc
        for doc in yaml.safe_load_all(named.stdout)
        if doc
        and doc["kind"] == "ClusterRoleBinding"
        and doc["metadata"]["name"].endswith(component)
    ]
    assert binding["subjects"][0]["name"] == "existing"


def test_rbac_can_be_left_to_the_cluster_admin() -> None:
    objects = render(sets=("rbac.create=false", "crds.upgradeJob.enabled=false"))
    assert not [o for o in objects if o["kind"].endswith(("Role", "RoleBinding"))]


def _run_agent_with_capabilities(caps: set[str], regions: Path, root: Path) -> str:
    """The real agent, as root holding only `caps` (as the chart's container would)."""
    bounding = ",".join(["-all", *(f"+{cap.lower()}" for cap in sorted(caps))])
    done = subprocess.run(
        [
            "setpriv",
            "--inh-caps=-all",
            f"--bounding-set={bounding}",
            "--",
            *local_agent(regions, root, "--once", "--no-http"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout


@pytest.mark.parametrize("values", EXAMPLE_VALUES, ids=values_id)
def test_the_rendered_capabilities_are_enough_for_a_tenant_owned_region(
    shm_dir: Path, values: Path | None
) -> None:
    """With exactly the DaemonSet's capabilities (defaults and every example values file: the
    serving example runs as its own uid) the agent creates, locks and (after a restart) adopts a
    region owned by the serving pod's uid; without DAC_OVERRIDE it cannot."""
    _, spec = _agent(render(values))
    caps = set(spec["containers"][0]["securityContext"]["capabilities"]["add"])
    regions = shm_dir / "regions"
    regions.mkdir()
    document = manifest("owned", "team", access={"uid": 4321, "gid": 4321})
    (regions / "r.yaml").write_text(yaml.safe_dump(document))
    for attempt in ("create", "restart"):
        out = _run_agent_with_capabilities(caps, regions, shm_dir / "root")
        assert "team/owned  Ready" in out, f"{attempt}: {out}"
    region_file = shm_dir / "root/team/owned/vllm_offload_owned.mmap"
    assert (region_file.stat().st_uid, region_file.stat().st_gid) == (4321, 4321)
    out = _run_agent_with_capabilities(caps - {"DAC_OVERRIDE"}, regions, shm_dir / "root")
    assert "team/owned  Failed" in out and "needs CAP_DAC_OVERRIDE" in out
