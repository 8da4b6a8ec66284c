"""kopf settings for kvshm: kopf's finalizer, where kopf keeps records, peering, bounded workers."""

from __future__ import annotations

import kopf

from kvshm.api import GROUP
from kvshm.operator.config import OperatorConfig, PeeringMode

# The regions' finalizer: the operator's own (kvshm.operator.book adds and removes it).
FINALIZER = "kvshm.dev/operator"
# kopf's, on OffloadNodes only (their sweep timer). A name of its own: kopf removes its
# finalizer from any object no kopf handler needs it on, and regions have no such handler.
TIMER_FINALIZER = "kvshm.dev/sweep-timer"
SYNC_THREADS = 4
# kopf keeps a finalizer on every object with a timer and removes it once the timer has exited,
# re-checking every cancellation_polling seconds (kopf's default: 60). The sweep timer deletes
# its own OffloadNode when the node is gone; when the deletion arrived while that run was still
# finishing, the OffloadNode stayed a minute (a test waiting 51 s caught it 1 run in 12).
TIMER_EXIT_POLL_SECONDS = 1.0


def configure(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    settings.persistence.finalizer = TIMER_FINALIZER
    # kopf keeps no handler progress nor last-handled spec: no kvshm handler is of the kinds
    # that need them. Only its touch while an OffloadNode's timer exits lands here.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
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
    settings.queueing.worker_limit = config.max_workers or None
    settings.queueing.idle_timeout = config.worker_idle_seconds
    settings.execution.max_workers = SYNC_THREADS
    settings.background.cancellation_polling = TIMER_EXIT_POLL_SECONDS
    settings.posting.reporting_component = "kvshm-operator"
    settings.posting.event_name_prefix = "kvshm-operator-"
