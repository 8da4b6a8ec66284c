"""Killing a forked child with SIGKILL at a chosen moment: the crash tests' one way to die."""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def fork_and_kill(
    child: Callable[[], object],
    failure: Path,
    *,
    after: float = 0.0,
    when: Callable[[], bool] | None = None,
    timeout: float = 240.0,
) -> None:
    """Run `child` in a forked process (it never returns into pytest), SIGKILL it `after`
    seconds, or once `when()` holds (checked every 20 ms, at most `timeout` seconds), and reap
    it. A child that raised before the kill fails the caller with its traceback, written to
    `failure`."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException:
            failure.write_text(traceback.format_exc())
        finally:
            os._exit(1)
    try:
        if when is None:
            time.sleep(after)
        else:
            deadline = time.monotonic() + timeout
            while not when() and not failure.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert not failure.exists(), failure.read_text()
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"the child ended by itself (status {status:#x}) before it was killed"
    )
