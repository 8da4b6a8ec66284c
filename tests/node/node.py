"""A real single-node Kubernetes v1.28.7 cluster on this machine, for the node tier.

etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd with runc and a
bridge CNI, the kubelet, kube-proxy (iptables) and kube-dns, each a process of this harness,
with the flags tests/node/README.md explains. Nothing is pulled: images reach containerd from
`docker save` (tests/node/images.py). One node at a time on a machine (it takes fixed ports,
an address on lo and iptables rules): a lock file guards it.

    with start_node() as node:
        node.kubectl("get", "nodes")
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import kubernetes
import yaml

from tests.envtest.server import REPO
from tests.node.tools import CNI_DIR, check_tools, kube_binary, program

NODE_NAME = "kvshm-node"
NODE_IP = "10.245.0.1"
POD_CIDR = "10.244.0.0/24"
CLUSTER_CIDR = "10.244.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"
SERVICE_API_IP = "10.0.0.1"
BRIDGE = "kvshm0"
API_PORT = 16443
ETCD_PORT = 12479
ETCD_PEER_PORT = 12480
DNS_HEALTH_PORT = 18081
CLUSTER_DOMAIN = "cluster.local"
PAUSE_IMAGE = "registry.k8s.io/pause:3.9"
STATE = Path(os.environ.get("KVSHM_NODE_STATE", "/var/lib/kvshm-node"))
RUN = Path("/run/kvshm-node")
LOCK = RUN / "node.lock"
# the chart's default regionRoot: the node's agents keep their regions here, on this machine
REGION_ROOT = Path("/dev/shm/kvshm")
START_TIMEOUT = 120.0
# low thresholds: this machine's disk is often busy with other work's files
EVICTION_HARD = {"nodefs.available": "1%", "imagefs.available": "1%", "memory.available": "100Mi"}
READY_TIMEOUT = 180.0
# ValidatingAdmissionPolicy is beta and off by default in Kubernetes 1.28: on here, as a cluster
# administrator turns it on, so the chart's tenant policy renders and applies (the controller
# manager's gate runs its type checking)
ADMISSION_POLICY_GATE = "--feature-gates=ValidatingAdmissionPolicy=true"
ADMISSION_POLICY_API = "--runtime-config=admissionregistration.k8s.io/v1beta1=true"


class NodeError(RuntimeError):
    """The node failed to start or to do what was asked; the message carries the logs' tails."""


def _run(*args: str, check: bool = True, input: bytes | None = None) -> str:
    done = subprocess.run(args, capture_output=True, input=input, check=False)
    if check and done.returncode != 0:
        raise NodeError(
            f"{' '.join(args)} exited {done.returncode}: {done.stderr.decode(errors='replace')}"
        )
    return done.stdout.decode(errors="replace")


def _openssl(*args: str) -> None:
    _run(program("openssl"), *args)


@dataclass
class Node:
    """The running node; start_node() makes one."""

    workdir: Path
    assets: Path
    tokens: dict[str, str] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _cleanups: list[list[str]] = field(default_factory=list)

    # -- paths and clients -------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://{NODE_IP}:{API_PORT}"

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def containerd_socket(self) -> Path:
        return RUN / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return STATE / "kubelet"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    def log(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def logs_tail(self, names: Sequence[str] = (), chars: int = 3000) -> str:
        chosen = names or sorted(self.processes)
        return "\n".join(f"--- {n} ---\n{self.log(n)[-chars:]}" for n in chosen)

    def api_client(self, token: str | None = None) -> kubernetes.client.ApiClient:
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        configuration.ssl_ca_cert = str(self.ca_file)
        configuration.api_key = {"authorization": f"Bearer {token or self.tokens['admin']}"}
        return kubernetes.client.ApiClient(configuration)

    def kubeconfig(self, user: str, namespace: str = "default") -> dict[str, object]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "node",
                    "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)},
                }
            ],
            "users": [{"name": user, "user": {"token": self.tokens[user]}}],
            "contexts": [
                {
                    "name": "node",
                    "context": {"cluster": "node", "user": user, "namespace": namespace},
                }
            ],
            "current-context": "node",
        }

    def write_kubeconfig(self, user: str, path: Path) -> Path:
        path.write_text(yaml.safe_dump(self.kubeconfig(user)))
        path.chmod(0o600)
        return path

    def env(self) -> dict[str, str]:
        """The environment for kubectl and helm as the cluster's admin."""
        return dict(os.environ, KUBECONFIG=str(self.admin_kubeconfig))

    def ctr(self, *args: str, input: bytes | None = None) -> str:
        return _run(
            program("ctr"), "--address", str(self.containerd_socket), "-n", "k8s.io", *args,
            input=input,
        )  # fmt: skip

    # -- processes ---------------------------------------------------------------------------

    def _spawn(self, name: str, command: list[str]) -> None:
        logs = self.workdir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"{name}.log", "ab") as log:
            self.processes[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _alive(self, name: str) -> None:
        process = self.processes[name]
        if process.poll() is not None:
            raise NodeError(
                f"{name} exited ({process.returncode}) while starting:\n{self.log(name)[-4000:]}"
            )

    def _wait(self, name: str, probe: object, what: str, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._alive(name)
            try:
                if probe():  # type: ignore[operator]
                    return
            except Exception as exc:
                last = str(exc)
            time.sleep(0.25)
        raise NodeError(f"{name}: {what} not within {timeout}s ({last}):\n{self.log(name)[-4000:]}")

    def _http_ok(self, url: str, *, token: str | None = None) -> bool:
        request = urllib.request.Request(url)
        context = None
        if url.startswith("https"):
            context = ssl.create_default_context(cafile=str(self.ca_file))
            if token:
                request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=5, context=context) as response:
            return bool(response.status == 200)

    def stop_process(self, name: str, timeout: float = 20) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout)

    # -- set-up ------------------------------------------------------------------------------

    def make_pki(self) -> None:
        pki = self.pki
        pki.mkdir(parents=True)
        _openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
        _openssl(
            "req", "-x509", "-new", "-nodes", "-key", str(pki / "ca.key"), "-days", "2",
            "-subj", "/CN=kvshm-node-ca", "-out", str(self.ca_file),
        )  # fmt: skip
        names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 f"kubernetes.default.svc.{CLUSTER_DOMAIN}", "localhost"]  # fmt: skip
        addresses = [NODE_IP, "127.0.0.1", SERVICE_API_IP]
        (pki / "san.cnf").write_text(
            "subjectAltName="
            + ",".join([*(f"DNS:{n}" for n in names), *(f"IP:{a}" for a in addresses)])
            + "\nextendedKeyUsage=serverAuth\n"
        )
        _openssl("genrsa", "-out", str(pki / "apiserver.key"), "2048")
        _openssl(
            "req", "-new", "-key", str(pki / "apiserver.key"), "-subj", "/CN=kube-apiserver",
            "-out", str(pki / "apiserver.csr"),
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", str(pki / "apiserver.csr"), "-CA", str(self.ca_file),
            "-CAkey", str(pki / "ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(pki / "san.cnf"), "-out", str(pki / "apiserver.crt"),
        )  # fmt: skip
        _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
        _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
        # user -> (name, groups): the admin, and the kubelet as the Node authorizer wants it
        users = {
            "admin": ("kvshm-node-admin", "system:masters"),
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
        }
        lines = []
        for user, (name, groups) in users.items():
            self.tokens[user] = secrets.token_hex(16)
            lines.append(f'{self.tokens[user]},{name},{name},"{groups}"')
        (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
        self.write_kubeconfig("admin", self.admin_kubeconfig)
        self.write_kubeconfig("kubelet", self.workdir / "kubelet.kubeconfig")

    def share_shm(self) -> None:
        """/dev and the mounts below it with shared propagation, as systemd makes every mount on
        a real node: a mount the chart's mount-root makes at the region root then reaches the
        host. (Recursive: this machine stacks two tmpfs mounts at /dev/shm, and the runtime
        checks the lower one.)"""
        propagation = set(_run("findmnt", "-n", "-R", "-o", "PROPAGATION", "/dev").split())
        if propagation == {"private"}:
            _run("mount", "--make-rshared", "/dev")
            self._cleanups.append(["mount", "--make-rprivate", "/dev"])

    def add_network(self) -> None:
        """The node's address on lo (the kubelet refuses 127.x) and forwarding for the bridge."""
        ip = program("ip")
        if f"{NODE_IP}/32" not in _run(ip, "-o", "addr", "show", "dev", "lo"):
            _run(ip, "addr", "add", f"{NODE_IP}/32", "dev", "lo")
            self._cleanups.append([ip, "addr", "del", f"{NODE_IP}/32", "dev", "lo"])
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        # Services between pods on one bridge go through iptables (kube-proxy's rules)
        bridged = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
        if not bridged.exists():
            raise NodeError(f"{bridged} is missing: the kernel needs br_netfilter")
        bridged.write_text("1\n")
        iptables = program("iptables")
        for direction in ("-i", "-o"):
            rule = ["FORWARD", direction, BRIDGE, "-j", "ACCEPT"]
            if subprocess.run([iptables, "-C", *rule], capture_output=True).returncode != 0:
                _run(iptables, "-I", rule[0], "1", *rule[1:])
                self._cleanups.append([iptables, "-D", *rule])

    def start_etcd(self) -> None:
        data = Path("/dev/shm") / f"kvshm-node-etcd-{os.getpid()}"
        self._cleanups.append(["rm", "-rf", str(data)])
        self._spawn(
            "etcd",
            [
                str(self.assets / "etcd"),
                "--data-dir", str(data),
                "--listen-client-urls", f"http://127.0.0.1:{ETCD_PORT}",
                "--advertise-client-urls", f"http://127.0.0.1:{ETCD_PORT}",
                "--listen-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{ETCD_PEER_PORT}",
                "--initial-cluster", f"default=http://127.0.0.1:{ETCD_PEER_PORT}",
                "--log-level", "warn",
            ],
        )  # fmt: skip
        self._wait("etcd", lambda: self._http_ok(f"http://127.0.0.1:{ETCD_PORT}/health"), "health")

    def start_apiserver(self) -> None:
        pki = self.pki
        self._spawn(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
                "--bind-address=0.0.0.0",
                f"--advertise-address={NODE_IP}",
                f"--secure-port={API_PORT}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={self.ca_file}",
                "--authorization-mode=Node,RBAC",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                "--api-audiences=https://kubernetes.default.svc",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                "--kubelet-preferred-address-types=InternalIP",
                ADMISSION_POLICY_GATE,
                ADMISSION_POLICY_API,
                # the audit log counts each component's writes (tests read it)
                f"--audit-log-path={self.workdir / 'logs' / 'audit.log'}",
                f"--audit-policy-file={self._audit_policy()}",
                "--audit-log-maxsize=500",
            ],
        )
        self._wait(
            "kube-apiserver",
            lambda: self._http_ok(f"{self.url}/readyz", token=self.tokens["admin"]),
            "/readyz",
        )

    def _audit_policy(self) -> Path:
        path = self.workdir / "audit-policy.yaml"
        policy = {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [
                {"level": "None", "verbs": ["get", "list", "watch"]},
                {"level": "Metadata"},
            ],
        }
        path.write_text(yaml.safe_dump(policy))
        return path

    def start_control_plane(self) -> None:
        admin = str(self.admin_kubeconfig)
        self._spawn(
            "kube-controller-manager",
            [
                str(kube_binary("kube-controller-manager")),
                f"--kubeconfig={admin}",
                f"--authentication-kubeconfig={admin}",
                f"--authorization-kubeconfig={admin}",
                f"--service-account-private-key-file={self.pki / 'sa.key'}",
                f"--root-ca-file={self.ca_file}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--controllers=*,-nodeipam,-cloud-node-lifecycle",
                ADMISSION_POLICY_GATE,
                "--bind-address=127.0.0.1",
                f"--cluster-cidr={CLUSTER_CIDR}",
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                str(kube_binary("kube-scheduler")),
                f"--kubeconfig={admin}",
                f"--authentication-kubeconfig={admin}",
                f"--authorization-kubeconfig={admin}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
            ],
        )

    def start_containerd(self) -> None:
        root = STATE / "containerd"
        state = RUN / "containerd"
        cni_conf = self.workdir / "cni"
        cni_conf.mkdir()
        conflist = {
            "cniVersion": "0.4.0",
            "name": "kvshm-node",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_CIDR}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(self.workdir / "cni-ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (cni_conf / "10-kvshm-node.conflist").write_text(json.dumps(conflist, indent=2))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{self.containerd_socket}"
[debug]
  address = "{state}/debug.sock"
[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  enable_selinux = false
[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[{cri}.cni]
  bin_dir = "{CNI_DIR}"
  conf_dir = "{cni_conf}"
"""
        path = self.workdir / "containerd.toml"
        path.write_text(config)
        self._spawn("containerd", [program("containerd"), "--config", str(path)])
        self._wait("containerd", lambda: self.ctr("version") and True, "its socket")

    def start_kubelet(self) -> None:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": NODE_IP,
            "port": 10250,
            "readOnlyPort": 0,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "authentication": {
                "anonymous": {"enabled": True},
                "webhook": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "clusterDNS": [NODE_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "podCIDR": POD_CIDR,
            "evictionHard": dict(EVICTION_HARD),
            "imageGCHighThresholdPercent": 100,
            "serializeImagePulls": False,
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        self.kubelet_root.mkdir(parents=True, exist_ok=True)
        self._kubelet_command = [
            str(kube_binary("kubelet")),
            f"--config={path}",
            f"--kubeconfig={self.workdir / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={self.kubelet_root}",
            f"--cert-dir={self.workdir / 'kubelet-pki'}",
            "--v=1",
        ]
        self.restart_kubelet(wait=False)

    def configure_kubelet(self, **changes: object) -> None:
        """Change KubeletConfiguration fields (None removes one) and restart the kubelet, as an
        administrator does; wait until the node is Ready again."""
        path = self.workdir / "kubelet.yaml"
        config = yaml.safe_load(path.read_text())
        for key, value in changes.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        path.write_text(yaml.safe_dump(config))
        self.restart_kubelet()

    def restart_kubelet(self, wait: bool = True) -> None:
        """Start the kubelet (stopping the running one first), as a node's service manager would."""
        self.stop_process("kubelet")
        self._spawn("kubelet", self._kubelet_command)
        if wait:
            self.wait_node_ready()

    def wait_node_ready(self, timeout: float = READY_TIMEOUT) -> None:
        def ready() -> bool:
            with self.api_client() as client:
                node = kubernetes.client.CoreV1Api(client).read_node(NODE_NAME)
            return any(
                c.type == "Ready" and c.status == "True" for c in node.status.conditions or ()
            )

        self._wait("kubelet", ready, f"node {NODE_NAME} Ready", timeout)

    def start_proxy_and_dns(self) -> None:
        admin = str(self.admin_kubeconfig)
        self._spawn(
            "kube-proxy",
            [
                str(kube_binary("kube-proxy")),
                f"--kubeconfig={admin}",
                "--proxy-mode=iptables",
                f"--cluster-cidr={CLUSTER_CIDR}",
                f"--hostname-override={NODE_NAME}",
                "--conntrack-max-per-core=0",
                "--metrics-bind-address=127.0.0.1:10249",
                "--healthz-bind-address=127.0.0.1:10256",
            ],
        )
        self._spawn(
            "kube-dns",
            [
                str(kube_binary("kube-dns")),
                f"--kubecfg-file={admin}",
                f"--dns-bind-address={NODE_IP}",
                "--dns-port=53",
                f"--domain={CLUSTER_DOMAIN}.",
                f"--healthz-port={DNS_HEALTH_PORT}",
            ],
        )
        self._wait(
            "kube-proxy", lambda: self._http_ok("http://127.0.0.1:10256/healthz"), "/healthz"
        )

    # -- helpers for tests ---------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        done = subprocess.run(
            [_tool("kubectl"), *args], input=input, capture_output=True, text=True,
            env=self.env(), timeout=timeout, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise NodeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def import_image(self, image: str) -> None:
        """Move a docker image into the node's containerd (there is no registry to pull from)."""
        from tests.node.images import docker

        saved = docker("save", image, binary=True)
        self.ctr("images", "import", "--no-unpack", "-", input=saved)

    def containers(self) -> list[str]:
        return [line.split()[0] for line in self.ctr("tasks", "ls", "-q").splitlines() if line]

    # -- tear-down -----------------------------------------------------------------------------

    def delete_all_workloads(self, timeout: float = 120) -> None:
        """Every pod gone (their controllers first, or they come back) and no container left."""
        with contextlib.suppress(NodeError):
            for kind in ("daemonsets", "deployments", "replicasets", "statefulsets", "jobs"):
                self.kubectl("delete", kind, "--all", "--all-namespaces", "--wait=false")
            self.kubectl("delete", "pods", "--all", "--all-namespaces", "--grace-period=5")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.containers():
                    return
            except NodeError:
                return
            time.sleep(1)

    def stop(self) -> None:
        if "kubelet" in self.processes and "kube-apiserver" in self.processes:
            self.delete_all_workloads()
        for name in ("kubelet", "kube-proxy", "kube-dns"):
            self.stop_process(name)
        if "containerd" in self.processes:
            with contextlib.suppress(NodeError):
                for task in self.containers():
                    self.ctr("tasks", "kill", "-s", "SIGKILL", task)
            self.stop_process("containerd")
        kill_leftover_shims(self.containerd_socket)
        unmount_under(self.kubelet_root)
        unmount_under(RUN / "containerd")
        unmount_under(REGION_ROOT)  # the chart's mount-root's tmpfs, where a test made one
        # kube-proxy leaves its iptables chains behind when it stops
        subprocess.run([str(kube_binary("kube-proxy")), "--cleanup"], capture_output=True)
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self.stop_process(name)
        for command in reversed(self._cleanups):
            subprocess.run(command, capture_output=True)
        subprocess.run([program("ip"), "link", "del", BRIDGE], capture_output=True)


def _tool(name: str) -> str:
    local = REPO / ".tools" / "bin" / name
    return str(local) if local.exists() else program(name)


def kill_leftover_shims(socket: Path) -> None:
    """containerd's shims outlive containerd and keep their containers running: end them."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            command
            and command[0].endswith(b"containerd-shim-runc-v2")
            and str(socket).encode() in command
        ):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(proc.name), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)


def unmount_under(root: Path) -> None:
    mounts = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        target = line.split()[1].encode().decode("unicode_escape")
        if target == str(root) or target.startswith(str(root) + "/"):
            mounts.append(target)
    for target in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


@contextlib.contextmanager
def node_lock() -> Iterator[None]:
    RUN.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NodeError(
                f"another node runs on this machine ({LOCK} is locked): one at a time"
            ) from None
        yield


@contextlib.contextmanager
def start_node() -> Iterator[Node]:
    """A Ready node with its control plane, proxy and DNS; stopped and cleaned up after."""
    from tests.node.images import docker_daemon, pause_image

    assets = check_tools()
    if REGION_ROOT.exists() and any(REGION_ROOT.iterdir()):
        raise NodeError(
            f"{REGION_ROOT} holds files (an earlier node run or the main job's regions): the "
            "node's agents would adopt them. Stop what uses it and remove it first."
        )
    with node_lock(), docker_daemon():
        kill_leftover_shims(RUN / "containerd" / "containerd.sock")
        unmount_under(STATE / "kubelet")
        shutil.rmtree(STATE / "kubelet", ignore_errors=True)
        workdir = RUN / "current"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        (workdir / "logs").mkdir()
        node = Node(workdir, assets)
        try:
            node.make_pki()
            node.share_shm()
            node.add_network()
            node.start_etcd()
            node.start_apiserver()
            node.start_control_plane()
            node.start_containerd()
            node.import_image(pause_image())
            node.start_kubelet()
            node.wait_node_ready()
            node.start_proxy_and_dns()
            yield node
        finally:
            node.stop()
            shutil.rmtree(REGION_ROOT, ignore_errors=True)
