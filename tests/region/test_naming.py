from __future__ import annotations

import pytest

from kvshm.region import (
    MAX_INSTANCE_ID_LENGTH,
    InvalidInstanceIdError,
    instance_id_from_file_name,
    region_file_name,
)


def test_file_name_is_vllms() -> None:
    assert region_file_name("engine-0") == "vllm_offload_engine-0.mmap"


@pytest.mark.parametrize(
    "good", ["a", "engine_1.2-x", "0d4c6f1e-8b1a-4a3e-9d43-1f0e2c3b4a59", "A" * 128]
)
def test_good_ids(good: str) -> None:
    assert instance_id_from_file_name(region_file_name(good)) == good


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("", "empty"),
        ("../etc", "not allowed"),
        ("a/b", "not allowed"),
        ("a..b", "not allowed"),
        (".hidden", "not allowed"),
        ("-flag", "not allowed"),
        ("sp ace", "not allowed"),
        ("nul\x00", "not allowed"),
        ("ü", "not allowed"),
        ("x" * (MAX_INSTANCE_ID_LENGTH + 1), "at most 128"),
    ],
)
def test_bad_ids_are_refused_with_a_reason(bad: str, message: str) -> None:
    with pytest.raises(InvalidInstanceIdError, match=message):
        region_file_name(bad)


@pytest.mark.parametrize(
    "name", ["vllm_offload_.mmap", "vllm_offload_a..b.mmap", "other.mmap", "vllm_offload_a.mmapx"]
)
def test_non_region_names(name: str) -> None:
    assert instance_id_from_file_name(name) is None
