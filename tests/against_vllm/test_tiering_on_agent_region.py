"""docs/warm-restart.md's answer, run: an agent-made region of one file is the primary tier of
vLLM 0.33's own, unmodified TieringOffloadingSpec, and its fs secondary tier works on top of it.

Two engines, each a process whose /dev/shm is the region's directory (as a serving pod sees it),
each with the spec vLLM builds from `--kv-transfer-config` (tiering_engine.py). The first stores
chunks (kvshm writing their rows as a worker would) and vLLM cascades them to files; the region's
rows are then wiped, and the second engine, whose primary tier starts empty, finds every chunk
in the fs tier and promotes it into the agent's region with the bytes the first stored. vLLM
joins the agent's file and neither resizes nor removes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvshm.region import RegionFormat, RegionLayout
from tests.against_vllm.test_attach_with_vllm import MOUNT_SHM
from tests.against_vllm.vllm_code import HERE, vllm_env
from tests.agent_region import agent_made_region, attach_as_worker
from tests.conftest import mounted_tmpfs
from tests.vllm_plugin.engine import TINY_LAYERS, TINY_PAGE

ENGINE_ID = "tiered-kv"
CHUNKS, CELL = 48, TINY_LAYERS * TINY_PAGE  # one GPU block a chunk: vLLM's default block_size
STORED = 20


def engine(phase: str, region_dir: Path, work: Path, fs_root: Path) -> dict[str, Any]:
    job = {
        "phase": phase,
        "engine_id": ENGINE_ID,
        "cpu_bytes": CHUNKS * CELL,
        "fs_root": str(fs_root),
        "keys": STORED,
        "work": str(work),
    }
    done = subprocess.run(
        [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{MOUNT_SHM["directory"]} && exec "$@"',
            str(region_dir), sys.executable, str(HERE / "tiering_engine.py"), json.dumps(job),
        ],
        env=vllm_env("0.33.0"), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_vllms_tiering_spec_keeps_an_agent_region_as_its_primary_tier(tmp_path: Path) -> None:
    layout = RegionLayout(CHUNKS, CELL, 1, RegionFormat.VLLM_0_33)
    with mounted_tmpfs(f"size={layout.size_bytes + (8 << 20)}") as tmpfs:
        region_dir = tmpfs / "serving" / "tiered"
        region_dir.mkdir(parents=True)
        creator = agent_made_region(region_dir, ENGINE_ID, layout, populate=True)
        try:
            files = {p.name: os.stat(p) for p in region_dir.iterdir()}
            assert list(files) == [f.name for f in layout.files(ENGINE_ID)]  # one file
            fs_root = tmp_path / "fs"

            stored = engine("store", region_dir, tmp_path, fs_root)
            assert stored["spec"] == "TieringOffloadingSpec"
            assert (stored["num_chunks"], stored["kv_bytes_per_chunk"]) == (CHUNKS, CELL)
            assert stored["engine_id"] == ENGINE_ID
            assert len(set(stored["chunk_ids"])) == STORED
            assert len(list(fs_root.rglob("*.bin"))) == STORED  # one file a chunk, in the fs tier

            wipe = attach_as_worker(region_dir, ENGINE_ID, layout, 0)
            try:  # only the fs tier holds the bytes now
                wipe.create_next_view(CELL).zero_()
            finally:
                wipe.cleanup()

            restarted = engine("restart", region_dir, tmp_path, fs_root)
            # cold primary tier: the first lookup of each chunk finds it in the fs tier
            assert "HIT" not in restarted["first_lookups"], restarted["first_lookups"]
            assert len(restarted["chunk_ids"]) == STORED
            assert restarted["wrong"] == []

            # vLLM joined the agent's file: same inode, size and mode, nothing added or removed
            after = {p.name: os.stat(p) for p in region_dir.iterdir()}
            assert list(after) == list(files)
            for name, before in files.items():
                now = after[name]
                assert (now.st_ino, now.st_size, now.st_mode) == (
                    before.st_ino,
                    before.st_size,
                    before.st_mode,
                )
        finally:
            creator.cleanup()
