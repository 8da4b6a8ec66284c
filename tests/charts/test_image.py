"""The Dockerfile (the agent/operator image the chart runs): hadolint-clean with the repository's
config, pinned base, non-root default user, OCI labels, and no torch in what it installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from tests.charts.tools import REPO, run, tool

DOCKERFILE = REPO / "Dockerfile"
CONFIG = REPO / ".hadolint.yaml"


def _hadolint(path: Path) -> tuple[int, str]:
    result = run(tool("hadolint"), "--no-color", "--config", str(CONFIG), str(path))
    return result.returncode, result.stdout + result.stderr


def test_dockerfile_passes_hadolint() -> None:
    code, output = _hadolint(DOCKERFILE)
    assert code == 0, output


def test_hadolint_config_rejects_a_root_image(tmp_path: Path) -> None:
    rooted = tmp_path / "Dockerfile"
    rooted.write_text(DOCKERFILE.read_text().replace("USER 65532:65532", "USER root"))
    code, output = _hadolint(rooted)
    assert code != 0 and "DL3002" in output


def _stages() -> list[list[str]]:
    stages: list[list[str]] = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("FROM "):
            stages.append([])
        if stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


def test_multi_stage_on_one_exactly_pinned_base() -> None:
    stages = _stages()
    assert len(stages) >= 2
    bases = {stage[0].split()[1] for stage in stages}
    assert len(bases) == 1
    [base] = bases
    assert re.fullmatch(r"python:3\.11\.\d+-slim-bookworm(@sha256:[0-9a-f]{64})?", base), base


def test_final_stage_copies_the_venv_runs_non_root_and_is_labelled() -> None:
    final = "\n".join(_stages()[-1])
    assert "COPY --from=build /opt/kvshm /opt/kvshm" in final
    users = re.findall(r"^USER (\S+)", final, re.MULTILINE)
    assert users and users[-1].split(":")[0] not in ("0", "root")
    for label in ("title", "description", "version", "revision", "licenses", "base.name"):
        assert f"org.opencontainers.image.{label}=" in final
    assert "pip" not in final  # nothing is installed in the final stage


def _requirements(extra: str, extras: dict[str, list[str]]) -> set[str]:
    """Requirement names of an extra, following kvshm[...] self-references."""
    names: set[str] = set()
    for requirement in extras[extra]:
        name = re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()
        if name == "kvshm":
            for inner in re.search(r"\[(.*)\]", requirement).group(1).split(","):  # type: ignore[union-attr]
                names |= _requirements(inner.strip(), extras)
        else:
            names.add(name)
    return names


def test_image_installs_agent_and_operator_extras_without_torch() -> None:
    build = "\n".join(_stages()[0])
    installed = re.search(r'pip install [^"]*"\.\[([a-z,]+)\]"', build)
    assert installed, "the build stage must pip install .[extras]"
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = set(extras["dependencies"])
    for extra in installed.group(1).split(","):
        names |= _requirements(extra, extras["optional-dependencies"])
    assert not {n for n in names if n.startswith(("torch", "nvidia", "triton"))}
    assert "sidecar" not in installed.group(1)
