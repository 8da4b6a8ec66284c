"""The operator's log lines: which object each is about, and waits shown as waits."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvshm.operator.logs import FORMAT, ObjectNamingFormatter, OnlyFailuresAreErrors

REGION = {"namespace": "team-a", "name": "r1", "kind": "OffloadRegion"}


@pytest.fixture
def lines(request: pytest.FixtureRequest) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger shaped as configure_logging shapes the root's, at the level parametrised."""
    level = getattr(request, "param", logging.INFO)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(ObjectNamingFormatter(FORMAT))
    handler.addFilter(OnlyFailuresAreErrors(level))
    logger = logging.getLogger(f"kvshm-test-{request.node.name}")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    yield logger, out
    logger.handlers.clear()


def test_a_line_about_an_object_names_it(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = lines
    logger.info("Handler 'validate' succeeded.", extra={"k8s_ref": REGION})
    logger.info("Handler 'sweep' succeeded.", extra={"k8s_ref": {"name": "node-a"}})
    logger.info("started")
    text = out.getvalue().splitlines()
    assert text[0].endswith(
        "INFO kvshm-test-test_a_line_about_an_object_names_it: "
        "[team-a/r1] Handler 'validate' succeeded."
    )
    assert text[1].endswith("[node-a] Handler 'sweep' succeeded.")
    assert text[2].endswith(": started")


def test_a_wait_is_shown_at_info_and_a_failure_stays_an_error(
    lines: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = lines
    extra = {"k8s_ref": REGION}
    logger.error("Handler 'release' failed temporarily: waiting for node-01", extra=extra)
    logger.error("Handler 'release' failed temporarily but will time out after 60 seconds: x")
    logger.error("Handler 'release' failed with an exception. Will retry.")
    logger.error("Handler 'validate' failed permanently: spec.placement matches none", extra=extra)
    text = out.getvalue().splitlines()
    assert " INFO " in text[0] and "[team-a/r1] Handler 'release' failed temporarily" in text[0]
    assert " ERROR " in text[1] and " ERROR " in text[2]
    assert " WARNING " in text[3] and "[team-a/r1] Handler 'validate' failed permanently" in text[3]


@pytest.mark.parametrize("lines", [logging.WARNING], indirect=True)
def test_a_wait_is_not_shown_at_warning_level(lines: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = lines
    logger.error("Handler 'validate' failed temporarily: waiting for agents")
    logger.error("Handler 'validate' failed with an exception. Will retry.")
    assert out.getvalue().count("\n") == 1 and "with an exception" in out.getvalue()
