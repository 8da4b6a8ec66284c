"""parse_offload_region accepts exactly what the API server (with the CRD) accepts, same defaults.

The tables of manifests (GOOD, BAD) that test_crd_agreement_server.py sends through both the
real API server (tests/envtest) and kvshm.api's parser, and the checks that need no server:
the CRD's defaults and bounds are the parser's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvshm.api import OffloadRegion, offload_region, parse_offload_region
from kvshm.region import RegionFormat
from tests.api.admission import REGION_SCHEMA, schema_nodes

INT64_MAX = 2**63 - 1
DEMO = Path(__file__).resolve().parents[2] / "examples" / "regions" / "demo.yaml"

Edit = Callable[[dict[str, Any]], None]


def minimal() -> dict[str, Any]:
    return {
        "apiVersion": "kvshm.dev/v1alpha1",
        "kind": "OffloadRegion",
        "metadata": {"name": "r1", "namespace": "default"},
        "spec": {"layout": {"numBlocks": 16, "cpuPageSize": 4096}},
    }


def setting(path: str, value: Any) -> Edit:
    """An edit that sets spec.<path> (dotted), creating objects on the way."""

    def edit(manifest: dict[str, Any]) -> None:
        node = manifest
        *parents, last = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return edit


def removing(path: str) -> Edit:
    def edit(manifest: dict[str, Any]) -> None:
        node = manifest
        *parents, last = path.split(".")
        for key in parents:
            node = node[key]
        del node[last]

    return edit


GOOD: dict[str, list[Edit]] = {
    "minimal": [],
    "every field explicit": [
        setting("spec.instanceId", "engine-0.a_b"),
        setting("spec.layout.numWorkers", 8),
        setting("spec.layout.format", "vllm-0.27"),
        setting("spec.layout.replicated", True),
        setting(
            "spec.placement", {"nodeNames": ["gpu-1", "gpu-2.zone"], "nodeSelector": {"a/b": "c"}}
        ),
        setting("spec.populate", False),
        setting("spec.lock", False),
        setting("spec.reclaimPolicy", "Retain"),
        setting("spec.access", {"uid": 1000, "gid": 2000, "mode": 0o660}),
    ],
    "nodeNames only": [setting("spec.placement", {"nodeNames": ["n1"]})],
    "nodeSelector only": [setting("spec.placement", {"nodeSelector": {"pool": "kv"}})],
    "empty nodeSelector selects every node": [setting("spec.placement", {"nodeSelector": {}})],
    "empty placement selects every node": [setting("spec.placement", {})],
    "empty label value": [setting("spec.placement", {"nodeSelector": {"pool": ""}})],
    "longest label key": [
        setting("spec.placement", {"nodeSelector": {"a" * 253 + "/" + "k" * 63: "v"}})
    ],
    "mode 0640": [setting("spec.access.mode", 0o640)],
    "largest uid and gid": [setting("spec.access", {"uid": 2**31 - 1, "gid": 2**31 - 1})],
    "most workers": [setting("spec.layout.numWorkers", 1024)],
    "largest size": [
        setting("spec.layout", {"numBlocks": INT64_MAX, "cpuPageSize": 1, "format": "unpadded"})
    ],
    "size just fits": [
        setting(
            "spec.layout",
            {"numBlocks": 2**61 - 1, "cpuPageSize": 2, "numWorkers": 2, "format": "unpadded"},
        )
    ],
    "padded size just fits": [
        # rows of 2 x 3000 bytes are padded to 8192: 2^50 - 1 of them are 2^63 - 8192 bytes
        setting("spec.layout", {"numBlocks": 2**50 - 1, "cpuPageSize": 3000, "numWorkers": 2})
    ],
    "replicated padded size just fits": [
        setting(
            "spec.layout",
            {"numBlocks": 2**51 - 1, "cpuPageSize": 1, "numWorkers": 1024, "replicated": True},
        )
    ],
    "format vllm-0.27": [setting("spec.layout.format", "vllm-0.27")],
    "format unpadded": [setting("spec.layout.format", "unpadded")],
    "replicated": [setting("spec.layout.replicated", True), setting("spec.layout.numWorkers", 4)],
    "null fields take their defaults": [
        setting("spec.populate", None),
        setting("spec.access", None),
        setting("spec.layout.numWorkers", None),
    ],
    "unknown fields are dropped": [setting("spec.colour", "blue"), setting("spec.layout.x", 1)],
    "long name with instanceId": [
        setting("metadata.name", "a" * 253),
        setting("spec.instanceId", "short"),
    ],
    "name of 128 characters is its own instanceId": [setting("metadata.name", "b" * 128)],
    "instanceId of 128 characters": [setting("spec.instanceId", "C" * 128)],
    "other namespace": [setting("metadata.namespace", "team-a")],
    "numa by GPU address and UUID": [
        setting(
            "spec.numa.gpus",
            [
                "0000:1b:00.0",
                "9A:00.1",
                "00000000:3B:00.0",
                "GPU-8f6c1a2b-1234-5678-9abc-def012345678",
            ],
        )
    ],
    "numa by nodes": [setting("spec.numa.nodes", [0, 1023])],
}

# case -> (edits, the field the API server names, what the parser's message says)
BAD: dict[str, tuple[list[Edit], str, str]] = {
    "no spec": ([removing("spec")], "spec", "spec.layout"),
    "no layout": ([removing("spec.layout")], "spec.layout", "spec.layout"),
    "no numBlocks": ([removing("spec.layout.numBlocks")], "spec.layout.numBlocks", "numBlocks"),
    "no cpuPageSize": (
        [removing("spec.layout.cpuPageSize")],
        "spec.layout.cpuPageSize",
        "cpuPageSize",
    ),
    "zero blocks": ([setting("spec.layout.numBlocks", 0)], "spec.layout.numBlocks", "num_blocks"),
    "negative page": (
        [setting("spec.layout.cpuPageSize", -1)],
        "spec.layout.cpuPageSize",
        "cpu_page_size",
    ),
    "string blocks": (
        [setting("spec.layout.numBlocks", "16")],
        "spec.layout.numBlocks",
        "numBlocks",
    ),
    "fractional blocks": (
        [setting("spec.layout.numBlocks", 1.5)],
        "spec.layout.numBlocks",
        "numBlocks",
    ),
    "boolean workers": (
        [setting("spec.layout.numWorkers", True)],
        "spec.layout.numWorkers",
        "numWorkers",
    ),
    "zero workers": (
        [setting("spec.layout.numWorkers", 0)],
        "spec.layout.numWorkers",
        "num_workers",
    ),
    "too many workers": (
        [setting("spec.layout.numWorkers", 1025)],
        "spec.layout.numWorkers",
        "numWorkers",
    ),
    "size over int64": (
        [setting("spec.layout", {"numBlocks": 2**61, "cpuPageSize": 2, "numWorkers": 2})],
        "spec.layout",
        "fewer blocks",
    ),
    "padded size over int64": (
        # one byte per row is padded to 4096: 2^51 rows are 2^63 bytes
        [setting("spec.layout", {"numBlocks": 2**51, "cpuPageSize": 1})],
        "spec.layout",
        "fewer blocks",
    ),
    "padded row over int64": (
        [setting("spec.layout", {"numBlocks": 1, "cpuPageSize": 2**62, "numWorkers": 2})],
        "spec.layout",
        "fewer blocks",
    ),
    "unknown format": (
        [setting("spec.layout.format", "vllm-0.26")],
        "spec.layout.format",
        "format must be one of",
    ),
    "format not a string": (
        [setting("spec.layout.format", 33)],
        "spec.layout.format",
        "spec.layout.format",
    ),
    "replicated unpadded": (
        [setting("spec.layout.replicated", True), setting("spec.layout.format", "unpadded")],
        "spec.layout",
        "replicated layout needs format",
    ),
    "replicated as a string": (
        [setting("spec.layout.replicated", "yes")],
        "spec.layout.replicated",
        "spec.layout.replicated",
    ),
    "layout not an object": ([setting("spec.layout", [1, 2])], "spec.layout", "spec.layout"),
    "empty instanceId": ([setting("spec.instanceId", "")], "spec.instanceId", "empty"),
    "instanceId with a slash": (
        [setting("spec.instanceId", "a/b")],
        "spec.instanceId",
        "not allowed",
    ),
    "instanceId starting with a dot": (
        [setting("spec.instanceId", ".a")],
        "spec.instanceId",
        "not allowed",
    ),
    "instanceId with ..": ([setting("spec.instanceId", "a..b")], "spec.instanceId", "'..'"),
    "instanceId too long": ([setting("spec.instanceId", "x" * 129)], "spec.instanceId", "129"),
    "name too long for an instanceId": ([setting("metadata.name", "n" * 129)], "", "129"),
    "name not a DNS name": (
        [setting("metadata.name", "Bad_Name")],
        "metadata.name",
        "metadata.name",
    ),
    "name with ..": ([setting("metadata.name", "a..b")], "metadata.name", "metadata.name"),
    "name too long": (
        [setting("metadata.name", "a" * 254), setting("spec.instanceId", "x")],
        "metadata.name",
        "metadata.name",
    ),
    "world-readable mode": (
        [setting("spec.access.mode", 0o644)],
        "spec.access.mode",
        "other users",
    ),
    "world-writable mode": (
        [setting("spec.access.mode", 0o602)],
        "spec.access.mode",
        "other users",
    ),
    "mode 0": ([setting("spec.access.mode", 0)], "spec.access.mode", "read and write"),
    "owner cannot write": (
        [setting("spec.access.mode", 0o440)],
        "spec.access.mode",
        "read and write",
    ),
    "mode above 0777": ([setting("spec.access.mode", 0o1000)], "spec.access.mode", "0-0777"),
    "negative mode": ([setting("spec.access.mode", -8)], "spec.access.mode", "0-0777"),
    "negative uid": ([setting("spec.access.uid", -1)], "spec.access.uid", "uid/gid"),
    "gid above 2^31-1": ([setting("spec.access.gid", 2**31)], "spec.access.gid", "uid/gid"),
    "access not an object": ([setting("spec.access", "rw")], "spec.access", "spec.access"),
    "unknown reclaimPolicy": (
        [setting("spec.reclaimPolicy", "Keep")],
        "spec.reclaimPolicy",
        "Delete or Retain",
    ),
    "populate as a string": ([setting("spec.populate", "yes")], "spec.populate", "spec.populate"),
    "lock as a number": ([setting("spec.lock", 1)], "spec.lock", "spec.lock"),
    "empty nodeNames": (
        [setting("spec.placement", {"nodeNames": []})],
        "spec.placement.nodeNames",
        "1 to 1000",
    ),
    "too many nodeNames": (
        [setting("spec.placement", {"nodeNames": [f"n{i}" for i in range(1001)]})],
        "spec.placement.nodeNames",
        "1 to 1000",
    ),
    "node name not a DNS name": (
        [setting("spec.placement", {"nodeNames": ["Node_A"]})],
        "spec.placement.nodeNames[0]",
        "not a node name",
    ),
    "node listed twice": (
        [setting("spec.placement", {"nodeNames": ["a", "a"]})],
        "spec.placement.nodeNames[1]",
        "twice",
    ),
    "bad label value": (
        [setting("spec.placement", {"nodeSelector": {"pool": "a b"}})],
        "spec.placement.nodeSelector[pool]",
        "not a label value",
    ),
    "label value too long": (
        [setting("spec.placement", {"nodeSelector": {"pool": "v" * 64}})],
        "spec.placement.nodeSelector[pool]",
        "not a label value",
    ),
    "label value not a string": (
        [setting("spec.placement", {"nodeSelector": {"pool": 3}})],
        "spec.placement.nodeSelector[pool]",
        "not a label value",
    ),
    "label key too long": (
        [setting("spec.placement", {"nodeSelector": {"a" * 254 + "/" + "k" * 63: "v"}})],
        "spec.placement.nodeSelector",
        "label keys",
    ),
    "label key name too long": (
        [setting("spec.placement", {"nodeSelector": {"k" * 64: "v"}})],
        "spec.placement.nodeSelector",
        "label keys",
    ),
    "bad label key": (
        [setting("spec.placement", {"nodeSelector": {"a b": "v"}})],
        "spec.placement.nodeSelector",
        "label keys",
    ),
    "too many labels": (
        [setting("spec.placement", {"nodeSelector": {f"k{i}": "v" for i in range(65)}})],
        "spec.placement.nodeSelector",
        "at most 64",
    ),
    "numa with gpus and nodes": (
        [setting("spec.numa", {"gpus": ["1b:00.0"], "nodes": [0]})],
        "spec.numa",
        "either gpus",
    ),
    "numa with neither": ([setting("spec.numa", {})], "spec.numa", "either gpus"),
    "numa not an object": ([setting("spec.numa", [0])], "spec.numa", "spec.numa"),
    "numa gpu that is no GPU": (
        [setting("spec.numa.gpus", ["gpu0"])],
        "spec.numa.gpus[0]",
        "is not a GPU",
    ),
    "numa gpu listed twice": (
        [setting("spec.numa.gpus", ["1b:00.0", "1b:00.0"])],
        "spec.numa.gpus[1]",
        "twice",
    ),
    "numa node above 1023": (
        [setting("spec.numa.nodes", [1024])],
        "spec.numa.nodes[0]",
        "0 to 1023",
    ),
    "numa node negative": ([setting("spec.numa.nodes", [-1])], "spec.numa.nodes[0]", "0 to 1023"),
    "numa node as a string": (
        [setting("spec.numa.nodes", ["0"])],
        "spec.numa.nodes[0]",
        "an integer",
    ),
    "no numa nodes": ([setting("spec.numa.nodes", [])], "spec.numa.nodes", "1 to 64"),
    "too many numa gpus": (
        [setting("spec.numa.gpus", [f"{bus:02x}:00.0" for bus in range(65)])],
        "spec.numa.gpus",
        "1 to 64",
    ),
}


def manifest_for(edits: list[Edit]) -> dict[str, Any]:
    manifest = minimal()
    for edit in edits:
        edit(manifest)
    return manifest


def spec_of(region: OffloadRegion) -> dict[str, Any]:
    """The parsed region written back as the CRD's spec, every default explicit."""
    spec: dict[str, Any] = {
        "layout": {
            "numBlocks": region.layout.num_blocks,
            "cpuPageSize": region.layout.cpu_page_size,
            "numWorkers": region.layout.num_workers,
            "format": region.layout.format.value,
            "replicated": region.layout.replicated,
        },
        "populate": region.populate,
        "lock": region.lock,
        "reclaimPolicy": region.reclaim_policy.value,
        "access": {"uid": region.access.uid, "gid": region.access.gid, "mode": region.access.mode},
    }
    if region.numa is not None:
        numa = region.numa
        spec["numa"] = {"gpus": list(numa.gpus)} if numa.gpus else {"nodes": list(numa.nodes)}
    placement = region.placement
    if placement.node_names or placement.node_selector:
        spec["placement"] = {}
        if placement.node_names:
            spec["placement"]["nodeNames"] = list(placement.node_names)
        if placement.node_selector:
            spec["placement"]["nodeSelector"] = dict(placement.node_selector)
    return spec


def test_every_default_of_the_crd_is_the_parsers() -> None:
    parsed = parse_offload_region(minimal())
    defaults = {
        path: node["default"] for path, node in schema_nodes(REGION_SCHEMA) if "default" in node
    }
    assert defaults, "the CRD declares no defaults?"
    rendered = {"spec": spec_of(parsed)}
    for path, default in defaults.items():
        node: Any = rendered
        for key in path.split("."):
            node = node[key]
        if isinstance(default, dict):
            continue  # an object default ({}): its fields' defaults are checked one by one
        assert node == default, path


def test_bounds_of_the_crd_are_the_parsers() -> None:
    nodes = dict(schema_nodes(REGION_SCHEMA))
    assert nodes["spec.layout.numWorkers"]["maximum"] == offload_region.MAX_NUM_WORKERS
    assert nodes["spec.access.uid"]["maximum"] == offload_region.MAX_ID
    assert nodes["spec.access.gid"]["maximum"] == offload_region.MAX_ID
    assert nodes["spec.access.mode"]["maximum"] == 0o777
    assert nodes["spec.instanceId"]["maxLength"] == 128
    assert nodes["spec.placement.nodeNames"]["maxItems"] == offload_region.MAX_NODE_NAMES
    assert (
        nodes["spec.placement.nodeSelector"]["maxProperties"]
        == offload_region.MAX_NODE_SELECTOR_LABELS
    )
    assert nodes["spec.placement.nodeSelector[*]"]["maxLength"] == offload_region.MAX_LABEL_VALUE
    assert nodes["spec.placement.nodeNames[*]"]["maxLength"] == offload_region.MAX_DNS_SUBDOMAIN
    assert nodes["spec.reclaimPolicy"]["enum"] == [p.value for p in offload_region.ReclaimPolicy]
    assert nodes["spec.layout.format"]["enum"] == [f.value for f in RegionFormat]
    for key in ("gpus", "nodes"):
        assert nodes[f"spec.numa.{key}"]["maxItems"] == offload_region.MAX_NUMA_ITEMS
    assert nodes["spec.numa.nodes[*]"]["maximum"] == offload_region.MAX_NUMA_NODE
    assert nodes["spec.numa.gpus[*]"]["pattern"] == f"^{offload_region._GPU_ID.pattern}$"
