"""A tenant's `kvshm_events`: planted, crafted, or left with an old owner. The tenant is an
unprivileged process; the root is a small real tmpfs that really fills."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

from kvshm.agent.drain.notify import CHUNK_BYTES, CHUNKS, EVENTS_RING
from kvshm.ipc import MessageQueue, RingFormatError, RingLayout
from kvshm.ipc.layout import MAGIC, VERSION
from kvshm.ipc.ringfile import RingFile
from tests.agent.hostile import RunningAgent, tenant, tenant_manifest, write_regions

_PLANT = """
import os, sys
path, size, trailer = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
os.unlink(path)  # the tenant owns the directory: it may replace the agent's ring
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, size)  # sparse: costs the tenant nothing
if trailer:
    os.pwrite(fd, trailer, size - len(trailer))
os.close(fd)
"""


def used_bytes(mount: Path) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def crafted_trailer(chunks: int, chunk_bytes: int = 64) -> tuple[int, bytes]:
    """A well-formed trailer for a ring of `chunks` chunks, even beyond kvshm's bounds: its
    total is computed as the layout would, so the size check alone cannot refuse it."""
    readers = 1
    metadata = chunks * chunk_bytes + chunks * (1 + readers)
    registry = -(-metadata // 64) * 64 + 4 * 64 + 64 + 64 + readers * 64 + 64
    total = registry + 64
    trailer = struct.pack(">8sHHIQQ", MAGIC, VERSION, readers, chunks, chunk_bytes, total)
    return total, trailer.ljust(64, b"\0")


def test_crafted_trailers_are_refused_before_anything_is_mapped(small_tmpfs: Path) -> None:
    # a trailer claiming 2**21 chunks in a 132 MiB sparse file: was 14.6 s and 1.4 GiB to open
    size, trailer = crafted_trailer(1 << 21)
    assert size > 128 << 20
    directory = small_tmpfs / "dir"
    directory.mkdir()
    path = directory / "events"
    with path.open("wb") as f:
        f.truncate(size)
        f.seek(size - 64)
        f.write(trailer)
    before = used_bytes(small_tmpfs)
    started = time.monotonic()
    with pytest.raises(RingFormatError, match="damaged trailer"):
        RingFile.open(str(directory), "events")
    assert time.monotonic() - started < 0.5
    # within the bounds, but not what the caller expects: refused unmapped
    expected = RingLayout(4, CHUNK_BYTES, CHUNKS)
    size, trailer = crafted_trailer(1 << 15, 4096)
    os.truncate(path, size)
    with path.open("r+b") as f:
        f.seek(size - 64)
        f.write(trailer)
    with pytest.raises(RingFormatError, match="not one this process accepts"):
        MessageQueue.resume_writer(str(path), attach_timeout=0, accept=expected.__eq__)
    # and a reader that does accept it maps it without populating: nothing allocated
    reader_ring = MessageQueue.attach(str(path), attach_timeout=0)
    assert used_bytes(small_tmpfs) - before < 1 << 20
    reader_ring.close()


def test_a_planted_sparse_ring_and_a_crafted_trailer_cost_nothing_after_a_restart(
    small_tmpfs: Path, shm_dir: Path
) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = small_tmpfs / "root"
    write_regions(regions, "a.yaml", tenant_manifest("sparse"), tenant_manifest("crafted"))
    with RunningAgent(regions, root, "--no-http") as agent:
        agent.saw("tenant/sparse  Ready")
        agent.saw("tenant/crafted  Ready")
    # while the agent is down (an upgrade, a crash), the tenant replaces both rings
    tenant(_PLANT, str(root / "tenant/sparse" / EVENTS_RING), str(64 << 30), "")
    size, trailer = crafted_trailer(1 << 21)
    tenant(_PLANT, str(root / "tenant/crafted" / EVENTS_RING), str(size), trailer.hex())
    before = used_bytes(small_tmpfs)
    started = time.monotonic()
    with RunningAgent(regions, root, "--no-http") as agent:
        agent.saw("tenant/sparse  Ready")
        agent.saw("tenant/crafted  Ready")
        adopted = time.monotonic() - started
        write_regions(regions, "b.yaml", tenant_manifest("other", "elsewhere"))
        agent.saw("elsewhere/other  Ready")
        # 2 MiB for the new region, a page or two per ring
        assert used_bytes(small_tmpfs) - before < 3 << 20
        assert adopted < 10 and agent.peak_rss_bytes() < 200 << 20
        for name in ("sparse", "crafted"):
            ring = root / "tenant" / name / EVENTS_RING
            expected = RingLayout(4, CHUNK_BYTES, CHUNKS)
            assert ring.stat().st_size == expected.total_bytes  # the agent's own ring again
            assert ring.stat().st_uid == 65534
            MessageQueue.attach(str(ring), attach_timeout=1).close()  # and a working one
    assert "is 68719476736 bytes, not the" in agent.output()


def _attach_as(uid: int, path: Path) -> int:
    """Exit status of a forked process that drops to uid/gid `uid` and attaches to the ring."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            MessageQueue.attach(str(path), attach_timeout=2).close()
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_changed_spec_access_reaches_the_ring_also_across_a_restart(
    shm_dir: Path,
) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    shm_dir.chmod(0o711)
    root = shm_dir / "root"
    ring = root / "tenant" / "moved" / EVENTS_RING

    def access(uid: int, mode: int) -> None:
        document = tenant_manifest("moved")
        document["spec"]["access"] = {"uid": uid, "gid": uid, "mode": mode}
        write_regions(regions, "r.yaml", document)

    access(65534, 0o600)
    with RunningAgent(regions, root, "--no-http") as agent:
        agent.saw("tenant/moved  Ready")
        assert (ring.stat().st_uid, ring.stat().st_mode & 0o777) == (65534, 0o600)
        access(1000, 0o640)
        wait = time.monotonic() + 20
        while time.monotonic() < wait and ring.stat().st_uid != 1000:
            time.sleep(0.1)
        assert (ring.stat().st_uid, ring.stat().st_gid, ring.stat().st_mode & 0o777) == (
            1000,
            1000,
            0o640,
        )
        assert _attach_as(1000, ring) == 0
    access(1001, 0o600)  # changed while the agent is down
    with RunningAgent(regions, root, "--no-http") as agent:
        agent.saw("tenant/moved  Ready")
        assert (ring.stat().st_uid, ring.stat().st_mode & 0o777) == (1001, 0o600)
        assert _attach_as(1001, ring) == 0 and _attach_as(1000, ring) != 0
