"""The Dockerfile (the agent/operator image the chart runs): hadolint-clean with the repository's
config, pinned base, non-root default user, OCI labels, no torch in what it installs, the tested
versions of its dependencies, and a build context without the local environment."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.charts.tools import REPO, run, tool
from tests.source_roots import SOURCE_ROOTS

DOCKERFILE = REPO / "Dockerfile"
CONFIG = REPO / ".hadolint.yaml"
CONSTRAINTS = REPO / "constraints" / "runtime.txt"
DOCKERIGNORE = REPO / ".dockerignore"
SERVING_DOCKERFILE = REPO / "examples" / "serving" / "Dockerfile"
IMAGE_EXTRAS = ("agent", "operator")


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
    assert "transfer" not in installed.group(1) and "vllm" not in installed.group(1)


def _installed_closure(requirements: list[Requirement]) -> dict[str, str]:
    """name -> installed version of these requirements and everything they pull in, as pip
    resolves them here (markers evaluated for this interpreter, extras followed)."""
    versions: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending = list(requirements)
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        distribution = metadata.distribution(name)
        versions[name] = distribution.version
        for line in distribution.requires or ():
            dependency = Requirement(line)
            extras = ["", *requirement.extras]
            if dependency.marker is None or any(
                dependency.marker.evaluate({"extra": extra}) for extra in extras
            ):
                pending.append(dependency)
    return versions


def _image_requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in IMAGE_EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_constraints_are_the_tested_versions_of_the_runtime_dependencies_only() -> None:
    """constraints/runtime.txt pins exactly what the image installs, at the versions installed
    here (where the tests ran): no test or serving-pod package, none missing, none stale."""
    tested = _installed_closure(_image_requirements())
    wanted = [f"{name}=={version}" for name, version in sorted(tested.items())]
    pinned = [
        line.strip()
        for line in CONSTRAINTS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert pinned == wanted, "constraints/runtime.txt should list:\n" + "\n".join(wanted)


def test_the_build_installs_with_the_constraints() -> None:
    build = "\n".join(_stages()[0])
    relative = CONSTRAINTS.relative_to(REPO).as_posix()
    assert re.search(rf"^COPY {re.escape(relative)} ", build, re.MULTILINE), build
    assert re.search(rf'pip install [^"]*--constraint {re.escape(relative)} "\.\[', build), build


def test_the_runtime_venv_keeps_no_installer() -> None:
    """pip and setuptools (which `python -m venv` puts into the venv) are not in the final
    image: nothing runs them there, and they are code an attacker could use."""
    build = "\n".join(_stages()[0])
    assert re.search(r"/opt/kvshm/bin/python -m pip uninstall --yes pip setuptools", build)


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves `path` (relative, '/'-separated) out of the build context:
    the last matching pattern wins, '!' re-includes, a pattern matches a path or its parents."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.removeprefix("!").strip("/")
        globs = [glob.removeprefix("**/")] if glob.startswith("**/") else [glob]
        matches = any(
            fnmatch.fnmatchcase(candidate, g)
            or (glob.startswith("**/") and fnmatch.fnmatchcase(candidate.rsplit("/", 1)[-1], g))
            for candidate in candidates
            for g in globs
        )
        if matches:
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    lines = DOCKERIGNORE.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize(
    "path",
    [
        ".venv",
        ".tools/bin/helm",
        ".git",
        "agent/kvshm/__pycache__/x.pyc",
        ".mypy_cache",
        ".ruff_cache",
        ".pytest_cache",
        "bench/results/run.json",
    ],
)
def test_the_build_context_leaves_out_the_local_environment(path: str) -> None:
    assert _ignored(path, _dockerignore()), path


def _copied(dockerfile: Path) -> list[str]:
    return [
        source
        for line in dockerfile.read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]


def test_the_build_context_keeps_everything_the_dockerfiles_copy() -> None:
    """One context for both images (.dockerignore): the agent and operator image copies every
    source root but serving/; the serving image every root."""
    image = _copied(DOCKERFILE)
    assert {"agent", "common", "cli", "operator"} <= set(image) and "serving" not in image
    serving = _copied(SERVING_DOCKERFILE)
    roots = {root.name for root in SOURCE_ROOTS}
    assert roots <= {Path(source).name for source in serving}, serving
    kept = [*image, *serving, "agent/kvshm/agent/cli.py", "serving/kvshm/vllm/spec.py"]
    assert [path for path in kept if _ignored(path, _dockerignore())] == []
