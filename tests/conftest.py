"""Test-wide rules: GPU tests skip without CUDA; any other skip fails the run."""

from __future__ import annotations

import pytest

CUDA_SKIP_REASON = "needs a CUDA device"


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason=CUDA_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


_unexpected_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "gpu" not in report.keywords:
        _unexpected_skips.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A skipped non-GPU test means a tool is missing: that is a defect of set-up, not a pass.
    if _unexpected_skips and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _unexpected_skips:
        terminalreporter.section("skipped tests that are not GPU tests (failing the run)")
        for nodeid in _unexpected_skips:
            terminalreporter.write_line(nodeid)
