"""The chart's README (what `helm show readme` prints) is generated from values.yaml's comments
and is up to date, and every value is described there, by its own comment or its group's."""

from __future__ import annotations

import importlib.util
import sys

from tests.charts.tools import CHART, REPO, run, tool

GENERATOR = REPO / "scripts" / "chart-readme.py"


def test_the_chart_readme_is_generated_from_values_yaml() -> None:
    result = run(sys.executable, str(GENERATOR), "--check")
    assert result.returncode == 0, result.stderr
    shown = run(tool("helm"), "show", "readme", str(CHART))
    assert shown.returncode == 0 and shown.stdout.rstrip("\n") == (
        CHART / "README.md"
    ).read_text().rstrip("\n")


def test_every_value_is_described() -> None:
    spec = importlib.util.spec_from_file_location("chart_readme", GENERATOR)
    assert spec and spec.loader
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    rows = generator.values_rows((CHART / "values.yaml").read_text())
    described = {key: text for key, _, text in rows}
    bare = [
        key
        for key, default, _ in rows
        if default
        and not any(
            described.get(".".join(key.split(".")[:i])) for i in range(1, key.count(".") + 2)
        )
    ]
    assert bare == [], f"values.yaml keys with no comment of their own or of their group: {bare}"
