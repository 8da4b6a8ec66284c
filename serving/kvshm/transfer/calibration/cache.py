"""ChoiceCache: a calibration's choices in one JSON file per directory, keyed by host and
layout, in a directory that others may be able to write."""

from __future__ import annotations

import itertools
import json
import logging
import os
import secrets
import socket
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvshm.region.safefile import create_exclusive, describe_file_type, open_checked, open_directory
from kvshm.transfer.calibration.policy import CHOICES
from kvshm.transfer.choice.chooser import BACKEND_NAMES, COPY_ENGINES

log = logging.getLogger(__name__)

CACHE_VERSION = 10  # choices of earlier rules (one way only, one pair, ties to the policy, pair
# ties to DMA over staging, times taken at the CPU speed of the moment, the copy kernel tried
# at any page size or taken within KERNEL_MARGIN), of staging before its page kernel and under
# keys that told layouts apart by their distinct page sizes only expire

CACHE_FILE = "backend-choices.json"
# A cache holds a few hundred bytes a layout: more than this is not one (a symlink to
# /dev/zero, say), and is not read whole.
MAX_CACHE_BYTES = 1024 * 1024
# Pods sharing a node directory may read each other's choices; only the writer may change them.
CACHE_FILE_MODE = 0o644
CACHE_DIR_MODE = 0o755


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/kvshm, else ~/.cache/kvshm (read when a cache is made, not at import)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvshm"


def host_key(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{socket.gethostname()}/cpu"
    from kvshm.transfer.cuda.driver import cuda_driver

    name = torch.cuda.get_device_name(device).replace(" ", "_")
    return f"{socket.gethostname()}/{name}/driver-{cuda_driver().version}"


def layout_key(
    pages: Sequence[int], blocks_per_chunk: int, sm_free: bool = False, one_allocation: bool = False
) -> str:
    """Every tensor's page size in order, runs of equal sizes counted ("2x16384+1x32768B"):
    layouts of the same sizes in another order or number are measured apart. one_allocation:
    the tensors are views of one allocation at an even pitch, which the strided backend and
    its scratch blocks need (workload.one_allocation_pitch)."""
    runs = [f"{len(list(run))}x{page}" for page, run in itertools.groupby(pages)]
    key = f"{'+'.join(runs)}B/bpc{blocks_per_chunk}"
    if one_allocation:
        key += "/one-allocation"
    key += f"/v{CACHE_VERSION}"
    return f"{key}/{COPY_ENGINES}" if sm_free else key


class UnusableCacheError(OSError):
    """Something other than a readable cache file, or a directory, is where the cache goes."""


def _regular_file(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnusableCacheError(f"{path} is {describe_file_type(st.st_mode)}, not a regular file")


class ChoiceCache:
    """{host: {layout: {"store": b, "load": b, "store_beside": b, "load_beside": b}}} in one
    JSON file (policy.choose_backends says what each means). The file is only a cache: an entry
    that does not read as choices among the backends its mode measures is measured again, and a
    directory that cannot be written loses nothing but the next start's measurement.

    The directory may be a node directory that others can write too: the file is opened without
    following a symlink, only if it is a regular file (a FIFO would block the first transfer),
    and read up to MAX_CACHE_BYTES; anything else counts as no cache. The directory itself is
    never entered through a symlink, and the file is replaced whole, never written through."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_cache_dir()
        self.path = self.directory / CACHE_FILE
        self._reported: set[str] = set()

    def _report(self, message: str) -> None:
        """Warn once per cache of each reason (get and put both read the file)."""
        if message not in self._reported:
            self._reported.add(message)
            log.warning(message)

    def _open_directory(self) -> int:
        try:
            return open_directory(str(self.directory), follow_symlinks=False)
        except OSError as exc:
            try:
                mode = os.lstat(self.directory).st_mode
            except OSError:
                raise exc from None  # missing, or not to be looked at: the open's error says so
            if stat.S_ISDIR(mode):
                raise
            raise UnusableCacheError(
                f"{self.directory} is {describe_file_type(mode)}, not a directory; name the "
                f"directory itself in kvshm_cache_dir"
            ) from exc

    def _read(self) -> bytes:
        directory = self._open_directory()
        try:
            fd = open_checked(CACHE_FILE, os.O_RDONLY, str(self.path), directory, _regular_file)
        finally:
            os.close(directory)
        with os.fdopen(fd, "rb") as file:
            text = file.read(MAX_CACHE_BYTES + 1)
        if len(text) > MAX_CACHE_BYTES:
            raise UnusableCacheError(f"{self.path} is larger than {MAX_CACHE_BYTES} bytes")
        return text

    def load(self) -> dict[str, Any]:
        """The file's JSON object as read, unchecked ({} if there is none, or it is not a
        regular file of at most MAX_CACHE_BYTES)."""
        try:
            data = json.loads(self._read())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._report(
                f"kvshm: not using the cached copy backends ({exc}): they are measured again"
            )
            return {}
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def get(
        self, host: str, layout: str, backends: Sequence[str] = BACKEND_NAMES
    ) -> dict[str, str] | None:
        """The entry, if every choice in it is one of `backends` (those its mode measures)."""
        layouts = self.load().get(host)
        entry = layouts.get(layout) if isinstance(layouts, dict) else None
        if not isinstance(entry, dict) or not entry:
            return None
        if any(key not in CHOICES or value not in backends for key, value in entry.items()):
            log.warning(
                "kvshm: ignoring cached copy backends %s for %s in %s: not choices among %s",
                entry,
                layout,
                self.path,
                ", ".join(backends),
            )
            return None
        return entry

    def put(self, host: str, layout: str, choice: dict[str, str]) -> None:
        data = self.load()
        if not isinstance(data.get(host), dict):
            data[host] = {}
        data[host][layout] = choice
        try:
            self.directory.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
            directory = self._open_directory()
            try:
                _replace(directory, CACHE_FILE, json.dumps(data, indent=1).encode())
            finally:
                os.close(directory)
        except OSError as exc:
            log.warning(
                "kvshm: could not keep the measured copy backends in %s (%s): the next start "
                "measures again; set kvshm_cache_dir to a writable directory",
                self.path,
                exc,
            )


def _replace(directory: int, name: str, content: bytes) -> None:
    """Replace `name` in the directory with a new file of `content`, whole: a reader sees the
    old file or the new one, never a torn one, and a symlink at the name is replaced, not
    followed."""
    for _ in range(16):
        temporary = f".{name}.{secrets.token_hex(6)}"
        fd = create_exclusive(directory, temporary, CACHE_FILE_MODE)
        if fd is not None:
            break
    else:
        raise FileExistsError(f"no free temporary name for {name}")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        os.unlink(temporary, dir_fd=directory)
        raise
