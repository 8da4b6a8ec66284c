"""Does this kernel give a tmpfs region transparent huge pages, and how fast does it populate?

python bench/populate/hugepage_probe.py --gib 8 [--directory /dev/shm]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from run import fresh_region  # type: ignore[import-not-found]

from kvshm.region import memory
from kvshm.region.populate import Populator

MADV_HUGEPAGE = 14


def meminfo(key: str) -> str:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key):
            return line.split(":")[1].strip()
    return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--directory", default="/dev/shm")
    args = parser.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage")
    for name in ("enabled", "shmem_enabled"):
        path = thp / name
        print(f"{name}: {path.read_text().strip() if path.exists() else 'absent'}")
    directory = tempfile.mkdtemp(prefix="kvshm-bench-", dir=args.directory)
    for threads in (8, 16):
        region = fresh_region(directory, args.gib)
        try:
            memory.madvise(region.address, region.layout.size_bytes, MADV_HUGEPAGE)
            advised = "ok"
        except OSError as exc:
            advised = str(exc)
        started = time.perf_counter()
        Populator(region.address, region.mapped_files(), threads=threads).populate(
            [(0, region.layout.size_bytes)]
        )
        seconds = time.perf_counter() - started
        print(
            f"MADV_HUGEPAGE {advised}; {threads} threads: {seconds:.3f} s, "
            f"{region.layout.size_bytes / seconds / 1e9:.2f} GB/s, "
            f"ShmemHugePages {meminfo('ShmemHugePages')}"
        )
        region.cleanup()
    os.rmdir(directory)


if __name__ == "__main__":
    main()
