"""The chart's tenant policy on the node's API server (ValidatingAdmissionPolicy v1beta1: Kubernetes
1.28 with its feature gate on, as tests/node/node.py starts it), installed with `helm install`
and the default values, in examples/serving's namespace as shipped (Pod Security `privileged`,
labelled as a tenant's).

A tenant's pod there may mount a hostPath: exactly one of its namespace's region directories,
since the tenant owns that directory and the kubelet follows a symlink the tenant plants in it
(shown here on the node), and whatever else the pod may do as root, or with privileges, is root
on the node. So every example serving pod is admitted, and each way out of Pod Security's
restricted profile is refused by the rule that names it, in containers, init containers and
ephemeral containers (kubectl debug, and the subresource patched through the API). The same pods
are admitted in a namespace that is not a tenant's, and in the chart's own namespace even when it
is labelled as one (the agent mounts the whole region root), so each refusal is the policy's.
Pods are created with a server-side dry run: admission runs in full, nothing is scheduled."""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from tests.node.chart import NAMESPACE, Release, wait
from tests.node.node import PAUSE_IMAGE, Node, NodeError
from tests.node.regions import apply_manifest
from tests.node.serving import apply_namespace, load

TENANT = "serving"  # examples/serving/namespace.yaml
OTHER = "not-a-tenant"
TENANT_LABEL = "kvshm.dev/tenant"
POLICY = "kvshm-tenants"
# the example's region directory (examples/serving/offloadregion.yaml) on the chart's default root
REGION_DIRECTORY = f"/dev/shm/kvshm/{TENANT}/llama-70b-kv"
ONLY_REGION_DIRECTORIES = "hostPath volumes must be exactly a region directory of this namespace"

Pod = dict[str, Any]


SERVING_EXAMPLES = (
    "deployment.yaml",
    "quickstart/deployment.yaml",
    "plugin/deployment.yaml",
    "data-parallel/deployment.yaml",
)


def serving_pod(namespace: str = TENANT, example: str = "deployment.yaml") -> Pod:
    """An examples/serving Deployment's pod, as its ReplicaSet would create it."""
    [deployment] = [d for d in load(example) if d["kind"] == "Deployment"]
    template = copy.deepcopy(deployment["spec"]["template"])
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": "llama-70b-probe", "namespace": namespace},
        "spec": template["spec"],
    }


def _container(pod: Pod, name: str = "vllm") -> dict[str, Any]:
    spec = pod["spec"]
    return next(c for c in [*spec["containers"], *spec["initContainers"]] if c["name"] == name)


def _context(pod: Pod, name: str = "vllm") -> dict[str, Any]:
    return _container(pod, name).setdefault("securityContext", {})


def _set(path: str, value: object, name: str = "vllm") -> Callable[[Pod], None]:
    """Set a field of a container's securityContext ("pod." for the pod's own)."""

    def change(pod: Pod) -> None:
        context = (
            pod["spec"].setdefault("securityContext", {})
            if path.startswith("pod.")
            else _context(pod, name)
        )
        *parents, key = path.removeprefix("pod.").split(".")
        for parent in parents:
            context = context.setdefault(parent, {})
        if value is None:
            context.pop(key, None)
        else:
            context[key] = value

    return change


def _spec(**fields: object) -> Callable[[Pod], None]:
    return lambda pod: pod["spec"].update(fields)


def _region_path(path: str) -> Callable[[Pod], None]:
    def change(pod: Pod) -> None:
        [volume] = [v for v in pod["spec"]["volumes"] if "hostPath" in v]
        volume["hostPath"]["path"] = path

    return change


def _privileged(pod: Pod) -> None:
    # the API refuses privileged with allowPrivilegeEscalation false
    _context(pod).update(privileged=True, allowPrivilegeEscalation=True)


def _host_port(pod: Pod) -> None:
    _container(pod)["ports"][0]["hostPort"] = 8000


def _nfs(pod: Pod) -> None:
    pod["spec"]["volumes"].append({"name": "shared", "nfs": {"server": "nfs", "path": "/"}})


def _sysctl(pod: Pod) -> None:
    pod["spec"]["securityContext"]["sysctls"] = [{"name": "kernel.msgmax", "value": "65536"}]


def _unconfined_apparmor(pod: Pod) -> None:
    key = "container.apparmor.security.beta.kubernetes.io/vllm"
    pod["metadata"].setdefault("annotations", {})[key] = "unconfined"


def _all_host_process(pod: Pod) -> None:
    # the API wants hostNetwork and every container a host process with it
    pod["spec"]["hostNetwork"] = True
    pod["spec"]["securityContext"]["windowsOptions"] = {"hostProcess": True}


# what the escape does -> (the change to the serving pod, what the refusal must say)
ESCAPES: dict[str, tuple[Callable[[Pod], None], str]] = {
    "container runAsUser 0": (
        _set("runAsUser", 0), "runAsUser 0 (root) is not allowed: vllm"),
    "container runAsNonRoot false": (
        _set("runAsNonRoot", False), "runAsNonRoot must be true"),
    "init container runAsUser 0": (
        _set("runAsUser", 0, "wait-for-region"),
        "runAsUser 0 (root) is not allowed: wait-for-region"),
    "pod runAsUser 0": (_set("pod.runAsUser", 0), "runAsUser 0 (root) is not allowed: pod"),
    "no runAsNonRoot anywhere": (
        _set("pod.runAsNonRoot", None), "every container's: vllm, wait-for-region"),
    "privileged": (_privileged, "privileged containers are not allowed: vllm"),
    "added capability": (
        _set("capabilities.add", ["SYS_ADMIN"]), "add none but NET_BIND_SERVICE: vllm"),
    "capabilities kept": (
        _set("capabilities.drop", None), "must drop ALL capabilities"),
    "init container keeps capabilities": (
        _set("capabilities", None, "wait-for-region"),
        "add none but NET_BIND_SERVICE: wait-for-region"),
    "setuid binaries (allowPrivilegeEscalation true)": (
        _set("allowPrivilegeEscalation", True), "allowPrivilegeEscalation: false: vllm"),
    "allowPrivilegeEscalation left unset": (
        _set("allowPrivilegeEscalation", None), "allowPrivilegeEscalation: false: vllm"),
    "hostPID": (_spec(hostPID=True), "host namespaces are not allowed: hostPID"),
    "hostIPC": (_spec(hostIPC=True), "host namespaces are not allowed: hostIPC"),
    "hostNetwork": (_spec(hostNetwork=True), "host namespaces are not allowed: hostNetwork"),
    "Windows host process": (_all_host_process, "Windows host processes are not allowed: pod"),
    "hostPort": (_host_port, "hostPort is not allowed: vllm"),
    "hostPath of the node's root": (_region_path("/"), ONLY_REGION_DIRECTORIES),
    "hostPath of the whole region root": (
        _region_path("/dev/shm/kvshm"), ONLY_REGION_DIRECTORIES),
    "hostPath of another tenant's region": (
        _region_path("/dev/shm/kvshm/other/llama-70b-kv"), ONLY_REGION_DIRECTORIES),
    "hostPath of a namespace whose name starts with the tenant's": (
        _region_path(f"/dev/shm/kvshm/{TENANT}-b/llama-70b-kv"),
        f"{ONLY_REGION_DIRECTORIES}, /dev/shm/kvshm/{TENANT}/<region name>, and nothing inside"),
    "hostPath of the namespace's own directory": (
        _region_path(f"/dev/shm/kvshm/{TENANT}"), ONLY_REGION_DIRECTORIES),
    "hostPath of the namespace's own directory, with a slash": (
        _region_path(f"/dev/shm/kvshm/{TENANT}/"), ONLY_REGION_DIRECTORIES),
    "hostPath of a region file": (
        _region_path(f"{REGION_DIRECTORY}/vllm_offload_llama-70b-kv.mmap"),
        f"{ONLY_REGION_DIRECTORIES}, /dev/shm/kvshm/{TENANT}/<region name>, and nothing inside"
        " one (its tenant can make any entry there a symlink, which the kubelet would follow"
        " on the host): kv-region"),
    "hostPath of a symlink the tenant planted in its region directory": (
        _region_path(f"{REGION_DIRECTORY}/escape"), ONLY_REGION_DIRECTORIES),
    "hostPath of a directory below a region directory": (
        _region_path(f"{REGION_DIRECTORY}/sub/dir"), ONLY_REGION_DIRECTORIES),
    "an NFS volume": (_nfs, "volumes of these types only"),
    "seccomp Unconfined": (
        _set("seccompProfile", {"type": "Unconfined"}), "seccomp profile must be"),
    "no seccomp profile": (
        _set("pod.seccompProfile", None), "every container's: vllm, wait-for-region"),
    "SELinux spc_t": (
        _set("seLinuxOptions", {"type": "spc_t"}), "seLinuxOptions may set only type"),
    "SELinux user": (
        _set("pod.seLinuxOptions", {"user": "system_u"}), "seLinuxOptions may set only type"),
    "unsafe sysctl": (_sysctl, "these sysctls are not allowed: kernel.msgmax"),
    "AppArmor unconfined": (_unconfined_apparmor, "AppArmor profile must be"),
}  # fmt: skip


def admit(node: Node, pod: Pod) -> str | None:
    """None where the API server admits the pod (a server-side dry run), else its refusal."""
    with node.api_client() as client:
        try:
            kubernetes.client.CoreV1Api(client).create_namespaced_pod(
                pod["metadata"]["namespace"], pod, dry_run="All"
            )
        except kubernetes.client.ApiException as exc:
            return str(json.loads(exc.body).get("message", exc.body))
    return None


def escaping(name: str, namespace: str = TENANT) -> Pod:
    pod = serving_pod(namespace)
    change, _ = ESCAPES[name]
    change(pod)
    return pod


@pytest.fixture(scope="module")
def tenants(
    node: Node, tmp_path_factory: pytest.TempPathFactory, figures: dict[str, str]
) -> Iterator[Release]:
    """The chart with its default values, the example's namespace, and one that is no tenant's;
    ready once the API server refuses a pod by the policy (its informers take a moment)."""
    release = Release(node, tmp_path_factory.mktemp("helm"))
    started = time.monotonic()
    release.install()
    apply_namespace(node)
    node.kubectl("create", "namespace", OTHER)
    node.kubectl("label", "namespace", OTHER, "pod-security.kubernetes.io/enforce=privileged")
    wait(
        lambda: POLICY in (admit(node, escaping("hostPID")) or ""), 60,
        "the tenant policy in force", node,
    )  # fmt: skip
    # its ServiceAccount "default" comes a moment after the namespace
    wait(lambda: admit(node, serving_pod(OTHER)) is None, 60, f"pods admitted in {OTHER}", node)
    figures["tenant policy: helm install to the policy in force"] = (
        f"{time.monotonic() - started:.1f} s"
    )
    yield release
    node.kubectl("delete", "namespace", TENANT, OTHER, "--wait=false")
    release.uninstall()


def test_helm_renders_the_policy_for_the_api_the_server_has(node: Node, tenants: Release) -> None:
    policy = json.loads(node.kubectl("get", "validatingadmissionpolicy", POLICY, "-o", "json"))
    assert policy["apiVersion"] == "admissionregistration.k8s.io/v1beta1"
    binding = json.loads(
        node.kubectl("get", "validatingadmissionpolicybinding", POLICY, "-o", "json")
    )
    assert binding["spec"]["validationActions"] == ["Deny"]


def written_out(policy: dict[str, Any], name: str) -> dict[str, Any]:
    """The policy with each variable written out where it is read, and the containers of every
    kind read as spec.containers (their securityContext, ports and name are the same fields):
    1.28's type checker declares no variables, and types a list joined from the containers,
    init and ephemeral containers as no list at all, so it would say nothing of a field
    misspelt there."""
    spec = copy.deepcopy(policy["spec"])
    written = {"containers": "object.spec.containers"}

    def write_out(expression: str) -> str:
        return re.sub(r"variables\.(\w+)", lambda m: f"({written[m[1]]})", expression)

    for variable in spec.pop("variables"):
        written.setdefault(variable["name"], write_out(variable["expression"]))
    for validation in spec["validations"]:
        for key in ("expression", "messageExpression"):
            validation[key] = write_out(validation[key])
    return {
        "apiVersion": policy["apiVersion"], "kind": policy["kind"],
        "metadata": {"name": name}, "spec": spec,
    }  # fmt: skip


def test_every_field_the_policy_reads_is_a_pod_field(node: Node, tenants: Release) -> None:
    """A misspelt field is a check that is never true: a hole no refusal shows. The controller
    manager type-checks a policy against the Pod schema; this one, written out, is bound to
    nothing, so it changes no admission."""
    policy = json.loads(node.kubectl("get", "validatingadmissionpolicy", POLICY, "-o", "json"))
    check = f"{POLICY}-fields"
    apply_manifest(node, json.dumps(written_out(policy, check)))
    try:

        def type_checked() -> dict[str, Any] | None:
            found = json.loads(
                node.kubectl("get", "validatingadmissionpolicy", check, "-o", "json")
            )
            status = found.get("status") or {}
            if status.get("observedGeneration") != found["metadata"]["generation"]:
                return None
            return {"warnings": status.get("typeChecking", {}).get("expressionWarnings", [])}

        checked = wait(type_checked, 60, "the written-out policy type-checked", node)
        assert checked["warnings"] == []
    finally:
        node.kubectl("delete", "validatingadmissionpolicy", check)


@pytest.mark.parametrize("example", SERVING_EXAMPLES)
def test_every_example_serving_pod_is_admitted(node: Node, tenants: Release, example: str) -> None:
    assert admit(node, serving_pod(example=example)) is None


@pytest.mark.parametrize("name", ESCAPES)
def test_each_escape_is_refused_by_the_rule_that_names_it(
    node: Node, tenants: Release, name: str
) -> None:
    _, says = ESCAPES[name]
    refusal = admit(node, escaping(name))
    assert refusal is not None, f"{name}: admitted"
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in refusal and says in refusal, refusal


@pytest.mark.parametrize("path", [f"{REGION_DIRECTORY}/", f"/dev/shm/kvshm/{TENANT}/llama.70b-kv"])
def test_a_region_directory_in_every_form_its_name_takes_is_admitted(
    node: Node, tenants: Release, path: str
) -> None:
    pod = serving_pod()
    _region_path(path)(pod)
    assert admit(node, pod) is None


def _cat_pod(namespace: str, host_path: str) -> Pod:
    """A pod keeping the restricted profile that prints the file `secret` of the directory a
    hostPath gives it: its only volume."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "symlink-probe", "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "securityContext": {
                "runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [{
                "name": "cat", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/busybox", "cat", "/mounted/secret"],
                "securityContext": {
                    "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                },
                "volumeMounts": [{"name": "planted", "mountPath": "/mounted"}],
            }],
            "volumes": [{"name": "planted", "hostPath": {"path": host_path, "type": "Directory"}}],
        },
    }  # fmt: skip


@pytest.mark.parametrize("namespace", [TENANT, OTHER])
@pytest.mark.parametrize("path", [f"/dev/shm/kvshm/{TENANT}/../../etc", f"{REGION_DIRECTORY}/.."])
def test_the_api_server_refuses_a_dot_dot_hostpath_before_any_policy(
    node: Node, tenants: Release, namespace: str, path: str
) -> None:
    """Kubernetes 1.28 validates a hostPath itself: no '..' component, in any namespace (the
    policy's pattern has no room for one either: tests/charts/test_tenant_isolation.py)."""
    refusal = admit(node, _cat_pod(namespace, path)) or ""
    assert (
        f"spec.volumes[0].hostPath.path: Invalid value: \"{path}\": must not contain '..'"
        in refusal
    ), refusal
    assert "ValidatingAdmissionPolicy" not in refusal, refusal


def test_the_kubelet_follows_a_symlink_inside_a_hostpath(
    node: Node, tenants: Release, tmp_path: Path
) -> None:
    """Why a hostPath may be a region directory and nothing inside it: where no policy holds
    the pod, a hostPath through a symlink someone planted in a directory they own gives the
    pod the symlink's target, which the kubelet resolved as root on the host."""
    target = tmp_path / "host-only"
    target.mkdir()
    (target / "secret").write_text("read through the symlink\n")
    owned = tmp_path / "tenant-owned"
    owned.mkdir()
    (owned / "escape").symlink_to(target)
    probe = _cat_pod(OTHER, str(owned / "escape"))
    with node.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(OTHER, probe)
    try:
        wait(
            lambda: json.loads(
                node.kubectl("get", "pod", "-n", OTHER, "symlink-probe", "-o", "json")
            )["status"].get("phase") == "Succeeded",
            120, "the probe pod done", node,
        )  # fmt: skip
        assert node.kubectl("logs", "-n", OTHER, "symlink-probe") == "read through the symlink\n"
    finally:
        node.kubectl("delete", "pod", "-n", OTHER, "symlink-probe", "--grace-period=0")
    # the same planted symlink in a tenant's region directory
    refusal = admit(node, _cat_pod(TENANT, f"{REGION_DIRECTORY}/escape")) or ""
    assert f"ValidatingAdmissionPolicy '{POLICY}'" in refusal, refusal
    assert f"{ONLY_REGION_DIRECTORIES}, /dev/shm/kvshm/{TENANT}/<region name>" in refusal


def test_outside_the_tenants_namespaces_the_same_pods_are_admitted(
    node: Node, tenants: Release
) -> None:
    refused = {name: admit(node, escaping(name, OTHER)) for name in ESCAPES}
    # hostPaths are the namespace's own regions only in a tenant's namespace
    assert {name: r for name, r in refused.items() if r} == {}


def test_the_charts_namespace_is_never_bound(node: Node, tenants: Release) -> None:
    """Labelled as a tenant's by mistake, the chart's namespace still admits the agent's pod
    (root, capabilities, the whole region root), which a tenant's namespace refuses."""
    agent = json.loads(
        node.kubectl("get", "daemonset", "-n", NAMESPACE, f"{tenants.name}-agent", "-o", "json")
    )
    template = agent["spec"]["template"]
    # the agent's own ServiceAccount exists in the chart's namespace only
    template["spec"].pop("serviceAccountName")
    template["spec"].pop("serviceAccount", None)
    metadata = {"name": "agent-probe", "labels": template["metadata"]["labels"]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}
    node.kubectl("label", "namespace", NAMESPACE, f"{TENANT_LABEL}=true")
    try:
        pod["metadata"]["namespace"] = TENANT
        assert ONLY_REGION_DIRECTORIES in (admit(node, pod) or "")
        pod["metadata"]["namespace"] = NAMESPACE
        assert admit(node, pod) is None
    finally:
        node.kubectl("label", "namespace", NAMESPACE, f"{TENANT_LABEL}-")


@pytest.fixture
def running_pod(node: Node, tenants: Release) -> Iterator[str]:
    """The example serving pod created for real (ephemeral containers join a pod that exists)."""
    pod = serving_pod()
    with node.api_client() as client:
        kubernetes.client.CoreV1Api(client).create_namespaced_pod(TENANT, pod)
    yield pod["metadata"]["name"]
    node.kubectl("delete", "pod", "-n", TENANT, pod["metadata"]["name"], "--grace-period=0")


def _ephemeral(node: Node, pod: str) -> list[str]:
    found = json.loads(node.kubectl("get", "pod", "-n", TENANT, pod, "-o", "json"))
    return [c["name"] for c in found["spec"].get("ephemeralContainers") or ()]


@pytest.mark.parametrize(
    ("profile", "says"),
    [
        ("sysadmin", "privileged containers are not allowed: debug-sysadmin"),
        ("general", "add none but NET_BIND_SERVICE: debug-general"),
        ("netadmin", "add none but NET_BIND_SERVICE: debug-netadmin"),
        ("baseline", "add none but NET_BIND_SERVICE: debug-baseline"),
    ],
)
def test_kubectl_debug_may_not_add_a_privileged_container(
    node: Node, running_pod: str, profile: str, says: str
) -> None:
    with pytest.raises(NodeError, match="denied request") as refused:
        node.kubectl(
            "debug", "-n", TENANT, running_pod, "--image=busybox", f"--profile={profile}",
            "-c", f"debug-{profile}", "--", "true",
        )  # fmt: skip
    assert says in str(refused.value)
    assert _ephemeral(node, running_pod) == []


def test_kubectl_debug_with_the_restricted_profile_is_admitted(
    node: Node, running_pod: str
) -> None:
    node.kubectl(
        "debug", "-n", TENANT, running_pod, "--image=busybox", "--profile=restricted",
        "-c", "debug-restricted", "--", "true",
    )  # fmt: skip
    assert _ephemeral(node, running_pod) == ["debug-restricted"]


def test_the_ephemeral_containers_subresource_is_held_to_the_policy(
    node: Node, running_pod: str
) -> None:
    """Patched through the API as any client may: a root debug container is refused, the same
    container as the policy wants it is added."""
    compliant = {
        "name": "shell", "image": "busybox", "command": ["sleep", "60"],
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    root = {**copy.deepcopy(compliant), "name": "root-shell"}
    root["securityContext"]["runAsUser"] = 0
    with node.api_client() as client:
        api = kubernetes.client.CoreV1Api(client)
        with pytest.raises(kubernetes.client.ApiException) as refused:
            api.patch_namespaced_pod_ephemeralcontainers(
                running_pod, TENANT, {"spec": {"ephemeralContainers": [root]}}
            )
        assert "runAsUser 0 (root) is not allowed: root-shell" in refused.value.body
        api.patch_namespaced_pod_ephemeralcontainers(
            running_pod, TENANT, {"spec": {"ephemeralContainers": [compliant]}}
        )
    assert _ephemeral(node, running_pod) == ["shell"]
