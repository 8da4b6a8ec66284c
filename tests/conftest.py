"""Test-wide rules and fixtures.

GPU tests skip without CUDA; any other skip fails the run (a skipped test is a missing tool,
and the test command installs every tool). Region tests use real tmpfs directories.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.huge_pages import fallbacks_since_now

# The real API server's fixtures (envtest, chart_accounts, envtest_namespace, ...:
# tests/envtest/README.md) for every test directory. Only where the dev extra is installed
# (kubernetes): the GPU machine runs tests/region and tests/transfer with its own Python,
# which lacks it.
pytest_plugins = ("tests.envtest.fixtures",) if importlib.util.find_spec("kubernetes") else ()

CUDA_SKIP_REASON = "needs a CUDA device"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # "gpu" tests need CUDA; "no_cuda" tests check what happens without it. Either kind skips
    # on the other kind of machine, and only those skips are allowed.
    skip_marker, skip = (
        ("no_cuda", pytest.mark.skip(reason="needs a machine without CUDA"))
        if cuda_available()
        else ("gpu", pytest.mark.skip(reason=CUDA_SKIP_REASON))
    )
    for item in items:
        if skip_marker in item.keywords:
            item.add_marker(skip)
    # the real node's tests last: its processes then never share the machine with the rest
    node_tier = Path(__file__).parent / "node"
    items.sort(key=lambda item: Path(str(item.fspath)).is_relative_to(node_tier))


_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not ({"gpu", "no_cuda"} & set(report.keywords)):
        _unexpected_skips.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _unexpected_skips and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _unexpected_skips:
        terminalreporter.section("skipped tests that are not GPU tests (failing the run)")
        for nodeid in _unexpected_skips:
            terminalreporter.write_line(nodeid)


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory on the machine's real /dev/shm tmpfs."""
    path = Path(tempfile.mkdtemp(prefix="kvshm-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def mounted_tmpfs(options: str) -> Iterator[Path]:
    """A tmpfs mounted with these options (mode 0755 unless they say) for as long as the
    context lasts."""
    path = Path(tempfile.mkdtemp(prefix="kvshm-tmpfs-"))
    if "mode=" not in options:
        options += ",mode=0755"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        os.rmdir(path)


@pytest.fixture
def small_tmpfs() -> Iterator[Path]:
    """A 64 MiB tmpfs mounted for this test: a real filesystem that really fills up."""
    with mounted_tmpfs("size=64m") as path:
        yield path


@pytest.fixture
def thp_fallbacks() -> Callable[[], int]:
    """The kernel's huge-page fallbacks since this test started (tests/huge_pages.py)."""
    return fallbacks_since_now()


@pytest.fixture
def huge_tmpfs() -> Iterator[Path]:
    """A 64 MiB tmpfs mounted huge=within_size for this test: region files on it get 2 MiB
    pages (whatever /sys/kernel/mm/transparent_hugepage/shmem_enabled says, unless deny)."""
    with mounted_tmpfs("size=64m,huge=within_size") as path:
        yield path
