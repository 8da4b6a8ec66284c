"""Where kopf keeps its handler progress: per kind, where only the operator may write it.

- OffloadRegion: in status (status.kopf.progress, and status.kopf.dummy, the field kopf touches
  to wake itself after a delay). A region's author may edit its annotations but not its status;
  a forged annotation recording `release` as done dropped the finalizer while a serving pod
  still held the region. In status the record also rides in the operator's own status patch.
- OffloadNode (and anything else): in `kvshm.dev/*` annotations. Its status is the agent's
  alone (the operator may not write it), nobody but the cluster's admins edits it, and kopf
  touches it every TIMER_EXIT_POLL_SECONDS while its sweep timer exits on a deletion.
"""

from __future__ import annotations

from typing import Any

import kopf

from kvshm.api import REGION_KIND

ANNOTATION_PREFIX = "kvshm.dev"
PROGRESS_FIELD = "status.kopf.progress"
TOUCH_FIELD = "status.kopf.dummy"


class ProgressByKind(kopf.ProgressStorage):
    def __init__(self) -> None:
        super().__init__()
        self.in_status = kopf.StatusProgressStorage(field=PROGRESS_FIELD, touch_field=TOUCH_FIELD)
        self.in_annotations = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)

    def _of(self, body: kopf.Body) -> kopf.ProgressStorage:
        return self.in_status if body.get("kind") == REGION_KIND else self.in_annotations

    def fetch(self, *, key: Any, body: kopf.Body) -> Any:
        return self._of(body).fetch(key=key, body=body)

    def store(self, *, key: Any, record: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        self._of(body).store(key=key, record=record, body=body, patch=patch)

    def purge(self, *, key: Any, body: kopf.Body, patch: kopf.Patch) -> None:
        self._of(body).purge(key=key, body=body, patch=patch)

    def touch(self, *, body: kopf.Body, patch: kopf.Patch, value: str | None) -> None:
        self._of(body).touch(body=body, patch=patch, value=value)

    def clear(self, *, essence: Any) -> Any:
        """The essence (what kopf compares for changes) without either storage's fields."""
        return self.in_annotations.clear(essence=self.in_status.clear(essence=essence))
