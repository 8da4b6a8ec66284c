"""A real kube-apiserver (with etcd) on loopback, started the way controller-runtime's envtest
starts one: binaries from $KUBEBUILDER_ASSETS, random ports, temporary data and certificates.

There is no kubelet, scheduler or controller manager: Pods never run, Namespaces are never
finalised and nothing is garbage-collected; Nodes are plain objects that tests create.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import yaml

from tests.envtest.audit import AuditLog, AuditPolicy, policy_document

REPO = Path(__file__).resolve().parents[2]
ASSETS_VARIABLE = "KUBEBUILDER_ASSETS"
DEFAULT_ASSETS = REPO / ".tools" / "envtest"
BINARIES = ("etcd", "kube-apiserver")
ADMIN_USER = "envtest-admin"
# The audience and issuer a cluster's service-account tokens carry (kubernetes.default.svc).
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
START_TIMEOUT_SECONDS = 60.0
AUDIT_LOG_MAX_MB = 1_000_000


class MissingAssetsError(RuntimeError):
    """The binaries are not where $KUBEBUILDER_ASSETS (or .tools/envtest) says."""


def assets_dir() -> Path:
    """The folder holding kube-apiserver and etcd; MissingAssetsError says how to get them."""
    folder = Path(os.environ.get(ASSETS_VARIABLE) or DEFAULT_ASSETS)
    missing = [name for name in BINARIES if not os.access(folder / name, os.X_OK)]
    if missing:
        raise MissingAssetsError(
            f"{', '.join(missing)} not found in {folder} "
            f"({'$' + ASSETS_VARIABLE if os.environ.get(ASSETS_VARIABLE) else 'the default'}): "
            "run scripts/install-tools.sh (it unpacks kube-apiserver v1.28.7 from "
            "../shared/envtest/kube-apiserver.gz, or $KVSHM_ENVTEST_SOURCE, and etcd from "
            f"Debian's etcd-server package into .tools/envtest), or point ${ASSETS_VARIABLE} at "
            "a folder holding both, e.g. one `setup-envtest use 1.28.x -p path` prints. "
            "See README.md, Testing."
        )
    return folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@dataclass
class EnvTest:
    """A running etcd + kube-apiserver. Use start_envtest() (a context manager)."""

    assets: Path
    workdir: Path
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    port: int = 0
    etcd_port: int = 0
    audit: AuditPolicy | None = None  # None: no audit log (every request costs a log line)
    # more kube-apiserver flags: feature gates and APIs a test needs beyond 1.28's defaults
    apiserver_args: tuple[str, ...] = ()
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        # kube-apiserver's self-signed serving certificate (written to --cert-dir)
        return self.workdir / "certs" / "apiserver.crt"

    @property
    def audit_log(self) -> AuditLog:
        """The server's audit log (empty unless started with an `audit` policy)."""
        return AuditLog(self.workdir / "audit.log")

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- clients ---------------------------------------------------------------------------

    def configuration(self, token: str | None = None) -> kubernetes.client.Configuration:
        """A client configuration as `token` (default: the admin, in system:masters)."""
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token or self.admin_token}"}
        return configuration

    def api_client(self, token: str | None = None) -> kubernetes.client.ApiClient:
        return kubernetes.client.ApiClient(self.configuration(token))

    def kubeconfig(self, token: str | None = None, namespace: str = "default") -> dict[str, object]:
        ca = base64.b64encode(self.ca_file.read_bytes()).decode()
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "envtest",
                    "cluster": {"server": self.url, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": "user", "user": {"token": token or self.admin_token}}],
            "contexts": [
                {
                    "name": "envtest",
                    "context": {"cluster": "envtest", "user": "user", "namespace": namespace},
                }
            ],
            "current-context": "envtest",
        }

    def write_kubeconfig(
        self, path: Path, token: str | None = None, namespace: str = "default"
    ) -> Path:
        """A kubeconfig file for `token` (default: the admin); for processes and kubectl/helm."""
        path.write_text(yaml.safe_dump(self.kubeconfig(token, namespace)))
        path.chmod(0o600)
        return path

    # -- processes -------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "ab") as log:
            self._processes[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _make_keys(self) -> None:
        keys = self.workdir / "keys"
        keys.mkdir()
        _openssl("genrsa", "-out", str(keys / "sa.key"), "2048")
        _openssl("rsa", "-in", str(keys / "sa.key"), "-pubout", "-out", str(keys / "sa.pub"))
        (keys / "tokens.csv").write_text(
            f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
        )

    def _start_etcd(self) -> None:
        self.etcd_port = free_port()
        peer = free_port()
        self._spawn(
            "etcd",
            [
                str(self.assets / "etcd"),
                "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                "--log-level", "warn",
            ],
        )  # fmt: skip
        self._wait_http(f"http://127.0.0.1:{self.etcd_port}/health", "etcd", tls=False)

    def start_apiserver(self) -> None:
        """Start (or start again, on the same port and etcd) the API server; wait for /readyz."""
        keys = self.workdir / "keys"
        self.port = self.port or free_port()
        audit = []
        if self.audit is not None:
            policy = self.workdir / "audit-policy.yaml"
            policy.write_text(json.dumps(policy_document(self.audit, ADMIN_USER)))
            audit = [
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log.path}",
                # never rotated (the default is at 100 MB): AuditLog reads it by offsets
                f"--audit-log-maxsize={AUDIT_LOG_MAX_MB}",
            ]
        self._spawn(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={self.workdir / 'certs'}",
                "--authorization-mode=RBAC",
                f"--token-auth-file={keys / 'tokens.csv'}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-account-key-file={keys / 'sa.pub'}",
                f"--service-account-signing-key-file={keys / 'sa.key'}",
                f"--api-audiences={SERVICE_ACCOUNT_ISSUER}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",  # the agent DaemonSet is privileged, as on a cluster
                *audit,
                *self.apiserver_args,
            ],
        )
        self._wait_http(f"{self.url}/readyz", "kube-apiserver", tls=True)

    def stop_apiserver(self) -> None:
        self._stop("kube-apiserver")

    def _stop(self, name: str) -> None:
        process = self._processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)

    def stop(self) -> None:
        self._stop("kube-apiserver")
        self._stop("etcd")

    def _wait_http(self, url: str, name: str, *, tls: bool) -> None:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        last = ""
        while time.monotonic() < deadline:
            process = self._processes[name]
            if process.poll() is not None:
                log = self.log(name)[-4000:]
                raise RuntimeError(f"{name} exited ({process.returncode}) while starting:\n{log}")
            try:
                request = urllib.request.Request(url)
                context = None
                if tls:
                    if not self.ca_file.exists():
                        raise OSError("no serving certificate yet")
                    context = ssl.create_default_context(cafile=str(self.ca_file))
                    request.add_header("Authorization", f"Bearer {self.admin_token}")
                with urllib.request.urlopen(request, timeout=5, context=context) as response:
                    if response.status == 200:
                        return
            except (OSError, urllib.error.URLError, ssl.SSLError) as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RuntimeError(
            f"{name} not ready within {START_TIMEOUT_SECONDS}s ({last}):\n{self.log(name)[-4000:]}"
        )


@contextlib.contextmanager
def start_envtest(
    assets: Path | None = None,
    audit: AuditPolicy | None = None,
    apiserver_args: Sequence[str] = (),
) -> Iterator[EnvTest]:
    """etcd and kube-apiserver from `assets` (default: assets_dir()), stopped and removed after;
    with `audit`, the server logs the requests that policy names (EnvTest.audit_log);
    `apiserver_args` are more kube-apiserver flags.

    The data directory is on /dev/shm when it exists: etcd fsyncs every write.
    """
    folder = assets or assets_dir()
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    workdir = Path(tempfile.mkdtemp(prefix="kvshm-envtest-", dir=base))
    server = EnvTest(folder, workdir, audit=audit, apiserver_args=tuple(apiserver_args))
    try:
        server._make_keys()
        server._start_etcd()
        server.start_apiserver()
        yield server
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
