"""Fixtures of the node tier: one real node per test session (tests/node/README.md).

The node starts only when a test here asks for it; these tests run after every other test of
the session (tests/conftest.py orders them last), so the node's processes never share the
machine with the rest of the suite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node.chart import Release
from tests.node.images import ImageError, build_kvshm_image, build_serving_image
from tests.node.images import prometheus_image as build_prometheus_image
from tests.node.node import Node, NodeError, start_node
from tests.node.tools import MissingNodeToolsError


@pytest.fixture(scope="session")
def node() -> Iterator[Node]:
    with contextlib.ExitStack() as stack:
        try:
            running = stack.enter_context(start_node())
        except (MissingNodeToolsError, NodeError, ImageError) as exc:
            pytest.fail(str(exc), pytrace=False)
        yield running


@pytest.fixture(scope="session")
def kvshm_image(node: Node) -> str:
    """The repository's Dockerfile built as the chart's default image (its appVersion's tag),
    in the node's containerd: what `helm install` with no image values runs."""
    image = build_kvshm_image(Release.default_image())
    node.import_image(image)
    return image


@pytest.fixture(scope="session")
def serving_image(node: Node) -> str:
    """examples/serving/Dockerfile on a CPU stand-in of vLLM 0.33's image."""
    image = build_serving_image()
    node.import_image(image)
    return image


@pytest.fixture
def helm_home(tmp_path: Path) -> Path:
    return tmp_path / "helm"


_FIGURES: dict[str, str] = {}


@pytest.fixture(scope="session")
def figures() -> dict[str, str]:
    """Measurements the node tests report (printed at the end of the run, for the docs)."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FIGURES:
        terminalreporter.section("node tier figures")
        for name, value in _FIGURES.items():
            terminalreporter.write_line(f"{name}: {value}")


@pytest.fixture(scope="session")
def prometheus_image(node: Node) -> str:
    image = build_prometheus_image()
    node.import_image(image)
    return image
