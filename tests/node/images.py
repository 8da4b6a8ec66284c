"""The images the node runs, all built on this machine (nothing can be pulled here).

- The base the Dockerfile names (`FROM python:3.11.13-slim-bookworm`): made with debootstrap
  (Debian bookworm, Python 3.11) and tagged with that name in the node tier's own docker.
- The pause image containerd's sandboxes need: busybox-static sleeping.
- kvshm's image: the repository's Dockerfile as shipped, `docker build`.

dockerd runs with its own socket and data root under $KVSHM_NODE_STATE (default
/var/lib/kvshm-node), so built images are reused by later runs on the same machine, and no
other docker on the machine is touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests.envtest.server import REPO
from tests.node.tools import BUSYBOX, program

STATE = Path(os.environ.get("KVSHM_NODE_STATE", "/var/lib/kvshm-node"))
DOCKER_SOCKET = Path("/run/kvshm-node/docker.sock")
DOCKERFILE = REPO / "Dockerfile"
DEBIAN_MIRROR = os.environ.get("KVSHM_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
# this machine's CA bundle: pip inside a build reaches the package index only with it
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
PAUSE = "registry.k8s.io/pause:3.9"
RECIPE_LABEL = "dev.kvshm.node.recipe"


class ImageError(RuntimeError):
    """An image could not be built; the message has the builder's output."""


def docker(*args: str, binary: bool = False, timeout: float = 1800) -> str:
    done = subprocess.run(
        [program("docker"), "-H", f"unix://{DOCKER_SOCKET}", *args],
        capture_output=True, timeout=timeout, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise ImageError(
            f"docker {' '.join(args[:3])}: exited {done.returncode}:\n"
            f"{done.stdout.decode(errors='replace')[-6000:]}{done.stderr.decode(errors='replace')}"
        )
    return done.stdout if binary else done.stdout.decode(errors="replace")  # type: ignore[return-value]


def _docker_answers() -> bool:
    return (
        subprocess.run(
            [program("docker"), "-H", f"unix://{DOCKER_SOCKET}", "version"],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )


@contextlib.contextmanager
def docker_daemon() -> Iterator[None]:
    """dockerd for building (no bridge, no iptables of its own); stopped after if started here."""
    if _docker_answers():
        yield
        return
    DOCKER_SOCKET.parent.mkdir(parents=True, exist_ok=True)
    log = open(DOCKER_SOCKET.parent / "dockerd.log", "ab")  # noqa: SIM115 - open while it runs
    process = subprocess.Popen(
        [
            program("dockerd"),
            "--host", f"unix://{DOCKER_SOCKET}",
            "--data-root", str(STATE / "docker"),
            "--exec-root", str(DOCKER_SOCKET.parent / "docker-exec"),
            "--pidfile", str(DOCKER_SOCKET.parent / "docker.pid"),
            "--bridge=none", "--iptables=false", "--ip-masq=false",
            "--containerd-namespace", "kvshm-docker",
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not _docker_answers():
            if process.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (DOCKER_SOCKET.parent / "dockerd.log").read_text(errors="replace")[-3000:]
                raise ImageError(f"dockerd did not start:\n{tail}")
            time.sleep(0.25)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def _has_image(name: str, recipe: str | None = None) -> bool:
    try:
        label = docker(
            "image", "inspect", "--format", f'{{{{index .Config.Labels "{RECIPE_LABEL}"}}}}', name
        )
    except ImageError:
        return False
    return recipe is None or label.strip() == recipe


def dockerfile_base() -> str:
    """The base image the Dockerfile builds from (its first FROM)."""
    match = re.search(r"^FROM\s+(\S+)", DOCKERFILE.read_text(), re.MULTILINE)
    if match is None:
        raise ImageError(f"{DOCKERFILE} has no FROM line")
    return match.group(1).split("@")[0]


def base_image() -> str:
    """The Dockerfile's base, made with debootstrap when this docker does not have it yet."""
    name = dockerfile_base()
    recipe = hashlib.sha256(
        f"{DEBIAN_MIRROR} {' '.join(BASE_PACKAGES)} {HOST_CA_BUNDLE.read_bytes()!r}".encode()
    ).hexdigest()[:16]
    if _has_image(name, recipe):
        return name
    rootfs = Path(tempfile.mkdtemp(prefix="kvshm-base-", dir=STATE))
    try:
        done = subprocess.run(
            [program("debootstrap"), "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
             "bookworm", str(rootfs), DEBIAN_MIRROR],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ImageError(f"debootstrap failed ({done.returncode}):\n{done.stdout[-4000:]}")
        shutil.copyfile(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        shutil.rmtree(rootfs / "var/cache/apt/archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        done_import = subprocess.run(
            [program("docker"), "-H", f"unix://{DOCKER_SOCKET}", "import",
             "--change", f"LABEL {RECIPE_LABEL}={recipe}",
             "--change", f"ENV PIP_CERT={HOST_CA_BUNDLE}",
             "--change", 'CMD ["python3"]', "-", name],
            stdin=tar.stdout, capture_output=True, check=False,
        )  # fmt: skip
        tar.wait()
        if done_import.returncode != 0:
            raise ImageError(f"docker import: {done_import.stderr.decode(errors='replace')}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return name


def pause_image() -> str:
    """containerd's sandbox image: busybox-static sleeping for good."""
    recipe = hashlib.sha256(BUSYBOX.read_bytes()).hexdigest()[:16]
    if _has_image(PAUSE, recipe):
        return PAUSE
    with tempfile.TemporaryDirectory() as context:
        shutil.copy(BUSYBOX, Path(context) / "busybox")  # with its mode: 0755
        (Path(context) / "Dockerfile").write_text(
            "FROM scratch\n"
            "COPY busybox /bin/busybox\n"
            f"LABEL {RECIPE_LABEL}={recipe}\n"
            'ENTRYPOINT ["/bin/busybox", "sleep", "2147483647"]\n'
        )
        docker("build", "-t", PAUSE, context)
    return PAUSE


def build_kvshm_image(tag: str) -> str:
    """The repository's Dockerfile as shipped, built into `tag` (its base made first)."""
    base_image()
    revision = (
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        or "unknown"
    )
    docker(
        "build", "--network", "host", "-t", tag, "--build-arg", f"REVISION={revision}", str(REPO)
    )
    return tag


VLLM_CPU = "kvshm-node/vllm-cpu:0.33.0"
SERVING = "kvshm-node/vllm-kvshm:0.33.0"
VLLM_CPU_DOCKERFILE = Path(__file__).parent / "vllm_cpu" / "Dockerfile"
VLLM_REQUIREMENTS = REPO / "scripts" / "vllm-requirements.txt"
SERVING_DOCKERFILE = REPO / "examples" / "serving" / "Dockerfile"
TORCH = "torch==2.13.0+cpu"  # the build scripts/setup.sh installs
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def vllm_cpu_image() -> str:
    """The CPU stand-in for vLLM 0.33's image (tests/node/vllm_cpu/Dockerfile), built once."""
    base = base_image()
    recipe = hashlib.sha256(
        VLLM_CPU_DOCKERFILE.read_bytes() + VLLM_REQUIREMENTS.read_bytes() + TORCH.encode()
        + base.encode()
    ).hexdigest()[:16]  # fmt: skip
    if _has_image(VLLM_CPU, recipe):
        return VLLM_CPU
    with tempfile.TemporaryDirectory(dir=STATE) as context:
        wheels = Path(context) / "wheels"
        # a local wheel where pip's find-links have one, else PyTorch's CPU index (setup.sh's way)
        download = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
        for where in (["--no-index"], ["--index-url", TORCH_CPU_INDEX]):
            done = subprocess.run(
                [*download, *where, TORCH], capture_output=True, text=True, check=False
            )
            if done.returncode == 0:
                break
        else:
            raise ImageError(f"pip download {TORCH}: {done.stderr[-3000:]}")
        shutil.copyfile(VLLM_REQUIREMENTS, wheels / "vllm-requirements.txt")
        shutil.copyfile(VLLM_CPU_DOCKERFILE, Path(context) / "Dockerfile")
        docker(
            "build", "--network", "host", "-t", VLLM_CPU, "--build-arg", f"BASE_IMAGE={base}",
            "--label", f"{RECIPE_LABEL}={recipe}", context,
        )  # fmt: skip
    return VLLM_CPU


def build_serving_image() -> str:
    """examples/serving/Dockerfile as shipped, on the CPU stand-in of vLLM's image."""
    docker(
        "build", "--network", "host", "-f", str(SERVING_DOCKERFILE), "-t", SERVING,
        "--build-arg", f"VLLM_IMAGE={vllm_cpu_image()}", str(REPO),
    )  # fmt: skip
    return SERVING


PROMETHEUS = "kvshm-node/prometheus:2.42.0"
PROMETHEUS_BINARY = REPO / ".tools" / "bin" / "prometheus"


def prometheus_image() -> str:
    """Debian's Prometheus (the binary scripts/install-tools.sh unpacks) on the bookworm base:
    the Prometheus the node tier scrapes kvshm with, from a pod, as a cluster's would."""
    base = base_image()
    recipe = hashlib.sha256(PROMETHEUS_BINARY.read_bytes() + base.encode()).hexdigest()[:16]
    if _has_image(PROMETHEUS, recipe):
        return PROMETHEUS
    with tempfile.TemporaryDirectory(dir=STATE) as context:
        shutil.copy(PROMETHEUS_BINARY, Path(context) / "prometheus")
        (Path(context) / "Dockerfile").write_text(
            f"FROM {base}\n"
            "COPY prometheus /usr/local/bin/prometheus\n"
            f"LABEL {RECIPE_LABEL}={recipe}\n"
            "USER 65534:65534\n"
            'ENTRYPOINT ["/usr/local/bin/prometheus"]\n'
        )
        docker("build", "-t", PROMETHEUS, context)
    return PROMETHEUS
