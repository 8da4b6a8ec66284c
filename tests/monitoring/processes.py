"""Background processes for end-to-end tests: started with their output in a log file, stopped
by their own pid (never by name), and their logs shown when something goes wrong."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests import waiting


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Background:
    """One process, its log, and a bounded stop (SIGTERM, then SIGKILL)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            list(args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def check_running(self) -> None:
        code = self.process.poll()
        assert code is None, f"{self.name} exited with {code}:\n{self.log()[-4000:]}"

    def stop(self, timeout: float = 10) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        self._log.close()


def wait_for(
    what: str, condition: Callable[[], bool], timeout: float, *watched: Background
) -> None:
    """Poll condition until true; fail naming `what` (and any watched process that died)."""

    def probe() -> bool:
        for process in watched:
            process.check_running()
        return condition()

    waiting.wait_for(probe, timeout, what, interval=0.2)


def http_ok(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)
    return False


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        text: str = response.read().decode()
        return text
