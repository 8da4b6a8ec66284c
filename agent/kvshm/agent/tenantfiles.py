"""What a tenant keeps in its region directory besides the region, against what it may keep there.

A serving pod mounts its region directory as its /dev/shm, so everything it writes there takes
the region root's tmpfs, which admitted only the region: the warm-restart index
(vllm_offload_<id>.index, the plugin's), NCCL's and Python's shared memory, anything else. The
agent counts the bytes the tmpfs holds for them (st_blocks: a sparse file counts what it took;
each inode once, and a further name of a region file not at all) and compares them with what
the tenant may keep beside the region: the index's size for the region's layout and
--tenant-files-bytes. The region's status message and metrics say so when it is more.

tmpfs user quotas (Linux 6.6+, mount options usrquota, usrquota_block_hardlimit) would have the
kernel refuse such writes, but they are not used: kernels built without CONFIG_TMPFS_QUOTA
refuse the options (this project's test node's among them), and a quota is a uid's, while a
region's files belong to spec.access.uid, which regions and tenants may share (0 unless set).

The tenant owns the directory: the walk looks at no more than MAX_ENTRIES entries (its
subdirectories' included, MAX_DEPTH levels deep), never follows a symlink nor enters another
filesystem; beyond that the bytes are a lower bound, and say so.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

from kvshm.agent.root import dirwalk
from kvshm.agent.root.saferoot import RegionDir
from kvshm.agent.sizes import format_bytes
from kvshm.api import OffloadRegion
from kvshm.region.drain_event import EVENTS_RING
from kvshm.region.index.format import index_size
from kvshm.region.naming import index_file_name

MAX_ENTRIES = 1024
MAX_DEPTH = 4
DEFAULT_ALLOWANCE_BYTES = 1 << 30


@dataclass(frozen=True)
class TenantFiles:
    """The tenant's other files in one region directory, as far as the walk looked."""

    bytes: int  # what the tmpfs holds for them
    files: int
    index_bytes: int  # of which the warm-restart index
    allowed_bytes: int  # the index's size for the region, and the allowance
    complete: bool  # every entry looked at (else `bytes` is at least what they hold)

    @property
    def over(self) -> bool:
        return self.bytes > self.allowed_bytes

    def message(self) -> str:
        """Why the tenant is over what it may keep, for the region's status."""
        at_least = "" if self.complete else "at least "
        return (
            f"the region's directory also holds {at_least}{format_bytes(self.bytes)} in "
            f"{self.files} other file(s) ({format_bytes(self.index_bytes)} of them the "
            f"warm-restart index), more than the {format_bytes(self.allowed_bytes)} a tenant "
            f"may keep beside its region (the index's size and --tenant-files-bytes): the "
            f"region root's tmpfs did not admit them. Remove what the serving pod does not "
            f"need from its /dev/shm"
        )


def allowed_bytes(region: OffloadRegion, allowance_bytes: int) -> int:
    return index_size(region.layout.num_blocks) + allowance_bytes


def count_tenant_files(
    region_dir: RegionDir,
    region: OffloadRegion,
    region_file_ids: frozenset[tuple[int, int]],
    allowance_bytes: int,
) -> TenantFiles:
    """The tenant's files in the region's directory but the region's own files (by name and
    by inode, region_file_ids) and the agent's event ring."""
    own = {file.name for file in region.layout.files(region.instance_id)} | {EVENTS_RING}
    index = index_file_name(region.instance_id)
    walked = dirwalk.walk(region_dir.fd, MAX_ENTRIES, MAX_DEPTH)
    seen = set(region_file_ids)
    total = files = index_bytes = 0
    for entry in walked.entries:
        st = entry.stat
        inode = (st.st_dev, st.st_ino)
        if entry.path in own or not stat.S_ISREG(st.st_mode) or inode in seen:
            continue
        seen.add(inode)
        files += 1
        total += st.st_blocks * 512
        if entry.path == index:
            index_bytes = st.st_blocks * 512
    return TenantFiles(
        total, files, index_bytes, allowed_bytes(region, allowance_bytes), walked.complete
    )
