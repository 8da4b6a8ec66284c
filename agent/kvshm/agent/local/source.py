"""Local mode's region source: the OffloadRegion YAML files in one directory.

Same schema as the CRD (kvshm.api parses both). The directory is polled about once a second
(a stat per file; files are parsed again only when they change). A file that stops parsing keeps
the regions it had (an editor's half-written save must not drain a region); a file that is
deleted takes its regions away, and the agent drains and removes them.

Parsing costs are bounded: a file is read only if it is a regular file of at most
MAX_FILE_BYTES, and YAML aliases are refused (a kilobyte of nested aliases expands to gigabytes:
the "billion laughs"), so one bad file costs a problem line, never the agent's memory or a pass.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from kvshm.agent.view import ClusterView, KnownRegion
from kvshm.api import REGION_KIND, SpecError, parse_offload_region, region_key
from kvshm.api.messages import bounded
from kvshm.region import safefile
from kvshm.region.safefile import describe_file_type

_SUFFIXES = (".yaml", ".yml")
MAX_FILE_BYTES = 1 << 20  # a thousand regions' manifests; anything larger is refused unread
MAX_PROBLEM = 1024  # characters of why a file was refused (a YAML error can quote the file)
Signature = tuple[tuple[str, int, int, int], ...]


@dataclass
class _FileRegions:
    signature: tuple[int, int, int]
    regions: dict[str, KnownRegion] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def with_local_owner(manifest: Mapping[str, Any], uid: int, gid: int) -> dict[str, Any]:
    """Local mode gives files to the user running the agent unless spec.access says otherwise
    (a cluster's default is uid/gid 0, which only root may hand out)."""
    result = dict(manifest)
    spec = result.get("spec")
    if isinstance(spec, Mapping):
        spec = dict(spec)
        access = spec.get("access") or {}
        if isinstance(access, Mapping):
            access = dict(access)
            access.setdefault("uid", uid)
            access.setdefault("gid", gid)
            spec["access"] = access
        result["spec"] = spec
    return result


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (and so merge keys): without them a document's size in
    memory is proportional to its text."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"found the alias *{event.anchor}; aliases and merge keys (<<) are not accepted "
                f"in region files (they can expand without bound): write the values out",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def _check_regular(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"not a regular file but {describe_file_type(st.st_mode)}")


def read_bounded(path: str) -> str:
    """The file's text, if it is (or links to) a regular file of at most MAX_FILE_BYTES: a FIFO
    or device is never opened. Symlinks are followed: the directory is the operator's own, and
    a ConfigMap mounted there is made of them."""
    fd = safefile.open_checked(path, os.O_RDONLY, path, check=_check_regular, follow_symlinks=True)
    with os.fdopen(fd, "rb") as stream:
        data = stream.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise OSError(
            errno.EFBIG,
            f"larger than {MAX_FILE_BYTES} bytes; split the regions over several files",
        )
    return data.decode("utf-8")


def _document_key(document: Mapping[str, Any]) -> str | None:
    metadata = document.get("metadata")
    if not isinstance(metadata, Mapping) or not isinstance(metadata.get("name"), str):
        return None
    namespace = metadata.get("namespace") or "default"
    return region_key(str(namespace), metadata["name"])


class LocalDirectorySource:
    def __init__(
        self,
        directory: str,
        node_name: str,
        node_labels: Mapping[str, str] | None = None,
        *,
        poll_seconds: float = 1.0,
        owner: tuple[int, int] | None = None,
    ) -> None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(
                f"{directory} is not a directory: give --local the directory that holds the "
                f"OffloadRegion YAML files (e.g. examples/regions)"
            )
        self.directory = directory
        self.node_name = node_name
        self.node_labels = dict(node_labels or {})
        self._poll_seconds = poll_seconds
        self._owner = owner or (os.geteuid(), os.getegid())
        self._files: dict[str, _FileRegions] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- RegionSource ----------------------------------------------------------------------

    def start(self, wake: Callable[[], None]) -> None:
        self._thread = threading.Thread(
            target=self._poll, args=(wake,), name="kvshm-local-poll", daemon=True
        )
        self._thread.start()

    def synced(self) -> bool:
        return True

    def view(self) -> ClusterView:
        names = self._yaml_files()
        for name in list(self._files):
            if name not in names:
                del self._files[name]  # deleted: its regions go, and are drained
        regions: dict[str, KnownRegion] = {}
        invalid: dict[str, str] = {}
        problems: list[str] = []
        origin: dict[str, str] = {}
        for name in sorted(names):
            parsed = self._load(name)
            problems.extend(parsed.problems)
            for key, known in parsed.regions.items():
                if key in origin:
                    # which one is meant is not the agent's guess: refuse the region until one
                    # definition goes (one that exists is kept as it is, like any refused spec)
                    clash = (
                        f"region {key} is defined in both {origin[key]} and {name}; remove one "
                        f"of the two definitions"
                    )
                    problems.append(clash)
                    invalid[key] = clash
                    continue
                origin[key] = name
                regions[key] = known
            for key, why in parsed.invalid.items():
                invalid.setdefault(key, f"{name}: {why}")
        return ClusterView(
            self.node_name, self.node_labels, regions, invalid, problems=tuple(problems)
        )

    def close(self) -> None:
        self._stop.set()

    # -- reading ---------------------------------------------------------------------------

    def _yaml_files(self) -> set[str]:
        return {n for n in os.listdir(self.directory) if n.endswith(_SUFFIXES)}

    def _signature(self) -> Signature:
        signature = []
        for name in sorted(self._yaml_files()):
            try:
                st = os.stat(os.path.join(self.directory, name))
            except FileNotFoundError:
                continue
            signature.append((name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(signature)

    def _poll(self, wake: Callable[[], None]) -> None:
        last = self._signature()
        while not self._stop.wait(self._poll_seconds):
            current = self._signature()
            if current != last:
                last = current
                wake()

    def _load(self, name: str) -> _FileRegions:
        path = os.path.join(self.directory, name)
        try:
            st = os.stat(path)
            signature = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            return _FileRegions((0, 0, 0))
        cached = self._files.get(name)
        if cached is not None and cached.signature == signature:
            return cached
        try:
            text = read_bounded(path)
            documents = [d for d in yaml.load_all(text, Loader=_NoAliasLoader) if d is not None]
            parsed = self._parse(path, documents, signature)
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            parsed = self._failed(path, signature, cached, f"could not be read as YAML ({exc})")
        except RecursionError:
            parsed = self._failed(
                path, signature, cached, "is nested too deeply to be read as YAML; flatten it"
            )
        except Exception as exc:  # one file's trouble must never stop a pass
            parsed = self._failed(
                path, signature, cached, f"could not be parsed ({type(exc).__name__}: {exc})"
            )
        self._files[name] = parsed  # read again only once it changes
        return parsed

    @staticmethod
    def _failed(
        path: str, signature: tuple[int, int, int], cached: _FileRegions | None, why: str
    ) -> _FileRegions:
        """A file that stopped parsing: one problem, and the regions it had are kept."""
        kept = cached.regions if cached else {}
        problem = f"{path} {bounded(why, MAX_PROBLEM)}" + (
            f"; its regions {', '.join(sorted(kept))} are kept as they were" if kept else ""
        )
        return _FileRegions(signature, dict(kept), {}, [problem])

    def _parse(
        self, path: str, documents: list[Any], signature: tuple[int, int, int]
    ) -> _FileRegions:
        parsed = _FileRegions(signature)
        for index, document in enumerate(documents, 1):
            where = f"{path} (document {index})"
            if not isinstance(document, Mapping):
                parsed.problems.append(f"{where}: not a mapping; ignored")
                continue
            if document.get("kind") != REGION_KIND:
                parsed.problems.append(
                    f"{where}: kind {document.get('kind')!r} is not {REGION_KIND}; ignored"
                )
                continue
            try:
                region = parse_offload_region(with_local_owner(document, *self._owner))
            except SpecError as exc:
                parsed.problems.append(f"{where}: {exc}")
                key = _document_key(document)
                if key is not None:
                    parsed.invalid[key] = str(exc)
                continue
            if region.key in parsed.regions:
                parsed.problems.append(f"{where}: region {region.key} is defined twice; ignored")
                continue
            parsed.regions[region.key] = KnownRegion(region)
        return parsed
