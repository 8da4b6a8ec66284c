"""Admission: does the node's region root have room for one more region?

Free bytes of the root's filesystem, less a reserve the operator keeps for everything else,
less what regions already accepted here still have to allocate (sparse files and regions still
populating count as committed): a region that does not fit is refused up front with the numbers,
instead of filling the tmpfs and failing somewhere later.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshm.agent.sizes import format_bytes


@dataclass(frozen=True)
class CapacityCheck:
    needed_bytes: int  # what the region still has to allocate
    free_bytes: int
    reserve_bytes: int
    committed_bytes: int  # still to be allocated by regions accepted earlier

    @property
    def available_bytes(self) -> int:
        return max(0, self.free_bytes - self.reserve_bytes - self.committed_bytes)

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.available_bytes

    def refusal(self, root: str) -> str:
        return (
            f"not enough room on this node: the region needs {format_bytes(self.needed_bytes)} "
            f"({self.needed_bytes} bytes); the region root {root} has "
            f"{format_bytes(self.free_bytes)} free, {format_bytes(self.reserve_bytes)} reserved "
            f"(--reserve-bytes), {format_bytes(self.committed_bytes)} promised to regions still "
            f"populating or sparse: {format_bytes(self.available_bytes)} available. Free memory, "
            f"lower the reserve or ask for fewer blocks; the agent retries on every resync."
        )
