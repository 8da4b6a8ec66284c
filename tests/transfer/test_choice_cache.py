"""The calibration's cache file (kvshm.transfer.calibration.ChoiceCache): what a start reads, what
it writes, and under which key. The directory may be a node directory others can write."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvshm.transfer import SingleDirectionOffloadingHandler
from kvshm.transfer.calibration import CHOICES, ChoiceCache, choose
from kvshm.transfer.calibration.cache import CACHE_FILE, MAX_CACHE_BYTES, host_key, layout_key
from tests.source_roots import pythonpath

REPO = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


class Measured(Exception):
    """Raised where the calibration starts measuring: the cache was not used."""


def measuring(
    gpu_to_cpu: bool, backend: str | None, tensors: Sequence[torch.Tensor]
) -> SingleDirectionOffloadingHandler:
    raise Measured


def choose_for(
    tensors: Sequence[torch.Tensor], cache: ChoiceCache, sm_free: bool = False
) -> dict[str, str]:
    """choose() for these KV tensors, 1 block a chunk; Measured unless the cache answers."""
    return choose(measuring, tensors, 64, 1, 1, cache, sm_free=sm_free)


def separate(pages: Sequence[int]) -> list[torch.Tensor]:
    return [torch.zeros((8, page), dtype=torch.int8) for page in pages]


# -- what a start reads -------------------------------------------------------------------

# ChoiceCache in a process of its own, its memory bounded: a read without bound fails there
# with MemoryError, and one that blocks is killed by the timeout, failing the test.
IN_A_CHILD = """
import resource, stat, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from pathlib import Path
from kvshm.transfer.calibration import ChoiceCache
cache = ChoiceCache(Path(sys.argv[1]))
print("got", cache.get("host", "layout"))
cache.put("host", "layout", {"store": "dma"})
print("replaced by a regular file:", stat.S_ISREG(cache.path.lstat().st_mode))
print("got", cache.get("host", "layout"))
"""


@pytest.mark.parametrize("plant", ["fifo", "symlink to /dev/zero"])
def test_a_fifo_or_a_device_at_the_cache_file_counts_as_no_cache(
    tmp_path: Path, plant: str
) -> None:
    """Anyone who can write a shared cache directory could block the first transfer on a FIFO
    (it runs under the worker's lock) or fill the engine's memory from /dev/zero. The
    measured choice then replaces what was there."""
    if plant == "fifo":
        os.mkfifo(tmp_path / CACHE_FILE)
    else:
        (tmp_path / CACHE_FILE).symlink_to("/dev/zero")
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", IN_A_CHILD, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == [
        "got None",
        "replaced by a regular file: True",
        "got {'store': 'dma'}",
    ]
    kind = "a FIFO" if plant == "fifo" else "a symbolic link"
    assert f"{tmp_path / CACHE_FILE} is {kind}, not a regular file" in child.stderr


def test_a_symlink_at_the_cache_file_is_not_followed_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"host": {"layout": {"store": "dma"}}}))
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / CACHE_FILE).symlink_to(elsewhere)
    cache = ChoiceCache(cache_dir)
    with caplog.at_level(logging.WARNING):
        assert cache.get("host", "layout") is None
        assert cache.get("host", "layout") is None
    warnings = [r.getMessage() for r in caplog.records if "is a symbolic link" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "measured again" in warnings[0]


def test_a_cache_file_over_the_bound_counts_as_no_cache(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = ChoiceCache(tmp_path)
    cache.put("host", "layout", {"store": "dma"})
    with cache.path.open("ab") as grown:  # sparse: no disk used
        grown.truncate(MAX_CACHE_BYTES + 1)
    assert cache.get("host", "layout") is None
    assert f"larger than {MAX_CACHE_BYTES} bytes" in caplog.text


def test_a_symlinked_cache_directory_is_neither_read_nor_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A name planted in a shared directory, pointing where this pod may write, must not get
    the cache written there."""
    target = tmp_path / "target"
    target.mkdir()
    (target / CACHE_FILE).write_text(json.dumps({"host": {"layout": {"store": "dma"}}}))
    planted = tmp_path / "kvshm"
    planted.symlink_to(target)
    cache = ChoiceCache(planted)
    assert cache.get("host", "layout") is None
    cache.put("host", "other", {"store": "dma"})
    assert sorted(p.name for p in target.iterdir()) == [CACHE_FILE]
    assert json.loads((target / CACHE_FILE).read_text()) == {"host": {"layout": {"store": "dma"}}}
    assert f"{planted} is a symbolic link, not a directory" in caplog.text


# -- what a start writes ------------------------------------------------------------------


def test_put_replaces_a_symlink_at_the_name_never_writing_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    (cache_dir / CACHE_FILE).symlink_to(victim)
    cache = ChoiceCache(cache_dir)
    cache.put("host", "layout", {"store": "dma"})
    assert victim.read_text() == "untouched"
    assert stat.S_ISREG(os.lstat(cache.path).st_mode)
    assert cache.get("host", "layout") == {"store": "dma"}
    assert sorted(p.name for p in cache_dir.iterdir()) == [CACHE_FILE]  # no temporary left


def test_the_cache_is_writable_by_its_writer_only(tmp_path: Path) -> None:
    """Pods sharing a node directory may read one another's choices, never change them."""
    old = os.umask(0)  # whatever the process's umask
    try:
        ChoiceCache(tmp_path / "kvshm").put("host", "layout", {"store": "dma"})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "kvshm" / CACHE_FILE).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "kvshm").st_mode) == 0o755


def test_the_cache_keeps_other_layouts_and_survives_a_broken_file(tmp_path: Path) -> None:
    cache = ChoiceCache(tmp_path)
    cache.path.write_text("{not json")
    assert cache.get("host", "layout") is None
    cache.put("host", "a", {"store": "dma", "load": "kernel"})
    cache.put("host", "b", {"store": "staged", "load": "dma"})
    assert cache.get("host", "a") == {"store": "dma", "load": "kernel"}
    assert cache.get("other-host", "a") is None


@pytest.mark.parametrize(
    "entry",
    [
        {"store": "warp-drive", "load": "dma"},  # not a backend
        {"store": ["dma"], "load": "dma"},  # not a name
        {"store": "dma", "teleport": "dma"},  # not a choice
        {},
        "dma",
    ],
)
def test_a_cached_entry_that_is_not_choices_among_the_backends_is_measured_again(
    tmp_path: Path, entry: object
) -> None:
    cache = ChoiceCache(tmp_path)
    cache.path.write_text(json.dumps({"host": {"layout": entry}, "other": ["x"]}))
    assert cache.get("host", "layout") is None
    assert cache.get("other", "layout") is None
    cache.put("other", "layout", {"store": "dma"})  # a host entry that is not a dict is replaced
    assert cache.get("other", "layout") == {"store": "dma"}


def test_a_cache_that_cannot_be_written_loses_only_the_next_starts_measurement(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = ChoiceCache(blocker / "kvshm")  # its directory cannot be made
    cache.put("host", "layout", {"store": "dma"})  # no exception: the choice stays in use
    assert cache.get("host", "layout") is None
    assert "set kvshm_cache_dir to a writable directory" in caplog.text
    writable = ChoiceCache(tmp_path)
    writable.put("host", "layout", {"store": "dma"})
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp left
    # written, but the rename refused (a directory in the way): the written copy goes too
    blocked = tmp_path / "blocked"
    (blocked / "backend-choices.json").mkdir(parents=True)
    ChoiceCache(blocked).put("host", "layout", {"store": "dma"})
    assert sorted(p.name for p in blocked.iterdir()) == ["backend-choices.json"]


# -- under which key ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cached", "sm_free", "used"),
    [
        ({"store": "kernel", "load": "staged"}, True, False),  # take the SMs
        ({"store": "strided", "load": "dma"}, True, True),
        ({"store": "strided", "load": "dma"}, False, False),  # never measured but by copy-engines
        ({"store": "kernel", "load": "staged"}, False, True),
    ],
)
def test_a_cached_choice_is_used_only_among_the_backends_its_mode_measures(
    tmp_path: Path, cached: dict[str, str], sm_free: bool, used: bool
) -> None:
    """kvshm_backend: copy-engines must leave the SMs to the model whatever the file says."""
    pages = [4096, 4096]
    cache = ChoiceCache(tmp_path)
    cache.put(host_key(CPU), layout_key(pages, 1, sm_free), cached)
    if used:
        assert choose_for(separate(pages), cache, sm_free) == cached
    else:
        with pytest.raises(Measured):
            choose_for(separate(pages), cache, sm_free)


def test_layouts_of_other_page_sizes_in_order_or_number_are_measured_apart(
    tmp_path: Path,
) -> None:
    measured = [4096, 4096, 8192]
    cache = ChoiceCache(tmp_path)
    cache.put(host_key(CPU), layout_key(measured, 1), dict.fromkeys(CHOICES, "dma"))
    assert choose_for(separate(measured), cache) == dict.fromkeys(CHOICES, "dma")
    for other in ([4096, 8192, 8192], [8192, 4096, 4096], [4096, 8192], [4096] * 2 + [8192] * 2):
        with pytest.raises(Measured):
            choose_for(separate(other), cache)
    assert layout_key([65536] * 32, 1) == "32x65536B/bpc1/v10"
    assert layout_key(measured, 2) == "2x4096+1x8192B/bpc2/v10"


def test_views_of_one_allocation_are_measured_apart_from_separate_tensors(
    tmp_path: Path,
) -> None:
    """Only views of one allocation at an even pitch can be moved by the strided backend (and
    get scratch blocks laid out so)."""
    cache = ChoiceCache(tmp_path)
    pages = [4096] * 3
    cache.put(host_key(CPU), layout_key(pages, 1), dict.fromkeys(CHOICES, "dma"))
    assert choose_for(separate(pages), cache) == dict.fromkeys(CHOICES, "dma")
    one_allocation = list(torch.zeros((3, 8, 4096), dtype=torch.int8))
    with pytest.raises(Measured):
        choose_for(one_allocation, cache)
    assert layout_key(pages, 1, one_allocation=True) == "3x4096B/bpc1/one-allocation/v10"
