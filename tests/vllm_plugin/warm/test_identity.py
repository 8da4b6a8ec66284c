"""kvshm.vllm.warm.identity: what identifies a model's weights, how vLLM seeded its block hashing,
and where the spec finds vLLM's config."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshm.vllm.settings import PluginConfigError, PluginSettings
from kvshm.vllm.warm.identity import (
    SHORT_VALUE,
    HashingNotReady,
    find_vllm_config,
    hash_identity,
    short,
    weights_fingerprint,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, model: str, files: dict[str, bytes], ref: str = "main") -> Path:
    """A Hugging Face cache as huggingface_hub lays it out: blobs named by content, a snapshot
    per commit of links to them, refs naming commits."""
    repo = root / ("models--" + model.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / ref).write_text(COMMIT)
    return snapshot


def test_a_hub_model_is_its_commit_and_its_blobs(tmp_path: Path) -> None:
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    hub_cache(tmp_path, "org/model", files)
    found = weights_fingerprint("org/model", None, [tmp_path])
    assert found is not None and found.startswith(f"hub:{COMMIT}:sha256:")
    assert weights_fingerprint("org/model", COMMIT, [tmp_path]) == found  # a commit revision
    other = tmp_path / "other"
    hub_cache(other, "org/model", {**files, "model.safetensors": b"fine-tuned"})
    assert weights_fingerprint("org/model", None, [other]) != found


def test_a_hub_model_at_a_revision_not_in_the_cache_is_unidentified(tmp_path: Path) -> None:
    hub_cache(tmp_path, "org/model", {"model.safetensors": b"w"})
    assert weights_fingerprint("org/model", "v2", [tmp_path]) is None
    assert weights_fingerprint("org/absent", None, [tmp_path]) is None


def test_a_local_directory_changes_with_its_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(str(tmp_path), None, []) is None  # no weights: unidentified
    weights = tmp_path / "model-00001-of-00002.safetensors"
    weights.write_bytes(b"w" * 10)
    first = weights_fingerprint(str(tmp_path), None, [])
    assert first is not None and first.startswith("dir:sha256:")
    assert weights_fingerprint(str(tmp_path), None, []) == first
    weights.write_bytes(b"v" * 11)
    assert weights_fingerprint(str(tmp_path), None, []) != first
    second = weights_fingerprint(str(tmp_path), None, [])
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    assert weights_fingerprint(str(tmp_path), None, []) != second


def test_long_values_are_kept_as_digests() -> None:
    assert short("x" * SHORT_VALUE) == "x" * SHORT_VALUE
    long = short("x" * (SHORT_VALUE + 1))
    assert isinstance(long, str) and long.startswith("sha256:") and len(long) == 71
    assert short([1, 2]) == short([1, 2]) != short([2, 1])
    assert short(None) is None and short(3) == 3 and short(True) is True


def test_the_config_is_found_in_vllms_connector_frame(warm_config: Any) -> None:
    assert find_vllm_config() is None

    def builder(vllm_config: Any) -> Any:  # as OffloadingConnector.__init__ holds it
        return find_vllm_config()

    assert builder(warm_config) is warm_config
    assert builder("not a VllmConfig") is None


@pytest.fixture
def warm_config() -> Any:
    from vllm.config import VllmConfig

    return VllmConfig.__new__(VllmConfig)  # only its type matters here


@pytest.fixture
def hashing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm.utils.hashing import get_hash_fn_by_name, sha256
    from vllm.v1.core import kv_cache_utils

    def seed(name: str, env: str | None) -> None:
        if env is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", env)
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(name))

    yield seed
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv_cache_utils.init_none_hash(sha256)


def test_how_vllm_seeded_its_hashing(hashing: Any) -> None:
    hashing("sha256", None)
    default = hash_identity("sha256")
    assert default.reproducible and default.fields["hash.seed"] == "default"
    assert default.key_bytes == 36
    assert hash_identity("sha256").fields == default.fields  # the same in every process
    hashing("sha256", "42")
    seeded = hash_identity("sha256")
    assert seeded.reproducible and seeded.fields["hash.seed"] == "PYTHONHASHSEED"
    assert seeded.fields["hash.none_hash"] != default.fields["hash.none_hash"]
    hashing("xxhash", None)
    random = hash_identity("xxhash")
    assert not random.reproducible and random.fields["hash.seed"] == "random"
    assert "PYTHONHASHSEED" in random.why_not
    hashing("xxhash", "42")
    assert hash_identity("xxhash").reproducible


def test_no_seed_yet_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core import kv_cache_utils

    monkeypatch.delattr(kv_cache_utils, "NONE_HASH")
    with pytest.raises(HashingNotReady):
        hash_identity("sha256")


def test_the_plugins_warm_restart_keys() -> None:
    def settings(**extra: Any) -> PluginSettings:
        return PluginSettings.from_extra_config(extra, "e", 0, 1)

    assert settings().warm_restart and settings().model_revision is None
    assert not settings(kvshm_warm_restart=False).warm_restart
    assert settings(kvshm_model_revision="ft-2024-06").model_revision == "ft-2024-06"
    for bad in ("", 3, "x" * 257):
        with pytest.raises(PluginConfigError, match="kvshm_model_revision must be a string"):
            settings(kvshm_model_revision=bad)
    with pytest.raises(PluginConfigError, match="kvshm_warm_restart must be true or false"):
        settings(kvshm_warm_restart="maybe")
