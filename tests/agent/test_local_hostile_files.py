"""Local mode's YAML directory written by someone hostile."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from tests.agent.builders import local_agent
from tests.agent.hostile import (
    TENANT_UID,
    RunningAgent,
    tenant,
    tenant_manifest,
    traversable,
    write_regions,
)

# nine levels of ten aliases each: 10^9 list items once expanded, from under a kilobyte
_ALIAS_BOMB = """
import sys
lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
for level in range(1, 10):
    refs = ",".join([f"*a{level - 1}"] * 10)
    lines.append(f"a{level}: &a{level} [{refs}]")
lines += ["apiVersion: kvshm.dev/v1alpha1", "kind: OffloadRegion", "metadata: {name: bomb}"]
# where a refused value is quoted in the error message, the whole expansion would be printed
lines.append("spec: {layout: {numBlocks: *a9, cpuPageSize: 4096, numWorkers: 1}}")
open(sys.argv[1] + "/bomb.yaml", "w").write("\\n".join(lines) + "\\n")
open(sys.argv[1] + "/huge.yaml", "w").write("# " + "x" * (2 << 20) + "\\n")
import os
os.mkfifo(sys.argv[1] + "/fifo.yaml")
"""


def test_an_alias_bomb_an_oversized_file_and_a_fifo_are_reported_and_others_work(
    shm_dir: Path,
) -> None:
    regions = traversable(shm_dir) / "regions"
    regions.mkdir()
    os.chown(regions, TENANT_UID, TENANT_UID)  # someone unprivileged may write region files
    write_regions(regions, "good.yaml", tenant_manifest("good"))
    tenant(_ALIAS_BOMB, str(regions))
    assert (regions / "bomb.yaml").stat().st_size < 1024
    started = time.monotonic()
    with RunningAgent(regions, shm_dir / "root", "--no-http") as agent:
        agent.saw("tenant/good  Ready")
        agent.saw("bomb.yaml could not be read as YAML")
        agent.saw("huge.yaml could not be read as YAML")
        agent.saw("fifo.yaml could not be read as YAML")
        ready_seconds = time.monotonic() - started
        # a later region is still picked up: passes go on
        write_regions(regions, "later.yaml", tenant_manifest("later"))
        agent.saw("tenant/later  Ready")
        peak = agent.peak_rss_bytes()
    output = agent.output()
    assert "aliases and merge keys (<<) are not accepted" in output
    assert "larger than 1048576 bytes" in output and "not a regular file" in output
    assert ready_seconds < 15 and peak < 200 << 20
    assert max(len(line) for line in agent.lines) < 2000  # no expanded document in a line
    assert output.count("bomb.yaml could not be read") == 1  # reported once, not every pass


def test_a_region_defined_in_two_files_is_an_error_naming_both(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    write_regions(regions, "a.yaml", tenant_manifest("kept"))
    write_regions(regions, "c.yaml", tenant_manifest("twice"))
    write_regions(regions, "d.yaml", tenant_manifest("twice", blocks=32))
    with RunningAgent(regions, shm_dir / "root", "--no-http") as agent:
        agent.saw("tenant/kept  Ready")
        agent.saw("region tenant/twice is defined in both c.yaml and d.yaml")
        write_regions(regions, "b.yaml", tenant_manifest("kept", blocks=32), tenant_manifest("new"))
        agent.saw("region tenant/kept is defined in both a.yaml and b.yaml")
        agent.saw("tenant/new  Ready")
        # the existing region is kept as it was, not resized to either definition
        agent.saw("spec refused, the region is kept as it was")
        assert "tenant/twice" not in agent.output().replace("region tenant/twice is defined", "")
        (regions / "d.yaml").unlink()
        agent.saw("tenant/twice  Ready")
    assert (shm_dir / "root/tenant/twice/vllm_offload_twice.mmap").stat().st_size == 2 << 20


def test_files_that_break_the_parser_are_each_one_problem_and_once_still_finishes(
    shm_dir: Path,
) -> None:
    """A 10 KB file of nested lists (too deep for the YAML composer) and metadata the API
    server would never hold (generation 'abc' or [1], uid [1]) are each reported as their
    file's problem; the good region is created and `--once` exits."""
    regions = shm_dir / "regions"
    regions.mkdir()
    write_regions(regions, "good.yaml", tenant_manifest("good"))
    (regions / "deep.yaml").write_text("[" * 5000 + "]" * 5000 + "\n")
    for name, metadata in (
        ("word", {"generation": "abc"}),
        ("list", {"generation": [1]}),
        ("negative", {"generation": -1}),
        ("uid", {"uid": [1]}),
    ):
        document = tenant_manifest(name)
        document["metadata"].update(metadata)
        write_regions(regions, f"{name}.yaml", document)
    done = subprocess.run(
        local_agent(regions, shm_dir / "root", "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "tenant/good  Ready" in output
    assert (shm_dir / "root/tenant/good/vllm_offload_good.mmap").exists()
    assert "deep.yaml is nested too deeply to be read as YAML" in output
    assert "metadata.generation must be an integer from 0 to" in output
    assert "got 'abc'" in output and "got [1]" in output and "got -1" in output
    assert "metadata.uid must be a string" in output
    assert "reconcile pass failed" not in output and "Traceback" not in output
    for name in ("word", "list", "negative", "uid"):
        assert not (shm_dir / f"root/tenant/{name}").exists()
