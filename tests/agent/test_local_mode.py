"""Local mode end to end: `python -m kvshm.agent.cli --local DIR` as a user runs it."""

from __future__ import annotations

import ctypes
import resource
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path

import yaml

from tests.agent.builders import local_agent, manifest
from tests.agent.cluster import REPO
from tests.waiting import wait_for

EXAMPLES = REPO / "examples" / "regions"


def write(regions: Path, name: str, *documents: dict[str, object]) -> None:
    (regions / name).write_text(yaml.safe_dump_all(documents))


def test_once_reconciles_the_examples_and_prints_a_table(shm_dir: Path) -> None:
    root = shm_dir / "root"
    done = subprocess.run(
        local_agent(EXAMPLES, root, "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            metadata = document["metadata"]
            key = f"{metadata.get('namespace', 'default')}/{metadata['name']}"
            instance = document["spec"].get("instanceId", metadata["name"])
            file = root / key / f"vllm_offload_{instance}.mmap"
            layout = document["spec"]["layout"]
            size = layout["numBlocks"] * layout["cpuPageSize"] * layout.get("numWorkers", 1)
            assert file.stat().st_size == size
            assert f"{key}  Ready" in done.stdout
    assert "REGION" in done.stdout and "PHASE" in done.stdout


def test_once_exits_1_and_says_why_when_a_region_fails(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    write(regions, "r.yaml", manifest("odd", "default"))
    root = shm_dir / "root"
    (root / "default" / "odd").mkdir(parents=True)
    (root / "default" / "odd" / "vllm_offload_odd.mmap").write_bytes(b"1234")
    for each in (root, root / "default"):
        each.chmod(0o711)
    done = subprocess.run(
        local_agent(regions, root, "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "default/odd  Failed" in done.stdout
    assert "is 4 bytes but the layout needs 2097152 bytes" in done.stdout


def test_a_running_agent_follows_the_directory(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = shm_dir / "root"
    write(regions, "a.yaml", manifest("first", "default"))
    process = subprocess.Popen(
        local_agent(regions, root, "--port", "0", "--drain-grace-seconds", "1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        url = banner.split("metrics on ")[1].strip()

        def saw(text: str) -> bool:
            while not any(text in line for line in lines):
                line = process.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    return False
                lines.append(line)
            return True

        assert saw("default/first  Ready")
        first = root / "default" / "first" / "vllm_offload_first.mmap"
        assert first.exists()
        metrics = urllib.request.urlopen(url, timeout=5).read().decode()
        assert 'kvshm_agent_region_phase{phase="Ready",region="default/first"} 1.0' in metrics
        # a half-written file keeps what the good one had
        (regions / "a.yaml").write_text("apiVersion: [unclosed")
        assert saw("could not be read as YAML")
        assert first.exists()
        # a new file adds a region, removing a file drains and removes its region
        write(regions, "b.yaml", manifest("second", "team"))
        assert saw("team/second  Ready")
        (regions / "a.yaml").unlink()
        assert saw("default/first  Removed")
        assert not first.exists() and not (root / "default").exists()
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=20)
        lines.extend(out.splitlines(keepends=True))
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0
    # stopping released nothing, and the final table says what is there
    assert (root / "team" / "second" / "vllm_offload_second.mmap").exists()
    table = "".join(lines)
    assert "team/second    Ready" in table or "team/second  Ready" in table


def test_sigkill_mid_populate_then_restart_adopts(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    root = shm_dir / "root"
    write(regions, "big.yaml", manifest("big", "default", blocks=192, page=1 << 20, workers=1))
    slow = local_agent(
        regions, root, "--no-http", "--populate-threads", "1", "--populate-rate", "64Mi"
    )
    process = subprocess.Popen(slow, stdout=subprocess.PIPE, text=True)
    path = root / "default" / "big" / "vllm_offload_big.mmap"
    try:
        wait_for(lambda: path.exists() and path.stat().st_blocks > 0, 30, "populating")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        process.kill()
    partial = path.stat().st_blocks * 512
    assert 0 < partial < 192 << 20
    inode = path.stat().st_ino
    done = subprocess.run(
        local_agent(regions, root, "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout
    assert "default/big  Adopted" in done.stdout
    assert path.stat().st_ino == inode and path.stat().st_blocks * 512 >= 192 << 20


def test_bad_arguments_and_roots_are_refused_with_a_reason(shm_dir: Path) -> None:
    planted = shm_dir / "planted"
    planted.symlink_to("/etc")
    done = subprocess.run(
        local_agent(EXAMPLES, planted, "--once", "--no-http"), capture_output=True, text=True
    )
    assert done.returncode == 2 and "symbolic link" in done.stderr
    missing = subprocess.run(
        local_agent(shm_dir / "nope", shm_dir / "root", "--once", "--no-http"),
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "is not a directory" in missing.stderr


def _without_ipc_lock() -> None:
    """In the child before exec: drop CAP_IPC_LOCK from the bounding set (so even root is held
    to RLIMIT_MEMLOCK after exec) and lower that limit to 1 MiB."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_ipc_lock = 24, 14
    if libc.prctl(pr_capbset_drop, cap_ipc_lock, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))


def test_a_refused_mlock_leaves_the_region_ready_and_says_so(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    write(regions, "r.yaml", manifest("unlocked", "default", blocks=8, page=1 << 20, workers=2))
    done = subprocess.run(
        local_agent(regions, shm_dir / "root", "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=_without_ipc_lock,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "default/unlocked  LockFailed" in done.stdout
    assert "default/unlocked  Ready  16.0 MiB" in done.stdout and "not locked" in done.stdout
    assert "IPC_LOCK" in done.stdout  # the message says what to grant


def _without_dac_override() -> None:
    """In the child before exec: root without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_missing_privileges_fail_the_region_with_what_to_grant(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    write(regions, "r.yaml", manifest("owned", "team", access={"uid": 4321, "gid": 4321}))
    for attempt in ("creating", "after a restart"):
        done = subprocess.run(
            local_agent(regions, shm_dir / "root", "--once", "--no-http"),
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=_without_dac_override,
        )
        assert done.returncode == 1, f"{attempt}: {done.stdout}{done.stderr}"
        assert "team/owned  Failed" in done.stdout, attempt
        assert "needs CAP_DAC_OVERRIDE" in done.stdout, attempt
        assert "Traceback" not in done.stderr, attempt


def test_a_busy_metrics_port_is_refused_with_what_to_do(shm_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            local_agent(EXAMPLES, shm_dir / "root", "--once", "--port", str(port)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"cannot serve /metrics on 127.0.0.1:{port}" in done.stderr and "--port 0" in done.stderr
    assert "Traceback" not in done.stderr
