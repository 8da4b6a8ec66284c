"""Attacks as a hostile tenant makes them: a real unprivileged process, a real agent, a real tmpfs.

`tenant(code, ...)` runs Python as uid/gid TENANT_UID (never root: it can do only what a serving
pod can do in its own region directory). `RunningAgent` is `kvshm-agent --local` as a separate
process, its output collected by a thread, so a test can wait for lines and watch its threads,
descriptors and memory from /proc.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.agent.builders import local_agent, manifest
from tests.waiting import wait_for

TENANT_UID = 65534  # nobody: no capabilities, no ownership of anything but its region directory
REPO = Path(__file__).resolve().parents[2]
# the tenant's code needs only the standard library, and an interpreter it may execute (the
# test venv's may live under a directory only root can enter)
TENANT_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable


def tenant_manifest(name: str, namespace: str = "tenant", **spec: Any) -> dict[str, Any]:
    """A region whose directory and file belong to the (hostile) tenant uid."""
    access = {"uid": TENANT_UID, "gid": TENANT_UID, "mode": 0o600}
    return manifest(name, namespace, access=access, **spec)


def traversable(directory: Path) -> Path:
    """Let the tenant pass through a test's private temporary directory to what lies below (as
    a node's /dev/shm lets pods reach their mounted region directory)."""
    directory.chmod(0o711)
    return directory


def write_regions(directory: Path, name: str, *documents: dict[str, Any]) -> None:
    (directory / name).write_text(yaml.safe_dump_all(documents))


def tenant(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `code` (python -c) as the unprivileged tenant uid; raise if it fails."""
    done = subprocess.run(
        [TENANT_PYTHON, "-I", "-c", code, *args],
        user=TENANT_UID,
        group=TENANT_UID,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    assert done.returncode == 0, f"tenant process failed: {done.stdout}{done.stderr}"
    return done


def tenant_process(code: str, *args: str) -> subprocess.Popen[str]:
    """A long-running unprivileged tenant process (first stdout line: it is ready)."""
    return subprocess.Popen(
        [TENANT_PYTHON, "-I", "-c", code, *args],
        user=TENANT_UID,
        group=TENANT_UID,
        extra_groups=[],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
    )


def _limits(nofile: int | None) -> Callable[[], None] | None:
    if nofile is None:
        return None

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return apply


class RunningAgent:
    """`kvshm-agent --local REGIONS --root ROOT` running as its own process."""

    def __init__(
        self,
        regions: Path,
        root: Path,
        *extra: str,
        nofile: int | None = None,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.process = subprocess.Popen(
            local_agent(regions, root, *extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="surrogateescape",  # whatever bytes it prints, the test sees them
            cwd=REPO,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec or _limits(nofile),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = ""
        if "--no-http" not in extra:
            banner: str = wait_for(lambda: self.lines[0] if self.lines else None, 30, "banner")
            self.url = banner.split("metrics on ")[1].strip().removesuffix("/metrics")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return "".join(self.lines)

    def saw(self, text: str, timeout: float = 30) -> float:
        """Wait until a line containing text appears; seconds waited."""
        started = time.monotonic()
        wait_for(lambda: any(text in line for line in self.lines), timeout, repr(text))
        return time.monotonic() - started

    def threads(self) -> int:
        return int(_status_field(self.pid, "Threads"))

    def descriptors(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def peak_rss_bytes(self) -> int:
        return int(_status_field(self.pid, "VmHWM").split()[0]) * 1024

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(5)

    def __enter__(self) -> RunningAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _status_field(pid: int, name: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"/proc/{pid}/status has no {name}")
