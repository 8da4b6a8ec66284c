"""The JSON patches that add or remove the operator's finalizer, in one write that cannot lose.

Their preconditions are the object's uid and its finalizers as seen, never its resourceVersion:
the agents' status reports, which land between any two of the operator's reads, cannot make
them fail. A test that does fail means the finalizers (or the object) changed, and that change
is an event of its own, after which the operator decides again. (`test` of a missing member
against null passes on the API server, so an absent list is a precondition too: a list someone
else created meanwhile is never overwritten.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Ops = list[dict[str, Any]]


def _finalizers(meta: Mapping[str, Any]) -> list[str] | None:
    value = meta.get("finalizers")
    return None if value is None else [str(item) for item in value]


def add_ops(meta: Mapping[str, Any], finalizer: str) -> Ops | None:
    """Add `finalizer`, or None when it is there already."""
    seen = _finalizers(meta)
    if seen is not None and finalizer in seen:
        return None
    ops: Ops = [
        {"op": "test", "path": "/metadata/uid", "value": meta.get("uid")},
        {"op": "test", "path": "/metadata/finalizers", "value": seen},
    ]
    if seen:
        ops.append({"op": "add", "path": "/metadata/finalizers/-", "value": finalizer})
    else:
        ops.append({"op": "add", "path": "/metadata/finalizers", "value": [finalizer]})
    return ops


def remove_ops(meta: Mapping[str, Any], finalizer: str) -> Ops | None:
    """Remove `finalizer` (every copy of it), or None when it is not there."""
    seen = _finalizers(meta) or []
    positions: Sequence[int] = [index for index, item in enumerate(seen) if item == finalizer]
    if not positions:
        return None
    ops: Ops = [{"op": "test", "path": "/metadata/uid", "value": meta.get("uid")}]
    for index in reversed(positions):  # from the end: earlier indexes stay valid
        ops.append({"op": "test", "path": f"/metadata/finalizers/{index}", "value": finalizer})
        ops.append({"op": "remove", "path": f"/metadata/finalizers/{index}"})
    return ops
