"""The operator's entry points: importing the package registers and reads nothing; the console
script's config comes from its flags over the environment without changing it; `kopf run -m
kvshm.operator.kopf_run` registers every handler with the environment's settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshm.operator.config import ConfigError
from kvshm.operator.main import config_from, parse_args

OPERATOR_PACKAGE = Path(__file__).resolve().parents[2] / "operator" / "kvshm" / "operator"
# kopf lists a registry's handlers through no public API; these are its registries by kind.
# Its default registry also holds kopf's own login handler: only kvshm's are listed.
KVSHM_HANDLERS = """
import kopf
def kvshm_handlers(registry):
    kinds = ("_activities", "_indexing", "_watching", "_spawning", "_changing")
    return sorted(
        (kind, h.id, getattr(h, "interval", None))
        for kind in kinds
        for h in getattr(registry, kind).get_all_handlers()
        if h.fn.__module__.startswith("kvshm.")
    )
"""


def python(code: str, **environment: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_importing_every_module_but_kopf_run_registers_nothing_and_reads_no_environment() -> None:
    modules = sorted(
        f"kvshm.operator.{path.stem}"
        for path in OPERATOR_PACKAGE.glob("*.py")
        if path.stem not in ("__init__", "__main__", "kopf_run")
    )
    assert "kvshm.operator.main" in modules and "kvshm.operator.wiring" in modules
    imports = "import kvshm.operator\n" + "".join(f"import {m}\n" for m in modules)
    # a setting that fails validation: any module reading the environment at import raises
    result = python(
        imports + KVSHM_HANDLERS + "print(kvshm_handlers(kopf.get_default_registry()))",
        KVSHM_OPERATOR_MAX_WORKERS="0",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_kopf_run_module_registers_what_the_console_script_does_with_the_environment() -> None:
    code = (
        "import kvshm.operator.kopf_run\n"
        + KVSHM_HANDLERS
        + "from kvshm.operator.config import OperatorConfig\n"
        "from kvshm.operator.wiring import register\n"
        "config = OperatorConfig(region_resync_seconds=7, node_sweep_seconds=3)\n"
        "by_kopf_run = kvshm_handlers(kopf.get_default_registry())\n"
        "assert by_kopf_run == kvshm_handlers(register(kopf.OperatorRegistry(), config))\n"
        "print([entry for entry in by_kopf_run if entry[0] == '_spawning'])\n"
    )
    result = python(
        code, KVSHM_OPERATOR_REGION_RESYNC_SECONDS="7", KVSHM_OPERATOR_NODE_SWEEP_SECONDS="3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[('_spawning', 'sweep', 3.0)]"  # regions: no timer


def test_kopf_run_module_refuses_a_bad_setting_by_its_variable() -> None:
    result = python("import kvshm.operator.kopf_run", KVSHM_OPERATOR_MAX_WORKERS="-1")
    assert result.returncode != 0
    assert "KVSHM_OPERATOR_MAX_WORKERS must not be negative" in result.stderr


def test_console_script_flags_override_the_environment_and_leave_it_unchanged() -> None:
    environ = {"KVSHM_OPERATOR_ORPHAN_GRACE_SECONDS": "30", "KVSHM_OPERATOR_MAX_WORKERS": "8"}
    args = parse_args(["--orphan-grace-seconds", "90", "--orphan-dry-run"])
    before, given = dict(os.environ), dict(environ)
    config = config_from(args, environ)
    assert (config.orphan_grace_seconds, config.max_workers) == (90.0, 8)
    assert config.orphan_dry_run is True
    assert dict(os.environ) == before
    assert environ == given


def test_console_script_names_the_variable_of_a_bad_flag() -> None:
    with pytest.raises(ConfigError, match="KVSHM_OPERATOR_NODE_SWEEP_SECONDS"):
        config_from(parse_args(["--node-sweep-seconds", "0"]), {})
