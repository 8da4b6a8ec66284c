"""Where a region lives and who a node is: the names every component derives paths and keys from.

A region is addressed by namespace, name and instance id. Everything else follows from those
three, here and nowhere else: its key "<namespace>/<name>" (status, metrics, Events, logs), its
directory under the region root (the same "<namespace>/<name>"), and its files there, named as
vLLM names them (kvshm.region.naming, split as RegionLayout.files splits a region).

A node's name is one identity used four ways: the Node's name, its OffloadNode's name (one per
node, named after it), the key of its entry in OffloadRegion status.nodes, and the field selector
of its agent's OffloadNode watch. NodeName is that identity, validated once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TypeGuard

from kvshm.region import InvalidInstanceIdError, RegionLayout
from kvshm.region.naming import parse_region_file_name, region_file_name, validate_instance_id

# Kubernetes object names (RFC 1123): a namespace is a DNS label, other names DNS subdomains.
MAX_DNS_LABEL = 63
MAX_DNS_SUBDOMAIN = 253
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class InvalidAddressError(ValueError):
    """A namespace, name, node name or instance id that cannot name a region or a node."""


def is_dns_label(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: object) -> TypeGuard[str]:
    return (
        isinstance(value, str)
        and len(value) <= MAX_DNS_SUBDOMAIN
        and _DNS_SUBDOMAIN.fullmatch(value) is not None
    )


def region_key(namespace: str, name: str) -> str:
    """ "<namespace>/<name>": how status, metrics, Events and logs name a region."""
    return f"{namespace}/{name}"


def split_region_key(key: str) -> tuple[str, str]:
    """(namespace, name) of a region key; InvalidAddressError if it is not one."""
    namespace, slash, name = key.partition("/")
    if not slash or not is_dns_label(namespace) or not is_dns_subdomain(name):
        raise InvalidAddressError(f"{key!r} is not a region key <namespace>/<name>")
    return namespace, name


@dataclass(frozen=True)
class RegionAddress:
    """A region's namespace, name and instance id, checked; its key, directory and files."""

    namespace: str
    name: str
    instance_id: str

    def __post_init__(self) -> None:
        if not is_dns_label(self.namespace):
            raise InvalidAddressError(
                f"namespace {self.namespace!r} is not a lowercase DNS label "
                f"(letters, digits and '-', at most {MAX_DNS_LABEL} characters)"
            )
        if not is_dns_subdomain(self.name):
            raise InvalidAddressError(
                f"name {self.name!r} is not a lowercase DNS name "
                f"(letters, digits, '-' and '.', at most {MAX_DNS_SUBDOMAIN} characters)"
            )
        try:
            validate_instance_id(self.instance_id)
        except InvalidInstanceIdError as exc:
            raise InvalidAddressError(str(exc)) from exc

    @property
    def key(self) -> str:
        return region_key(self.namespace, self.name)

    @property
    def directory(self) -> str:
        """The region's directory relative to the region root: <namespace>/<name>."""
        return f"{self.namespace}/{self.name}"

    @property
    def file_0_name(self) -> str:
        """vllm_offload_<id>.mmap: the file every region has, whatever its layout."""
        return region_file_name(self.instance_id)

    @property
    def file_0_path(self) -> str:
        """File 0 relative to the region root: how inventories and reclaims name a region."""
        return f"{self.directory}/{self.file_0_name}"

    def file_names(self, layout: RegionLayout) -> list[str]:
        """Every file of the region, file 0 first, as vLLM names and splits it."""
        return [file.name for file in layout.files(self.instance_id)]

    def relative_paths(self, layout: RegionLayout) -> list[str]:
        """Every file of the region relative to the region root, file 0 first."""
        return [f"{self.directory}/{name}" for name in self.file_names(layout)]

    def path_under(self, root: str) -> str:
        """File 0's absolute path under the region root `root`."""
        return f"{root.rstrip('/')}/{self.file_0_path}"

    @classmethod
    def from_relative_path(cls, path: str) -> tuple[RegionAddress, int] | None:
        """(address, segment) of <namespace>/<name>/<any file of a region>, or None when the
        path names no region file (more or fewer parts, a bad name, a foreign file name)."""
        parts = path.split("/")
        if len(parts) != 3:
            return None
        parsed = parse_region_file_name(parts[2])
        if parsed is None:
            return None
        try:
            return cls(parts[0], parts[1], parsed.instance_id), parsed.segment
        except InvalidAddressError:
            return None


class NodeName(str):
    """A node's name: the Node's, its OffloadNode's, its key in status.nodes and its agent's
    watch selector (metadata.name=<node>). A lowercase DNS name of at most 253 characters;
    constructing one checks it."""

    __slots__ = ()

    def __new__(cls, value: str) -> NodeName:
        if not is_dns_subdomain(value):
            raise InvalidAddressError(
                f"node name {value!r} is not a lowercase DNS name "
                f"(letters, digits, '-' and '.', at most {MAX_DNS_SUBDOMAIN} characters)"
            )
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, value: object) -> NodeName | None:
        """The name, or None when `value` is no node name (lenient reading of a status)."""
        try:
            return cls(value) if isinstance(value, str) else None
        except InvalidAddressError:
            return None
