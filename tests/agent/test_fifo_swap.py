"""A FIFO swapped in between the type check and the open is never opened.

An unprivileged tenant process swaps, as fast as it can, a fresh regular file and a hard link
of a FIFO at one name, while a second thread of it blocks opening the FIFO for writing: that
open returns only when someone opens the FIFO for reading, so it counts every time the opener
under test opened the FIFO.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvshm.region import UnsafePathError, safefile
from tests.agent.hostile import TENANT_UID, tenant_process, traversable

_SWAPPER = """
import os, sys, threading, time
os.chdir(sys.argv[1])
os.mkfifo("fifo.keep")
opened = 0

def count_readers():
    global opened
    while True:
        fd = os.open("fifo.keep", os.O_WRONLY)  # returns once a reader opened the FIFO
        opened += 1
        os.close(fd)

threading.Thread(target=count_readers, daemon=True).start()
print("swapping", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    os.close(os.open("tmp", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    os.rename("tmp", "target")  # a regular single-link file: passes a type check
    os.link("fifo.keep", "tmp")
    os.rename("tmp", "target")  # now a FIFO at the same name
print("opened", opened, flush=True)
os._exit(0)
"""


def test_a_fifo_swapped_in_is_never_opened(shm_dir: Path) -> None:
    directory = traversable(shm_dir) / "tenant"
    directory.mkdir()
    os.chown(directory, TENANT_UID, TENANT_UID)
    swapper = tenant_process(_SWAPPER, str(directory), "3")
    assert swapper.stdout is not None and swapper.stdout.readline().strip() == "swapping"
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    opened_regular = refused = 0
    deadline = time.monotonic() + 2.5
    try:
        while time.monotonic() < deadline:
            try:
                fd = safefile.open_existing(dir_fd, "target", str(directory / "target"))
            except (UnsafePathError, FileNotFoundError):
                refused += 1
                continue
            opened_regular += 1
            os.close(fd)
    finally:
        os.close(dir_fd)
    last = swapper.stdout.readline().split()
    swapper.wait(10)
    assert last[0] == "opened"
    # the race really ran (both kinds of file were met), and the FIFO was never opened
    assert opened_regular > 100 and refused > 100
    assert int(last[1]) == 0
