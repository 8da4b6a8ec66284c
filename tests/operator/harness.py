"""A small cluster for the operator's integration tests: a real API server (tests/envtest),
Nodes, real `kvshm-agent` processes on real tmpfs roots, and the operator (in this process or
another).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
from kopf.testing import KopfRunner

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from kvshm.operator.config import ENV_PREFIX, OperatorConfig
from kvshm.operator.memo import OperatorMemo
from kvshm.operator.wiring import register
from tests.envtest.fixtures import CHART_NAMESPACE
from tests.waiting import wait_for

NAMESPACE = "team"
KOPF_RUN_MODULE = "kvshm.operator.kopf_run"

# Fast enough for tests, slow enough for a 2-core CI machine under load.
TEST_CONFIG = OperatorConfig(
    orphan_grace_seconds=4.0,
    agent_silence_seconds=6.0,  # agents heartbeat every 0.5 s; a loaded CI runner is slow
    deletion_poll_seconds=0.5,
    progress_write_seconds=0.5,
    region_resync_seconds=1.0,
    node_sweep_seconds=0.5,
    metrics_port=0,
    watch_server_timeout_seconds=30,
    watch_client_timeout_seconds=40.0,
)


def config_environment(config: OperatorConfig) -> dict[str, str]:
    """KVSHM_OPERATOR_* variables that reproduce config (for kopf run and subprocesses)."""
    from dataclasses import fields

    env = {}
    for item in fields(config):
        value = getattr(config, item.name)
        env[ENV_PREFIX + item.name.upper()] = str(getattr(value, "value", value))
    env[ENV_PREFIX + "PEERING_MODE"] = "standalone"
    return env


class Cluster:
    """Synchronous conveniences over the API server (as the admin), for test
    bodies: regions are created in `namespace`; `client` is closed by close()."""

    def __init__(
        self, client: kubernetes.client.ApiClient, kubeconfig: Path, namespace: str = NAMESPACE
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.client = client
        self.core = kubernetes.client.CoreV1Api(self.client)
        self.custom = kubernetes.client.CustomObjectsApi(self.client)

    def close(self) -> None:
        self.client.close()

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> None:
        self.core.create_node({"metadata": {"name": name, "labels": dict(labels or {})}})

    def delete_node(self, name: str) -> None:
        self.core.delete_node(name)

    def create_region(self, name: str, **spec: Any) -> dict[str, Any]:
        body = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "OffloadRegion",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 65536}, **spec},
        }
        result: dict[str, Any] = self.custom.create_namespaced_custom_object(  # type: ignore[assignment]
            GROUP, VERSION, self.namespace, REGION_PLURAL, body
        )
        return result

    def region(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.custom.get_namespaced_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, self.namespace, REGION_PLURAL, name
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def status(self, name: str) -> dict[str, Any]:
        return (self.region(name) or {}).get("status") or {}

    def delete_region(self, name: str) -> None:
        self.custom.delete_namespaced_custom_object(
            GROUP, VERSION, self.namespace, REGION_PLURAL, name
        )

    def offload_node(self, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self.custom.get_cluster_custom_object(  # type: ignore[assignment]
                GROUP, VERSION, NODE_PLURAL, name
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def events(self, name: str) -> list[dict[str, Any]]:
        """Events about an object of this name, newest last, as (reason, message) dicts."""
        found = []
        # cluster-scoped objects' Events: the agent posts to `default`, kopf to its own
        # namespace (the chart's, as in a pod)
        for namespace in (self.namespace, "default", CHART_NAMESPACE):
            for event in self.core.list_namespaced_event(namespace).items:
                if event.involved_object.name == name:
                    found.append({"reason": event.reason, "message": event.message})
        return found

    def wait_events(self, name: str, *reasons: str, timeout: float = 10) -> list[dict[str, Any]]:
        """The object's Events once every one of `reasons` is among them. kopf posts Events
        from a queue of its own, so one may follow the state change it tells of by a moment."""
        wait_for(
            lambda: set(reasons) <= {event["reason"] for event in self.events(name)},
            timeout,
            f"{', '.join(reasons)} Events about {name}",
        )
        return self.events(name)

    def phase(self, name: str) -> str | None:
        return self.status(name).get("phase")

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for item in self.status(name).get("conditions") or ():
            if item.get("type") == kind:
                return dict(item)
        return {}

    def wait_phase(self, name: str, phase: str, timeout: float = 30.0) -> dict[str, Any]:
        return wait_for(
            lambda: self.status(name) if self.phase(name) == phase else None,
            timeout,
            f"region {name} to be {phase} (status: {self.status(name)})",
        )

    def wait_gone(self, name: str, timeout: float = 30.0) -> None:
        wait_for(lambda: self.region(name) is None, timeout, f"region {name} to be deleted")


class Agent:
    """A real kvshm-agent process for one (fake) node, rooted on a real tmpfs directory."""

    def __init__(self, node: str, root: Path, kubeconfig: Path, log_dir: Path, *extra: str) -> None:
        self.node = node
        self.extra = extra  # more kvshm-agent flags
        self.root = root
        self.kubeconfig = kubeconfig
        # a node name may be 253 characters, a file name at most 255 bytes
        short = (
            node
            if len(node) <= 64
            else f"{node[:48]}-{hashlib.sha256(node.encode()).hexdigest()[:12]}"
        )
        self.log = log_dir / f"agent-{short}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Agent:
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "kvshm.agent.cli",
            "--kubeconfig", str(self.kubeconfig),
            "--node-name", self.node,
            "--root", str(self.root),
            "--resync-seconds", "0.5",
            "--drain-grace-seconds", "2",
            "--no-http",
            "--log-level", "debug",
            *self.extra,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        return self

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self.process = None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def files(self) -> list[str]:
        """Region files under this agent's root, relative to it."""
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*.mmap"))


@contextmanager
def operator_in_thread(config: OperatorConfig = TEST_CONFIG) -> Iterator[KopfRunner]:
    """The operator as `kopf run -m kvshm.operator.kopf_run` runs it, through kopf's own CLI and
    test runner (kopf.testing.KopfRunner): config reaches it only as KVSHM_OPERATOR_* variables,
    read when kopf's CLI imports the module into a fresh default registry."""
    env = config_environment(config)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    previous_registry = kopf.get_default_registry()
    kopf.set_default_registry(kopf.OperatorRegistry())
    sys.modules.pop(KOPF_RUN_MODULE, None)  # imported again: registers with this config
    try:
        args = ["run", "--standalone", "--all-namespaces", "-m", KOPF_RUN_MODULE]
        with KopfRunner(args, timeout=60) as runner:
            yield runner
    finally:
        kopf.set_default_registry(previous_registry)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class OperatorProcess:
    """`python -m kvshm.operator` as a separate process: can be killed like a real pod."""

    def __init__(
        self,
        kubeconfig: Path,
        log_dir: Path,
        config: OperatorConfig = TEST_CONFIG,
        args: tuple[str, ...] = ("--liveness", "none"),
    ) -> None:
        self.env = {**os.environ, **config_environment(config), "KUBECONFIG": str(kubeconfig)}
        self.args = args
        self.log = log_dir / "operator.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        command = [sys.executable, "-m", "kvshm.operator", *self.args]
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.process = None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@asynccontextmanager
async def operator_in_loop(
    config: OperatorConfig = TEST_CONFIG,
) -> AsyncIterator[asyncio.Task[None]]:
    """The operator embedded in the caller's event loop (kopf.operator as a task)."""
    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(
            registry=register(kopf.OperatorRegistry(), config),
            memo=OperatorMemo(config=config),
            clusterwide=True,
            standalone=True,
            stop_flag=stop,
        )
    )
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=30)


HOLDER = """
import os, sys, time
from kvshm.region import RegionLayout, SharedOffloadRegion
directory, instance = sys.argv[1], sys.argv[2]
os.makedirs(directory, mode=0o700, exist_ok=True)
region = SharedOffloadRegion(instance, RegionLayout(16, 65536, 1), directory=directory,
                             mode=sys.argv[3], populate=False, unlink_on_cleanup=False)
print("holding", flush=True)
time.sleep(3600)
"""


class Holder:
    """A process that creates or attaches a region file and holds it (kvshm's shared flock),
    as a serving pod does, until it is killed."""

    def __init__(self, directory: Path, instance: str, mode: str = "create_or_attach") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(directory), instance, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        assert line.strip() == "holding", f"holder failed: {line}{self.process.stdout.read()!r}"

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)


def operator_process(
    kubeconfig: Path,
    log_dir: Path,
    request: pytest.FixtureRequest,
    config: OperatorConfig = TEST_CONFIG,
) -> Iterator[OperatorProcess]:
    """The operator as a process, killed after the test; its log printed if the test failed."""
    operator = OperatorProcess(
        kubeconfig, log_dir, config, ("--liveness", "none", "--log-level", "debug")
    ).start()
    yield operator
    operator.kill()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        print(f"----- operator -----\n{operator.output()[-8000:]}")
