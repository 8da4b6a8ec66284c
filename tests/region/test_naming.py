from __future__ import annotations

import pytest

from kvshm.region import (
    MAX_INSTANCE_ID_LENGTH,
    InvalidInstanceIdError,
    RegionFileName,
    instance_id_from_file_name,
    parse_region_file_name,
    region_file_name,
    segment_file_name,
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


def test_segment_files_are_named_as_vllm_0_33_names_them() -> None:
    assert segment_file_name("e", 0) == "vllm_offload_e.mmap"
    assert segment_file_name("e", 1) == "vllm_offload_e.mmap.1"
    assert segment_file_name("e", 31) == "vllm_offload_e.mmap.31"
    with pytest.raises(ValueError, match=r"segment must be in \[0, 31\]"):
        segment_file_name("e", 32)


@pytest.mark.parametrize(
    ("name", "instance_id", "segment"),
    [
        ("vllm_offload_e.mmap", "e", 0),
        ("vllm_offload_e.mmap.1", "e", 1),
        ("vllm_offload_e.mmap.31", "e", 31),
        # an id may itself contain ".mmap": the name's ending still decides the segment
        ("vllm_offload_a.mmap.mmap", "a.mmap", 0),
        ("vllm_offload_a.mmap.mmap.7", "a.mmap", 7),
        ("vllm_offload_a.mmap.3.mmap", "a.mmap.3", 0),
    ],
)
def test_any_file_of_a_region_is_recognised(name: str, instance_id: str, segment: int) -> None:
    assert parse_region_file_name(name) == RegionFileName(instance_id, segment)
    assert segment_file_name(instance_id, segment) == name
    assert instance_id_from_file_name(name) == (instance_id if segment == 0 else None)


@pytest.mark.parametrize(
    "name",
    [
        "vllm_offload_e.mmap.0",  # vLLM names file 0 without a suffix
        "vllm_offload_e.mmap.01",
        "vllm_offload_e.mmap.32",  # vLLM makes at most 32 files
        "vllm_offload_e.mmap.1x",
        "vllm_offload_e.mmap.",
        "vllm_offload_..mmap.1",
        "vllm_offload_e.mmap.1.tmp",
    ],
)
def test_names_vllm_never_makes_are_not_region_files(name: str) -> None:
    assert parse_region_file_name(name) is None
