"""rbac.agentNodePolicy: the ValidatingAdmissionPolicy that confines each agent's writes to its own
node's objects, keyed on the node its pod-bound token names. Rendered only where the API server
serves admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy (1.30+), and its CEL run by a
real API server: Kubernetes 1.28 (the one here) serves the same policy as v1beta1 behind the
ValidatingAdmissionPolicy feature gate. Its tokens carry no node name (that is 1.30's
ServiceAccountTokenPodNodeInfo), so the agent's identity and the node-name user extra a 1.30
token gives it are impersonated, through `kubectl proxy`: the real agent runs through it
unchanged, and forged writes are sent through it as a hostile agent would."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from tests.agent.builders import MIB, manifest
from tests.agent.cluster import running_agent
from tests.charts.tools import CHART, run, tool
from tests.envtest.chart import (
    RELEASE,
    apply_crds,
    ensure_namespace,
    install_rbac,
    load_documents,
)
from tests.envtest.server import EnvTest, MissingAssetsError, start_envtest
from tests.waiting import wait_for

NAMESPACE = "kvshm-system"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
POLICY_API = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
SERVED = ("--kube-version", "1.30.0", "--api-versions", POLICY_API)
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
# 1.28 serves the same API as v1beta1, off by default
BETA_POLICIES = (
    "--feature-gates=ValidatingAdmissionPolicy=true",
    "--runtime-config=admissionregistration.k8s.io/v1beta1=true",
)
AGENT = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-agent"
OPERATOR = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-operator"


def policy_objects(*args: str) -> list[dict[str, Any]]:
    result = run(tool("helm"), "template", RELEASE, str(CHART), "-n", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return [  # the agent's: the tenants' policy renders beside it where the API is served
        o
        for o in load_documents(result.stdout)
        if o["kind"] in POLICY_KINDS
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "agent"
    ]


@pytest.mark.parametrize(
    ("args", "rendered"),
    [
        (SERVED, True),
        (("--kube-version", "1.30.0"), False),  # a 1.30 server without the API
        (("--kube-version", "1.29.4", "--api-versions", POLICY_API), False),
        (("--kube-version", "1.28.7"), False),
        ((*SERVED, "--set", "rbac.agentNodePolicy=false"), False),
    ],
    ids=["1.30", "1.30-without-api", "1.29", "1.28", "turned-off"],
)
def test_rendered_only_where_the_api_server_serves_it(
    args: tuple[str, ...], rendered: bool
) -> None:
    kinds = sorted(o["kind"] for o in policy_objects(*args))
    assert kinds == (sorted(POLICY_KINDS) if rendered else [])


def test_the_policy_keys_on_the_node_claim_of_the_agents_own_account() -> None:
    objects = policy_objects(*SERVED, "--set", "agent.serviceAccount.name=node-agent")
    policy = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicy")
    binding = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    assert policy["spec"]["failurePolicy"] == "Fail"
    [condition] = policy["spec"]["matchConditions"]
    assert condition["expression"] == (
        f'request.userInfo.username == "system:serviceaccount:{NAMESPACE}:node-agent"'
    )
    node = next(v for v in policy["spec"]["variables"] if v["name"] == "node")
    assert f"request.userInfo.extra['{NODE_CLAIM}']" in node["expression"]
    # every status field of the CRD but the nodes map is the operator's: compared, unchanged
    crd = yaml.safe_load((CHART / "crds" / "offloadregions.kvshm.dev.yaml").read_text())
    fields = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    region_rule = next(
        v["expression"]
        for v in policy["spec"]["validations"]
        if "'offloadregions'" in v["expression"]
    )
    for field in fields["properties"]:
        assert f"object.status.{field}" in region_rule, field


# -- the policy in a real API server ------------------------------------------------------------


@pytest.fixture(scope="module")
def policy_server() -> Iterator[EnvTest]:
    """An API server of its own with v1beta1 policies, the CRDs, the chart's RBAC, two Nodes,
    and the chart's policy and binding as rendered for 1.30, served as v1beta1."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(start_envtest(apiserver_args=BETA_POLICIES))
        except MissingAssetsError as exc:
            pytest.fail(str(exc), pytrace=False)
        with server.api_client() as admin:
            apply_crds(admin)
            install_rbac(admin, NAMESPACE)
            core = kubernetes.client.CoreV1Api(admin)
            for node in ("gpu-1", "gpu-2"):
                core.create_node({"metadata": {"name": node}})
            objects = policy_objects(*SERVED)
            assert objects, "the chart renders no policy for a 1.30 API server"
            dynamic = kubernetes.dynamic.DynamicClient(admin)
            for manifest_ in objects:
                beta = {**manifest_, "apiVersion": "admissionregistration.k8s.io/v1beta1"}
                dynamic.resources.get(api_version=beta["apiVersion"], kind=beta["kind"]).create(
                    body=beta
                )
        yield server


@contextlib.contextmanager
def impersonating(server: EnvTest, tmp_path: Path, user: str, node: str | None) -> Iterator[Path]:
    """A kubeconfig of `kubectl proxy` that sends every request as `user` (a ServiceAccount)
    with the node-name extra of a 1.30 pod-bound token (none when node is None)."""
    config = server.kubeconfig()
    namespace = user.split(":")[2]
    identity: dict[str, Any] = {
        "as": user,
        "as-groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                      "system:authenticated"],
    }  # fmt: skip
    if node is not None:
        identity["as-user-extra"] = {NODE_CLAIM: [node]}
    config["users"][0]["user"].update(identity)  # type: ignore[index]
    admin_as = tmp_path / f"as-{node}.kubeconfig"
    admin_as.write_text(yaml.safe_dump(config))
    proxy = subprocess.Popen(
        [tool("kubectl"), "proxy", "--port=0", "--kubeconfig", str(admin_as)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proxy.stdout is not None
        served = re.search(r"Starting to serve on 127\.0\.0\.1:(\d+)", proxy.stdout.readline())
        assert served, "kubectl proxy did not start"
        through = tmp_path / f"through-{node}.kubeconfig"
        through.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "proxy", "cluster": {
                        "server": f"http://127.0.0.1:{served.group(1)}"}}],
                    "users": [{"name": "proxied", "user": {}}],
                    "contexts": [{"name": "proxy", "context": {
                        "cluster": "proxy", "user": "proxied", "namespace": "default"}}],
                    "current-context": "proxy",
                }
            )
        )  # fmt: skip
        yield through
    finally:
        proxy.terminate()
        proxy.wait(10)


def custom_api(kubeconfig: Path) -> kubernetes.client.CustomObjectsApi:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(str(kubeconfig), client_configuration=configuration)
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))


def refusal(write: Any) -> str:
    """The API server's message refusing the write (fails the test if it was admitted)."""
    with pytest.raises(kubernetes.client.ApiException) as refused:
        write()
    assert refused.value.status == 403, refused.value.body
    return str(refused.value.body)


def test_the_agent_does_all_its_work_on_its_own_nodes_objects(
    policy_server: EnvTest, tmp_path: Path, shm_dir: Path
) -> None:
    """The real agent of gpu-1, through the policy: its OffloadNode, its region's report and
    its Events are all admitted."""
    namespace = "agent-work"
    with policy_server.api_client() as admin:
        ensure_namespace(admin, namespace)
        custom = kubernetes.client.CustomObjectsApi(admin)
        body = manifest("llm", namespace, blocks=4, page=MIB, workers=1, lock=False)
        body["metadata"].pop("uid")
        body["spec"]["placement"] = {"nodeNames": ["gpu-1"]}
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, REGION_PLURAL, body)
        with (
            impersonating(policy_server, tmp_path, AGENT, "gpu-1") as kubeconfig,
            running_agent(kubeconfig, "gpu-1", shm_dir / "root"),
        ):

            def report() -> dict[str, Any]:
                region = custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, REGION_PLURAL, "llm"
                )
                nodes: dict[str, Any] = (region.get("status") or {}).get("nodes") or {}  # type: ignore[union-attr]
                return nodes.get("gpu-1") or {}

            wait_for(lambda: report().get("phase") == "Ready", timeout=60, what="Ready on gpu-1")
            offload_node = custom.get_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, "gpu-1")
            assert offload_node["status"]["heartbeat"]  # type: ignore[index]
            events = kubernetes.client.CoreV1Api(admin).list_namespaced_event(namespace).items
            reasons = {e.reason for e in events if e.reporting_instance == "gpu-1"}
            assert "Ready" in reasons, reasons


def test_writes_to_another_nodes_objects_are_refused(
    policy_server: EnvTest, tmp_path: Path
) -> None:
    namespace = "forged"
    with policy_server.api_client() as admin:
        ensure_namespace(admin, namespace)
        custom = kubernetes.client.CustomObjectsApi(admin)
        body = manifest("shared", namespace, blocks=4, page=MIB, workers=1)
        body["metadata"].pop("uid")
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, REGION_PLURAL, body)
        ready = {"phase": "Ready", "path": "/dev/shm/kvshm/forged/shared/vllm_offload_shared.mmap"}
        custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, REGION_PLURAL, "shared",
            {"status": {"phase": "Provisioning", "nodes": {"gpu-2": ready}}},
        )  # fmt: skip
        custom.create_cluster_custom_object(
            GROUP, VERSION, NODE_PLURAL, {"apiVersion": f"{GROUP}/{VERSION}",
                                           "kind": "OffloadNode", "metadata": {"name": "gpu-2"}}
        )  # fmt: skip

    def patch_region(
        api: kubernetes.client.CustomObjectsApi, status: dict[str, Any], **options: str
    ) -> Any:
        return lambda: api.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, REGION_PLURAL, "shared", {"status": status}, **options
        )

    with impersonating(policy_server, tmp_path, AGENT, "gpu-1") as as_gpu_1:
        agent = custom_api(as_gpu_1)
        removed = {"phase": "Removed", "message": "forged"}
        # the server loads a new policy within seconds: asked without effect (dry run) until then
        wait_for(
            lambda: "may change only status.nodes.gpu-1" in _refused_or_empty(
                patch_region(agent, {"nodes": {"gpu-2": removed}}, dry_run="All")
            ),
            timeout=30,
            what="the policy in force",
        )  # fmt: skip
        # its own entry: admitted
        patch_region(agent, {"nodes": {"gpu-1": {"phase": "Pending"}}})()
        # another node's report: changed, or removed
        assert "not another node's report" in refusal(
            patch_region(agent, {"nodes": {"gpu-2": removed}})
        )
        assert "status.nodes.gpu-1" in refusal(patch_region(agent, {"nodes": {"gpu-2": None}}))
        # the operator's fields, alone or beside its own entry
        refusal(patch_region(agent, {"phase": "Ready"}))
        refusal(patch_region(agent, {"nodes": {"gpu-1": {"phase": "Ready"}}, "nodesReady": 2}))
        # another node's OffloadNode: made, or reported on
        node_2 = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "OffloadNode",
                  "metadata": {"name": "gpu-3"}}  # fmt: skip
        assert "may write only OffloadNode gpu-1, not gpu-3" in refusal(
            lambda: agent.create_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, node_2)
        )
        assert "not gpu-2" in refusal(
            lambda: agent.patch_cluster_custom_object_status(
                GROUP, VERSION, NODE_PLURAL, "gpu-2", {"status": {"freeBytes": 1}}
            )
        )
        # an Event reported from another node
        core = kubernetes.client.CoreV1Api(agent.api_client)
        event = {
            "metadata": {"generateName": "shared."},
            "involvedObject": {"kind": "OffloadRegion", "namespace": namespace, "name": "shared"},
            "reason": "Ready", "message": "forged", "type": "Normal",
            "source": {"component": "kvshm-agent", "host": "gpu-2"},
            "reportingComponent": "kvshm.dev/agent", "reportingInstance": "gpu-2",
        }  # fmt: skip
        assert "only Events reported from gpu-1" in refusal(
            lambda: core.create_namespaced_event(namespace, event)
        )
        own = {**event, "source": {"component": "kvshm-agent", "host": "gpu-1"},
               "reportingInstance": "gpu-1"}  # fmt: skip
        core.create_namespaced_event(namespace, own)

    with impersonating(policy_server, tmp_path, AGENT, None) as no_claim:
        assert "names no node" in refusal(
            patch_region(custom_api(no_claim), {"nodes": {"gpu-1": {"phase": "Pending"}}})
        )

    # the policy holds the agent's account only: the operator writes the fields it owns
    with impersonating(policy_server, tmp_path, OPERATOR, None) as operator:
        patch_region(custom_api(operator), {"phase": "Ready", "nodesReady": 1})()
    with policy_server.api_client() as admin:
        status = kubernetes.client.CustomObjectsApi(admin).get_namespaced_custom_object(
            GROUP, VERSION, namespace, REGION_PLURAL, "shared"
        )["status"]  # type: ignore[index]
    assert status["nodes"]["gpu-2"] == ready and status["phase"] == "Ready"
    assert status["nodes"]["gpu-1"] == {"phase": "Pending"}


def _refused_or_empty(write: Any) -> str:
    """The refusal's body, or "" when the write was admitted."""
    try:
        write()
    except kubernetes.client.ApiException as exc:
        return str(exc.body)
    return ""
