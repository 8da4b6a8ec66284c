"""Tenant-chosen file names reach the console escaped, under any encoding."""

from __future__ import annotations

from pathlib import Path

from kvshm.api.messages import printable
from tests.agent.hostile import RunningAgent, tenant, tenant_manifest, traversable, write_regions

_HOSTILE_NAMES = r"""
import os, sys
directory = sys.argv[1].encode()
names = (b"\x1b]0;owned\x07title", b"\x1b[2Jclear", b"bad-\xff\xfe-utf8", "rtl-\u202eevil".encode())
for name in names:
    with open(os.path.join(directory, name), "wb") as f:
        f.write(b"x")
"""


def test_escape_sequences_in_file_names_are_printed_escaped_and_never_fail(
    shm_dir: Path,
) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = traversable(shm_dir) / "root"
    write_regions(regions, "victim.yaml", tenant_manifest("victim"))
    # the strictest console: ASCII, failing on anything else
    strict = {"PYTHONIOENCODING": "ascii:strict", "LANG": "C", "LC_ALL": "C"}
    with RunningAgent(regions, root, "--no-http", "--drain-grace-seconds", "1", env=strict) as a:
        a.saw("tenant/victim  Ready")
        tenant(_HOSTILE_NAMES, str(root / "tenant" / "victim"))
        (regions / "victim.yaml").unlink()
        a.saw("tenant/victim  Removed")
        write_regions(regions, "other.yaml", tenant_manifest("other"))
        a.saw("tenant/other  Ready")  # passes go on after printing the names
    output = a.output()
    assert "\x1b" not in output and "\x07" not in output and "\u202e" not in output
    assert "\\x1b]0;owned\\x07title" in output and "\\x1b[2Jclear" in output
    assert "bad-\\xff\\xfe-utf8" in output and "rtl-\\u202eevil" in output
    assert "Traceback" not in output


def test_printable_keeps_ordinary_text() -> None:
    assert printable("ns/name vllm_offload_a.mmap: größe 1.0 GiB") == (
        "ns/name vllm_offload_a.mmap: größe 1.0 GiB"
    )
    assert printable("a\nb\tc\u200bd") == "a\\x0ab\\x09c\\u200bd"
