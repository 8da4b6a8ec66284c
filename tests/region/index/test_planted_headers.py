"""A tenant's index header, fuzzed: whatever bytes it plants with its checks right, reading it
never raises. The agent reads the outcome every pass (read_outcome); the engine reads the whole
header when it starts (RegionIndex.adopt) and starts cold on anything it cannot use."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from tests.region.index.planting import planted_headers, sound_header

from kvshm.region import safefile
from kvshm.region.index.format import HEADER_BYTES, MAX_RECORDS, flat_json_object, parse_header
from kvshm.region.index.reader import read_outcome
from kvshm.region.index.writer import RegionIndex
from kvshm.region.naming import index_file_name

CASES = planted_headers()
RECORDS = 16


@pytest.mark.parametrize("planted", [data for _, data in CASES], ids=[name for name, _ in CASES])
def test_any_planted_header_parses_without_raising(planted: bytes) -> None:
    found = parse_header(planted)
    if found.identity is None:
        assert found.problem
    else:
        assert found.problem is None and 0 < found.records <= MAX_RECORDS
        assert all(isinstance(name, str) and name for name in found.identity)
    outcome = found.outcome
    if outcome is not None:  # what the status takes from it is what the engine writes
        assert outcome.state in ("warm", "cold") and type(outcome.reason) is str
        assert type(outcome.chunks) is int and 0 <= outcome.chunks < 1 << 63
        assert type(outcome.at) is float and math.isfinite(outcome.at)


def test_the_agents_read_and_the_engines_start_survive_every_planted_header(
    shm_dir: Path,
) -> None:
    """Through the real file: the agent's one pread, then an engine adopting it (cold)."""
    path = shm_dir / index_file_name("r1")
    directory = safefile.open_directory(str(shm_dir))
    try:
        for name, planted in CASES:
            path.write_bytes(planted + bytes(RECORDS * 80))
            reading = read_outcome(directory, "r1", str(shm_dir))
            assert reading.present, name
            assert reading.outcome is not None or reading.problem, name
            with RegionIndex.open(str(shm_dir), "r1", RECORDS) as index:
                adoption = index.adopt({"model": "m"})
                if adoption.warm:  # only a header that parsed whole, for this very identity
                    assert parse_header(planted, RECORDS).identity == {"model": "m"}, name
                assert parse_header(bytes(index._mapping[:HEADER_BYTES]), RECORDS).problem is None
            path.unlink()
    finally:
        os.close(directory)


def test_nesting_is_refused_before_json_reads_it() -> None:
    for deep in (b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000):
        with pytest.raises(ValueError, match=r"nested|not a JSON object"):
            flat_json_object(deep)
    # brackets and braces inside strings are text, not nesting
    text = b'{"a":"[{]}\\"","b":1.5,"c":null,"d":true}'
    assert flat_json_object(text) == {"a": '[{]}"', "b": 1.5, "c": None, "d": True}


def test_a_sound_header_still_reads_whole() -> None:
    found = parse_header(sound_header())
    assert found.problem is None and found.identity == {"model": "m"}
    assert found.outcome is not None and found.outcome.chunks == 3
