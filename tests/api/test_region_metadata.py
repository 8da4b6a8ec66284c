"""metadata.generation and metadata.uid: the API server sets them (generation an int64 counted
up from 1, uid a string); a local-mode file may leave them out or write anything, and anything
else than what the server could hold is a SpecError naming the field, never another error."""

from __future__ import annotations

from typing import Any

import pytest

from kvshm.api import SpecError, parse_offload_region
from kvshm.api.offload_region import MAX_GENERATION


def region(**metadata: Any) -> dict[str, Any]:
    return {
        "kind": "OffloadRegion",
        "metadata": {"name": "r1", "namespace": "default", **metadata},
        "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 4096}},
    }


def test_the_servers_values_and_their_absence_are_read() -> None:
    assert parse_offload_region(region()).generation == 0
    assert parse_offload_region(region(generation=None)).generation == 0
    assert parse_offload_region(region(generation=7, uid="u-1")).generation == 7
    assert parse_offload_region(region(generation=MAX_GENERATION)).generation == MAX_GENERATION
    assert parse_offload_region(region(uid="u-1")).uid == "u-1"
    assert parse_offload_region(region(uid=None)).uid == ""


@pytest.mark.parametrize(
    "generation", ["abc", "3", [1], {"a": 1}, -1, MAX_GENERATION + 1, True, 1.5]
)
def test_a_generation_no_server_could_hold_is_a_spec_error(generation: object) -> None:
    with pytest.raises(SpecError, match=r"metadata\.generation must be an integer from 0 to"):
        parse_offload_region(region(generation=generation))


def test_a_uid_that_is_no_string_is_a_spec_error() -> None:
    with pytest.raises(SpecError, match=r"metadata\.uid must be a string"):
        parse_offload_region(region(uid=[1]))


def test_a_huge_refused_value_is_quoted_briefly() -> None:
    with pytest.raises(SpecError) as refused:
        parse_offload_region(region(generation=list(range(100_000))))
    assert len(str(refused.value)) < 300
