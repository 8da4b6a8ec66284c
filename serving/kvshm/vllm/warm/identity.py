"""Everything that decides a block's bytes and its key, as the warm-restart index's identity
(docs/warm-restart.md#identity): a flat mapping of field name to a JSON scalar, compared field
by field with the index's own.

vLLM 0.33 hands a spec only its OffloadingConfig; the rest comes from the VllmConfig of the
OffloadingConnector that builds the spec (find_vllm_config), the model's files, and vLLM's
block hashing once the engine has seeded it (hash_identity).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshm.region.index.format import FORMAT_VERSION, IdentityValue
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.warm.weights import content_digest

SHORT_VALUE = 96  # longer values are kept as their digest: the document must fit the header
MAX_MODEL_FILES = 4096  # a model directory is looked at this far, no further
MAX_JSON_BYTES = 16 << 20  # config and weight-index files digested whole up to this size
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HASH_PROBE = tuple(range(16))  # a fixed block of token ids: vLLM's hash of it fingerprints hashing
DEFAULT_SEED = "default"
ENV_SEED = "PYTHONHASHSEED"
RANDOM_SEED = "random"


def digest(value: object) -> str:
    """sha256 of a value's canonical JSON, as an identity value."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def short(value: object) -> IdentityValue:
    """A value as an identity holds it: JSON scalars up to SHORT_VALUE characters as they are,
    anything else (lists, objects, long strings) as its digest."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and len(value) <= SHORT_VALUE:
        return value
    return digest(value)


def find_vllm_config(max_frames: int = 16) -> Any | None:
    """The VllmConfig of the vLLM code that is building the spec: vLLM 0.33's
    OffloadingConnector.__init__(vllm_config, role, kv_cache_config) calls the spec factory, so
    its frame is a few frames up. None when the spec is built some other way."""
    from vllm.config import VllmConfig

    frame = inspect.currentframe()
    try:
        for _ in range(max_frames):
            if frame is None:
                return None
            candidate = frame.f_locals.get("vllm_config")
            if isinstance(candidate, VllmConfig):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept alive keeps every local of the stack alive


def _model_files(directory: Path) -> Iterator[os.DirEntry[str]]:
    with os.scandir(directory) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_MODEL_FILES:
                return
            name = entry.name
            if name.endswith(WEIGHT_SUFFIXES) or name.endswith(".json"):
                yield entry


def _file_fingerprint(entry: os.DirEntry[str]) -> list[object]:
    """What identifies one file's content at engine start: in a Hugging Face cache snapshot the
    blob a link points at (named by the content's sha256); a JSON file's digest; else a digest
    of its size, safetensors header and samples of every tensor (kvshm.vllm.warm.weights). Never
    its mtime: reproducible image builds give every file one."""
    if entry.is_symlink():
        target = os.readlink(entry.path)
        parent, blob = os.path.split(target)
        if os.path.basename(parent) == "blobs":
            return [entry.name, "blob", blob]
    st = entry.stat()
    if not stat.S_ISREG(st.st_mode):
        return [entry.name, "not-a-file"]
    if entry.name.endswith(".json") and st.st_size <= MAX_JSON_BYTES:
        with open(entry.path, "rb") as f:
            return [entry.name, "sha256", hashlib.sha256(f.read()).hexdigest()]
    return [entry.name, "sampled", content_digest(entry.path)]


def _directory_fingerprint(directory: Path) -> str | None:
    files = sorted((_file_fingerprint(e) for e in _model_files(directory)), key=lambda f: str(f[0]))
    if not any(str(f[0]).endswith(WEIGHT_SUFFIXES) for f in files):
        return None  # no weights here: not identified (the weights live elsewhere)
    return digest(files)


def _hub_snapshot(model: str, revision: str | None, cache_dirs: list[Path]) -> Path | None:
    """The local snapshot of a Hugging Face model id at `revision` (default main), read from
    the cache's refs without any network: vLLM downloaded it before the scheduler starts."""
    repo_dir = "models--" + model.replace("/", "--")
    wanted = revision or "main"
    for cache in cache_dirs:
        repo = cache / repo_dir
        if re.fullmatch(r"[0-9a-f]{40}", wanted):
            commit = wanted
        else:
            try:
                with open(repo / "refs" / wanted, "rb") as f:
                    commit = f.read(128).decode(errors="replace").strip()
            except OSError:
                continue
        snapshot = repo / "snapshots" / commit
        if re.fullmatch(r"[0-9a-f]{40}", commit) and snapshot.is_dir():
            return snapshot
    return None


def hub_cache_dirs(download_dir: str | None = None) -> list[Path]:
    """Where vLLM finds a hub model: its --download-dir, else Hugging Face's cache."""
    dirs = [Path(download_dir)] if download_dir else []
    hub = os.environ.get("HF_HUB_CACHE")
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    dirs.append(Path(hub) if hub else Path(home) / "hub")
    return dirs


def weights_fingerprint(model: str, revision: str | None, cache_dirs: list[Path]) -> str | None:
    """The identity of a model's weights: `hub:<commit>:<digest>` for a hub id found in the cache
    (the blob names are the content's sha256), `dir:<digest>` for a local directory (each weight
    file's name and sampled content digest, digests of the JSON files beside them), None when
    neither finds weights (a name alone does not identify weights)."""
    try:
        path = Path(model)
        if path.is_dir():
            found = _directory_fingerprint(path)
            return f"dir:{found}" if found else None
        snapshot = _hub_snapshot(model, revision, cache_dirs)
        if snapshot is None:
            return None
        found = _directory_fingerprint(snapshot)
        return f"hub:{snapshot.name}:{found}" if found else None
    except OSError:
        return None


def dummy_weights_fingerprint(load_config: Any) -> str | None:
    """`dummy:torch-<version>` when vLLM fills the weights itself (`--load-format dummy`): its
    dummy loader draws every weight from a fixed seed, so they follow from the model's config,
    dtype and vLLM (already identity fields) and torch's generator; None otherwise."""
    load_format = getattr(load_config, "load_format", None)
    if str(getattr(load_format, "value", load_format)) != "dummy":
        return None
    import torch

    return f"dummy:torch-{torch.__version__}"


def engine_identity(
    config: Any,
    vllm_config: Any,
    geometry: RegionGeometry,
    region_file: tuple[int, int],
    model_label: str | None,
) -> dict[str, IdentityValue]:
    """Every field of the identity that is known when the scheduler starts (the hash fields
    follow at its first request: hash_identity). `config` is vLLM's OffloadingConfig;
    `region_file` the (device, inode) of the region's file 0."""
    import vllm

    model_config = vllm_config.model_config
    cache_config = vllm_config.cache_config
    load_config = getattr(vllm_config, "load_config", None)
    parallel = config.parallel
    groups = [
        [g.tokens_per_block, list(g.layer_names), g.group_id, g.sliding_window_size_in_chunks]
        for g in config.groups
    ]
    hf_config = getattr(model_config, "hf_config", None)
    hf_json = hf_config.to_json_string() if hf_config is not None else None
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return {
        "index.format": FORMAT_VERSION,
        "vllm.version": str(vllm.__version__),
        "model.name": short(config.model.name),
        "model.revision": short(model_config.revision),
        "model.config": digest(hf_json) if hf_json is not None else None,
        "model.weights": short(
            dummy_weights_fingerprint(load_config)
            or weights_fingerprint(
                str(model_config.model),
                model_config.revision,
                hub_cache_dirs(getattr(load_config, "download_dir", None)),
            )
        ),
        "model.quantization": short(model_config.quantization),
        "model.label": short(model_label),
        "dtype.model": str(model_config.dtype),
        "dtype.kv_cache": str(cache_config.cache_dtype),
        "dtype.resolved": str(config.model.dtype),
        "kv.layout": config.kv_cache_layout,
        "kv.canonical": bool(config.canonical_layout),
        "kv.replicated": bool(config.replicated_layout),
        "kv.groups": short(groups),
        "kv.worker_bytes_per_block": int(config.worker_kv_bytes_per_block),
        "kv.attention_backend": None if backend is None else str(getattr(backend, "name", backend)),
        "block.tokens_per_hash": int(config.cache.tokens_per_hash),
        "block.blocks_per_chunk": int(config.cache.blocks_per_chunk),
        "block.hash_lookahead": int(vllm_config.num_hash_lookahead_tokens),
        "hash.algorithm": str(cache_config.prefix_caching_hash_algo),
        "parallel.world_size": int(parallel.world_size),
        "parallel.tp": int(parallel.tp_size),
        "parallel.pp": int(parallel.pp_size),
        "parallel.pcp": int(parallel.pcp_size),
        "parallel.dcp": int(parallel.dcp_size),
        "parallel.dp_index": int(parallel.data_parallel_index),
        "parallel.dp_size": int(parallel.data_parallel_size),
        "parallel.agnostic": bool(parallel.is_parallelism_agnostic),
        "region.format": geometry.region_layout().format.value,
        "region.chunks": geometry.num_chunks,
        "region.row_bytes": geometry.row_stride,
        "region.cell_bytes": geometry.cpu_page_size,
        "region.workers": geometry.num_workers,
        "region.replicated": geometry.replicated,
        "region.file": f"{region_file[0]}:{region_file[1]}",
    }


class HashingNotReady(RuntimeError):
    """vLLM has not seeded its block hashing yet (init_none_hash runs after the scheduler is
    built)."""


@dataclass(frozen=True)
class HashFacts:
    """How this engine's block hashes are seeded, and whether another process can find them."""

    fields: Mapping[str, IdentityValue]
    reproducible: bool
    key_bytes: int
    """Bytes of an OffloadKey: the block hash and 4 bytes of group index."""

    @property
    def why_not(self) -> str:
        return (
            f"the block hashes are seeded randomly per process ({self.fields['hash.algorithm']} "
            f"without {ENV_SEED}), so no restarted engine can find them: set {ENV_SEED} to a "
            f"shared value, or use prefix_caching_hash_algo sha256"
        )


def hash_identity(algorithm: str) -> HashFacts:
    """The hash fields, read from vLLM's own block hashing as the engine seeded it: the seed's
    kind, a digest of NONE_HASH (never NONE_HASH itself: with a secret PYTHONHASHSEED it is a
    secret), and a digest of vLLM's hash of a fixed block (a change of vLLM's hashing shows)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    if none_hash is None:
        raise HashingNotReady("vLLM's NONE_HASH is not set yet")
    seed_value = kv_cache_utils.get_none_hash_seed()
    if os.environ.get(ENV_SEED) is not None:
        seed = ENV_SEED
    elif seed_value == kv_cache_utils.DEFAULT_NONE_HASH_SEED:
        seed = DEFAULT_SEED
    else:
        seed = RANDOM_SEED
    hash_fn = get_hash_fn_by_name(algorithm)
    probe = kv_cache_utils.hash_block_tokens(hash_fn, none_hash, HASH_PROBE, None)
    return HashFacts(
        {
            "hash.algorithm": algorithm,
            "hash.seed": seed,
            "hash.none_hash": hashlib.sha256(bytes(none_hash)).hexdigest(),
            "hash.probe": hashlib.sha256(bytes(probe)).hexdigest(),
        },
        reproducible=seed != RANDOM_SEED,
        key_bytes=len(none_hash) + 4,
    )
