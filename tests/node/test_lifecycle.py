"""The chart's lifecycle on the real node: `helm upgrade` runs the CRD upgrade Job in kvshm's
own image and rolls the agent with regions kept; `helm rollback` returns to the first values;
then docs/uninstall.md's commands, run as written, leave no region file, finalizer, CRD or
namespace behind."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import yaml

from tests.envtest.server import REPO
from tests.node.chart import Release, component, wait
from tests.node.node import Node
from tests.node.regions import apply_manifest, files_under, node_report, region_phase

UNINSTALL = REPO / "docs" / "uninstall.md"
DEMO = REPO / "examples" / "regions" / "demo.yaml"
REGION_FILE = Path("/dev/shm/kvshm/default/demo/vllm_offload_demo-engine.mmap")


def _agent_args(release: Release) -> list[str]:
    """The running agent's arguments; none while a rollout has more than one agent pod."""
    pods = [
        p
        for p in release.pods()
        if component(p) == "agent" and not p["metadata"].get("deletionTimestamp")
    ]
    if len(pods) != 1:
        return []
    args: list[str] = pods[0]["spec"]["containers"][0]["args"]
    return args


def _uninstall_commands() -> str:
    """The first sh block of docs/uninstall.md: the steps, as a user copies them."""
    match = re.search(r"```sh\n(.*?)```", UNINSTALL.read_text(), re.DOTALL)
    assert match, f"{UNINSTALL} has no sh block"
    return match.group(1)


def test_upgrade_rollback_and_the_documented_uninstall(
    node: Node, kvshm_image: str, helm_home: Path
) -> None:
    release = Release(node, helm_home)
    release.install()
    release.wait_ready()
    apply_manifest(node, DEMO.read_text())
    wait(lambda: region_phase(node, "default", "demo") == "Ready", 120, "demo Ready", node)
    inode = os.lstat(REGION_FILE).st_ino
    assert "--log-level=info" in _agent_args(release)

    release.helm("upgrade", release.name, str(REPO / "charts" / "kvshm"), "-n", release.namespace,
                 "--reuse-values", "--set", "agent.logLevel=debug", "--wait")  # fmt: skip
    # the pre-upgrade hook ran kvshm-apply-crds in the chart's own image, as its own account
    for crd in ("offloadregions.kvshm.dev", "offloadnodes.kvshm.dev"):
        fields = json.loads(node.kubectl("get", "crd", crd, "-o", "json", "--show-managed-fields"))
        managers = {f["manager"] for f in fields["metadata"]["managedFields"]}
        assert "kvshm-crd-upgrade" in managers, managers
    events = json.loads(node.kubectl("get", "events", "-n", release.namespace, "-o", "json"))
    hook_pulls = [
        e["message"]
        for e in events["items"]
        if e["involvedObject"]["name"].startswith("kvshm-crd-upgrade-") and e["reason"] == "Pulled"
    ]
    assert hook_pulls and all(kvshm_image in m for m in hook_pulls), hook_pulls
    wait(lambda: "--log-level=debug" in _agent_args(release), 120, "the agent rolled", node)
    release.wait_ready()
    wait(
        lambda: node_report(node, "default", "demo").get("phase") == "Ready",
        120, "demo Ready under the upgraded agent", node,
    )  # fmt: skip
    assert os.lstat(REGION_FILE).st_ino == inode

    release.helm("rollback", release.name, "1", "-n", release.namespace, "--wait")
    wait(lambda: "--log-level=info" in _agent_args(release), 120, "the agent rolled back", node)
    release.wait_ready()
    history = yaml.safe_load(release.helm("history", release.name, "-n", release.namespace,
                                          "-o", "yaml"))  # fmt: skip
    assert [h["status"] for h in history] == ["superseded", "superseded", "deployed"]
    assert os.lstat(REGION_FILE).st_ino == inode

    # the clean-up, exactly as docs/uninstall.md says it
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", _uninstall_commands()],
        capture_output=True, text=True, timeout=600, check=False,
        env={**node.env(), "PATH": f"{REPO / '.tools' / 'bin'}:{os.environ['PATH']}",
             "HELM_CACHE_HOME": str(helm_home / "cache"),
             "HELM_CONFIG_HOME": str(helm_home / "config"),
             "HELM_DATA_HOME": str(helm_home / "data")},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    crds = node.kubectl("get", "crds", "-o", "name")
    assert "kvshm.dev" not in crds, crds
    assert release.namespace not in node.kubectl("get", "namespaces", "-o", "name")
    assert files_under(Path("/dev/shm/kvshm")) == []
    leftover = [c for c in node.containers() if c]
    assert all("kvshm" not in node.ctr("containers", "info", c) for c in leftover), (
        "a kvshm container is still running"
    )
