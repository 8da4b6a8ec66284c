"""How drain events reach the workers attached to a region.

PROVISIONAL: kvshm.ipc (the queue in the region directory) is not in the tree yet, so for now
drain events are only logged; the holder probe and the grace period still decide removal.
"""

from __future__ import annotations

import logging

from kvshm.agent.drain import DrainEvent, DrainNotifier
from kvshm.agent.saferoot import RegionDir

log = logging.getLogger(__name__)


class LogNotifier:
    def publish(self, region_dir: RegionDir, event: DrainEvent) -> None:
        log.info("drain %s: %s", region_dir.key, event.to_message())

    def file_names(self, region_dir: RegionDir) -> list[str]:
        return []


def build_notifier() -> DrainNotifier:
    return LogNotifier()
