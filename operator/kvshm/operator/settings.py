"""kopf settings for kvshm: our finalizer, where kopf keeps records, peering, bounded workers."""

from __future__ import annotations

import kopf

from kvshm.operator.config import OperatorConfig, PeeringMode
from kvshm.operator.progress import ProgressByKind

FINALIZER = "kvshm.dev/operator"
DIFFBASE_FIELD = "status.kopf.lastHandledConfiguration"
SYNC_THREADS = 4
# kopf keeps a finalizer on every object with a timer and removes it once the timer has exited,
# re-checking every cancellation_polling seconds (kopf's default: 60). The sweep timer deletes
# its own OffloadNode when the node is gone; when the deletion arrived while that run was still
# finishing, the OffloadNode stayed a minute (a test waiting 51 s caught it 1 run in 12).
TIMER_EXIT_POLL_SECONDS = 1.0


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    # One finalizer on a region, and it is ours: the agents never add any.
    settings.persistence.finalizer = FINALIZER
    # Handler progress: in status for regions, in annotations for OffloadNodes (progress.py
    # says why). The last-handled spec (status.kopf.lastHandledConfiguration) is in status too:
    # a copy of a spec of up to ~300 KB cannot fit the 256 KiB that all of an object's
    # annotations share (kopf then retries forever: no phase, no deletion). It holds the spec
    # only: the update handlers watch nothing else.
    settings.persistence.progress_storage = ProgressByKind()
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(
        field=DIFFBASE_FIELD, ignored_fields=["metadata"]
    )
    # One active replica: replicas peer cluster-wide under one name; the others pause.
    settings.peering.name = config.peering_name
    settings.peering.clusterwide = True
    if config.peering_mode is PeeringMode.MANDATORY:
        settings.peering.mandatory, settings.peering.standalone = True, False
    elif config.peering_mode is PeeringMode.STANDALONE:
        settings.peering.mandatory, settings.peering.standalone = False, True
    # Watch streams end on the server's side first (no half-dead connections), then reconnect.
    settings.watching.server_timeout = config.watch_server_timeout_seconds
    settings.watching.client_timeout = config.watch_client_timeout_seconds
    # Bounded concurrency: per-object workers (each object's events run in order in one), and a
    # few threads for kopf's synchronous parts (every kvshm handler is async).
    settings.queueing.worker_limit = config.max_workers
    settings.queueing.idle_timeout = config.worker_idle_seconds
    settings.execution.max_workers = SYNC_THREADS
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
    settings.posting.reporting_component = "kvshm-operator"
    settings.posting.event_name_prefix = "kvshm-operator-"
