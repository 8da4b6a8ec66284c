"""Where kopf meets kvshm: kopf's decorators applied to the handlers, into a registry given.

`register()` says which resource, which cause, which interval and under which metric name each
handler runs (as crate-operator's main module does). It registers only when called: the
`kvshm-operator` console script (kvshm.operator.main) calls it with its flags' config, and
`kopf run -m kvshm.operator.kopf_run` with the environment's.
"""

from __future__ import annotations

from typing import Any

import kopf

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from kvshm.operator import handlers
from kvshm.operator.config import OperatorConfig
from kvshm.operator.metrics import instrumented

REGION = (GROUP, VERSION, REGION_PLURAL)
OFFLOAD_NODE = (GROUP, VERSION, NODE_PLURAL)
NODE = ("v1", "nodes")


def _not_deleting(meta: kopf.Meta, **_: Any) -> bool:
    return not meta.get("deletionTimestamp")


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> kopf.OperatorRegistry:
    """Every handler of the operator, registered into registry."""
    on = kopf.on
    on.startup(registry=registry)(handlers.startup)
    on.cleanup(registry=registry)(handlers.cleanup)
    on.login(registry=registry)(handlers.login)
    on.probe(id="regions", registry=registry)(handlers.probe_regions)

    # The cluster as the decisions see it: kopf keeps these indexes from watch streams.
    kopf.index(*NODE, registry=registry)(handlers.node_labels)
    kopf.index(*OFFLOAD_NODE, registry=registry)(handlers.agents)
    kopf.index(*REGION, registry=registry)(handlers.region_paths)
    kopf.index(*REGION, registry=registry, id="live_region_paths", when=_not_deleting)(
        handlers.region_paths
    )

    # OffloadRegion: every event to the book, which decides and writes (finalizer, status,
    # release) itself. No kopf handler here needs kopf's finalizer or its records in the
    # object: each of those was a write of its own (docs/operator.md, the write budget).
    on.event(*REGION, registry=registry, id="region_changed")(handlers.region_changed)

    # OffloadNode: gone nodes and orphan reclaim. A sweep that fails is retried one interval
    # later (kopf's default backoff is 60 s), and never given up on.
    kopf.timer(
        *OFFLOAD_NODE,
        interval=config.node_sweep_seconds,
        errors=kopf.ErrorsMode.TEMPORARY,
        backoff=config.node_sweep_seconds,
        registry=registry,
        id="sweep",
    )(instrumented("node_sweep")(handlers.sweep_node))
    on.event(*OFFLOAD_NODE, registry=registry, id="offload_node_changed")(
        handlers.offload_node_changed
    )
    return registry
