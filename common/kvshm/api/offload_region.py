"""OffloadRegion parsing and the phase vocabulary of both resources."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvshm.api.address import (
    MAX_DNS_SUBDOMAIN,
    RegionAddress,
    is_dns_label,
    is_dns_subdomain,
    region_key,
)
from kvshm.api.messages import bounded
from kvshm.region import InvalidInstanceIdError, InvalidLayoutError, RegionFormat, RegionLayout
from kvshm.region.files import DEFAULT_FILE_MODE, check_file_mode
from kvshm.region.naming import validate_instance_id

GROUP = "kvshm.dev"
VERSION = "v1alpha1"
REGION_KIND = "OffloadRegion"
REGION_PLURAL = "offloadregions"
NODE_KIND = "OffloadNode"
NODE_PLURAL = "offloadnodes"

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
MAX_LABEL_VALUE = 63
# A label key: an optional DNS prefix and '/', then a name like a label value (1-63 characters).
_LABEL_KEY = re.compile(
    r"([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
)
MAX_LABEL_KEY = MAX_DNS_SUBDOMAIN + 1 + MAX_LABEL_VALUE

# Bounds shared with charts/kvshm/crds/offloadregions.kvshm.dev.yaml (tests/api checks they agree).
MAX_ID = 2**31 - 1
MAX_GENERATION = 2**63 - 1  # metadata.generation is an int64 the API server counts up from 1
MAX_NUM_WORKERS = 1024
MAX_NODE_NAMES = 1000
MAX_NODE_SELECTOR_LABELS = 64
MAX_NUMA_ITEMS = 64  # spec.numa.gpus and spec.numa.nodes
MAX_NUMA_NODE = 1023  # the kernel's MAX_NUMNODES on x86-64 (NODES_SHIFT 10)
# A GPU as the host names it: its PCI address (a domain of 4 hex digits as sysfs writes it, 8
# as nvidia-smi does, or none), or its NVIDIA UUID
_GPU_ID = re.compile(
    r"(([0-9a-fA-F]{4}([0-9a-fA-F]{4})?:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]"
    r"|GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})"
)
_QUOTED = 80  # characters of a refused value quoted in an error
OWNER_READ_WRITE = 0o600  # the engine maps the file read-write as its owner


class SpecError(ValueError):
    """An OffloadRegion that can never work; the message names the field and what to do."""


class RegionPhase(StrEnum):
    """OffloadRegion.status.phase, derived by the operator from every node's report."""

    PENDING = "Pending"
    PROVISIONING = "Provisioning"
    READY = "Ready"
    DEGRADED = "Degraded"
    FAILED = "Failed"
    TERMINATING = "Terminating"


class NodeRegionPhase(StrEnum):
    """OffloadRegion.status.nodes.<node>.phase, written by that node's agent only."""

    PENDING = "Pending"
    CREATING = "Creating"
    POPULATING = "Populating"
    READY = "Ready"
    FAILED = "Failed"
    DRAINING = "Draining"
    REMOVED = "Removed"


class WarmIndexState(StrEnum):
    """OffloadRegion.status.nodes.<node>.warmIndex.state: what the last engine that started on
    the region made of its warm-restart index (docs/warm-restart.md)."""

    WARM = "Warm"  # it started with the chunks the index named
    COLD = "Cold"  # it started empty (the reason says why)
    ABSENT = "Absent"  # no index: none started here yet, or the last removed one it could not use
    UNREADABLE = "Unreadable"  # an index the agent cannot read (the reason says why)


class ReclaimOutcome(StrEnum):
    """An agent's answer to a reclaim the operator requested (OffloadNode status.reclaims).

    The value is the metric label (done, refused_held, ...); status uses the CamelCase form.
    """

    DONE = "done"
    REFUSED_HELD = "refused_held"
    REFUSED_CLAIMED = "refused_claimed"
    FAILED = "failed"

    @property
    def status_value(self) -> str:
        return "".join(word.capitalize() for word in self.value.split("_"))

    @classmethod
    def from_status(cls, text: object) -> ReclaimOutcome:
        """Either spelling; anything unknown reads as FAILED (not done, so never counted)."""
        for outcome in cls:
            if text in (outcome.value, outcome.status_value):
                return outcome
        return cls.FAILED


class ReclaimPolicy(StrEnum):
    DELETE = "Delete"
    RETAIN = "Retain"


@dataclass(frozen=True)
class RegionAccess:
    """Owner and permissions of the region's directory and file (never world-accessible)."""

    uid: int = 0
    gid: int = 0
    mode: int = DEFAULT_FILE_MODE

    @property
    def directory_mode(self) -> int:
        # the directory needs search (x) wherever the file grants read or write
        mode = self.mode
        if mode & 0o600:
            mode |= 0o100
        if mode & 0o060:
            mode |= 0o010
        return mode


@dataclass(frozen=True)
class RegionPlacement:
    node_names: tuple[str, ...] = ()
    node_selector: Mapping[str, str] = field(default_factory=dict)

    def matches(self, node_name: str, node_labels: Mapping[str, str]) -> bool:
        """nodeNames and nodeSelector both apply when both are given."""
        if self.node_names and node_name not in self.node_names:
            return False
        return all(node_labels.get(key) == value for key, value in self.node_selector.items())


@dataclass(frozen=True)
class RegionNuma:
    """Where the region's pages go on a host of several NUMA nodes: on the node(s) of the GPUs
    that use it (their PCI addresses or UUIDs, looked up on each node), or on NUMA nodes named
    directly. One of the two is set."""

    gpus: tuple[str, ...] = ()
    nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class OffloadRegion:
    name: str
    namespace: str
    instance_id: str
    layout: RegionLayout
    placement: RegionPlacement
    access: RegionAccess
    populate: bool = True
    lock: bool = True
    reclaim_policy: ReclaimPolicy = ReclaimPolicy.DELETE
    uid: str = ""
    generation: int = 0
    numa: RegionNuma | None = None  # None: the agent chooses (docs/agent.md, "NUMA")

    @property
    def address(self) -> RegionAddress:
        return RegionAddress(self.namespace, self.name, self.instance_id)

    @property
    def key(self) -> str:
        return region_key(self.namespace, self.name)

    @property
    def size_bytes(self) -> int:
        return self.layout.size_bytes


def _field(spec: Mapping[str, Any], path: str, kind: type, default: Any) -> Any:
    value = spec.get(path.rsplit(".", 1)[-1])
    if value is None:  # absent or null: the API server prunes a null, so its default applies
        if default is None:
            raise SpecError(f"spec.{path} is required")
        value = default
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError(f"spec.{path} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise SpecError(f"spec.{path} must be a {kind.__name__}, got {value!r}")
    return value


def _mapping(parent: Mapping[str, Any], key: str, path: str) -> Mapping[str, Any]:
    value = parent.get(key) or {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{path} must be an object, got {value!r}")
    return value


def parse_offload_region(manifest: Mapping[str, Any]) -> OffloadRegion:
    """An OffloadRegion from its manifest (API object or YAML document), defaults applied.

    Raises SpecError naming the field at fault.
    """
    if manifest.get("kind", REGION_KIND) != REGION_KIND:
        raise SpecError(f"kind must be {REGION_KIND}, got {manifest.get('kind')!r}")
    metadata = _mapping(manifest, "metadata", "metadata")
    name = metadata.get("name")
    namespace = metadata.get("namespace") or "default"
    if not is_dns_subdomain(name):
        raise SpecError(
            f"metadata.name {name!r} must be a lowercase DNS name (letters, digits, '-', '.'; "
            f"at most {MAX_DNS_SUBDOMAIN} characters)"
        )
    if not is_dns_label(namespace):
        raise SpecError(f"metadata.namespace {namespace!r} must be a lowercase DNS label")
    spec = _mapping(manifest, "spec", "spec")

    if spec.get("layout") is None:
        raise SpecError("spec.layout is required: give numBlocks and cpuPageSize")
    instance_id = _field(spec, "instanceId", str, name)
    try:
        validate_instance_id(instance_id)
    except InvalidInstanceIdError as exc:
        raise SpecError(f"spec.instanceId: {exc}") from exc

    layout_spec = _mapping(spec, "layout", "spec.layout")
    try:
        layout = RegionLayout(
            _field(layout_spec, "layout.numBlocks", int, None),
            _field(layout_spec, "layout.cpuPageSize", int, None),
            _field(layout_spec, "layout.numWorkers", int, 1),
            _field(layout_spec, "layout.format", str, RegionFormat.VLLM_0_33.value),
            _field(layout_spec, "layout.replicated", bool, False),
        )
    except InvalidLayoutError as exc:
        raise SpecError(f"spec.layout: {exc}") from exc
    if layout.num_workers > MAX_NUM_WORKERS:
        raise SpecError(
            f"spec.layout.numWorkers is {layout.num_workers}; at most {MAX_NUM_WORKERS} are allowed"
        )

    placement = _parse_placement(spec)

    access_spec = _mapping(spec, "access", "spec.access")
    uid = _field(access_spec, "access.uid", int, 0)
    gid = _field(access_spec, "access.gid", int, 0)
    mode = _field(access_spec, "access.mode", int, DEFAULT_FILE_MODE)
    if not 0 <= uid <= MAX_ID or not 0 <= gid <= MAX_ID:
        raise SpecError(f"spec.access uid/gid must be in [0, {MAX_ID}], got {uid}/{gid}")
    try:
        check_file_mode(mode)
    except InvalidLayoutError as exc:
        raise SpecError(f"spec.access.mode: {exc}") from exc
    if mode & OWNER_READ_WRITE != OWNER_READ_WRITE:
        raise SpecError(
            f"spec.access.mode {mode:#o} must let the owner read and write the file (0600): "
            "the serving engine maps it read-write, e.g. 384 (0600) or 416 (0640)"
        )

    policy = _field(spec, "reclaimPolicy", str, ReclaimPolicy.DELETE.value)
    try:
        reclaim_policy = ReclaimPolicy(policy)
    except ValueError:
        raise SpecError(f"spec.reclaimPolicy must be Delete or Retain, got {policy!r}") from None

    return OffloadRegion(
        name=name,
        namespace=namespace,
        instance_id=instance_id,
        layout=layout,
        placement=placement,
        access=RegionAccess(uid, gid, mode),
        populate=_field(spec, "populate", bool, True),
        lock=_field(spec, "lock", bool, True),
        reclaim_policy=reclaim_policy,
        uid=_metadata_uid(metadata),
        generation=_metadata_generation(metadata),
        numa=_parse_numa(spec),
    )


def _parse_numa(spec: Mapping[str, Any]) -> RegionNuma | None:
    """spec.numa: the GPUs (PCI addresses or UUIDs) or the NUMA nodes the pages go to."""
    if spec.get("numa") is None:
        return None
    numa = _mapping(spec, "numa", "spec.numa")
    if (numa.get("gpus") is None) == (numa.get("nodes") is None):
        raise SpecError(
            "spec.numa names either gpus (the GPUs that use the region, whose NUMA node the "
            "agent looks up) or nodes (NUMA nodes), one of them"
        )
    if numa.get("gpus") is not None:
        gpus = _numa_list(numa, "gpus", str)
        for index, gpu in enumerate(gpus):
            if len(gpu) > 40 or _GPU_ID.fullmatch(gpu) is None:
                raise SpecError(
                    f"spec.numa.gpus[{index}]: {bounded(repr(gpu), _QUOTED)} is not a GPU: give "
                    f"its PCI address (0000:1b:00.0; nvidia-smi --query-gpu=pci.bus_id,uuid "
                    f"lists both) or its UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
                )
        return RegionNuma(gpus=tuple(gpus))
    nodes = _numa_list(numa, "nodes", int)
    for index, node in enumerate(nodes):
        if not 0 <= node <= MAX_NUMA_NODE:
            raise SpecError(
                f"spec.numa.nodes[{index}]: NUMA nodes are numbered 0 to {MAX_NUMA_NODE}, "
                f"got {node}"
            )
    return RegionNuma(nodes=tuple(nodes))


def _numa_list(numa: Mapping[str, Any], key: str, kind: type) -> list[Any]:
    values = _field(numa, f"numa.{key}", list, None)
    if not 1 <= len(values) <= MAX_NUMA_ITEMS:
        raise SpecError(f"spec.numa.{key} must list 1 to {MAX_NUMA_ITEMS} items")
    what = "an integer" if kind is int else "a string"
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, kind):
            quoted = bounded(repr(value), _QUOTED)
            raise SpecError(f"spec.numa.{key}[{index}] must be {what}, got {quoted}")
        if value in values[:index]:
            raise SpecError(f"spec.numa.{key}[{index}]: {value!r} is listed twice")
    return values


def _metadata_uid(metadata: Mapping[str, Any]) -> str:
    uid = metadata.get("uid")
    if uid is None:
        return ""
    if not isinstance(uid, str):
        raise SpecError(
            f"metadata.uid must be a string (the API server sets it; a local file leaves it "
            f"out), got {bounded(repr(uid), _QUOTED)}"
        )
    return uid


def _metadata_generation(metadata: Mapping[str, Any]) -> int:
    """metadata.generation: set by the API server; a local file may leave it out (0)."""
    generation = metadata.get("generation")
    if generation is None:
        return 0
    if (
        isinstance(generation, bool)
        or not isinstance(generation, int)
        or not 0 <= generation <= MAX_GENERATION
    ):
        raise SpecError(
            f"metadata.generation must be an integer from 0 to {MAX_GENERATION} (the API "
            f"server sets it; a local file may leave it out), got "
            f"{bounded(repr(generation), _QUOTED)}"
        )
    return generation


def _parse_placement(spec: Mapping[str, Any]) -> RegionPlacement:
    """spec.placement: nodeNames and nodeSelector both apply; neither means every node."""
    placement_spec = _mapping(spec, "placement", "spec.placement")
    has_names = placement_spec.get("nodeNames") is not None
    node_names = _field(placement_spec, "placement.nodeNames", list, []) if has_names else []
    if has_names and not 1 <= len(node_names) <= MAX_NODE_NAMES:
        raise SpecError(f"spec.placement.nodeNames must list 1 to {MAX_NODE_NAMES} nodes")
    for node_name in node_names:
        if not is_dns_subdomain(node_name):
            raise SpecError(
                f"spec.placement.nodeNames: {node_name!r} is not a node name "
                f"(a lowercase DNS name of at most {MAX_DNS_SUBDOMAIN} characters)"
            )
    if len(set(node_names)) != len(node_names):
        raise SpecError(f"spec.placement.nodeNames lists a node twice: {node_names!r}")
    selector = _mapping(placement_spec, "nodeSelector", "spec.placement.nodeSelector")
    if len(selector) > MAX_NODE_SELECTOR_LABELS:
        raise SpecError(
            f"spec.placement.nodeSelector has {len(selector)} labels; "
            f"at most {MAX_NODE_SELECTOR_LABELS} are allowed"
        )
    for key, value in selector.items():
        if not isinstance(key, str) or not _is_label_key(key):
            raise SpecError(
                f"spec.placement.nodeSelector keys must be label keys: {key!r} is not (an "
                f"optional DNS prefix and '/', then 1-{MAX_LABEL_VALUE} letters, digits, '-', "
                f"'_' or '.' starting and ending with a letter or digit; at most "
                f"{MAX_LABEL_KEY} characters in all)"
            )
        if not isinstance(value, str) or not _is_label_value(value):
            raise SpecError(
                f"spec.placement.nodeSelector[{key}]: {value!r} is not a label value "
                f"(at most {MAX_LABEL_VALUE} letters, digits, '-', '_' or '.', "
                f"starting and ending with a letter or digit)"
            )
    return RegionPlacement(tuple(node_names), dict(selector))


def _is_label_key(key: str) -> bool:
    return len(key) <= MAX_LABEL_KEY and _LABEL_KEY.fullmatch(key) is not None


def _is_label_value(value: str) -> bool:
    return len(value) <= MAX_LABEL_VALUE and _LABEL_VALUE.fullmatch(value) is not None
