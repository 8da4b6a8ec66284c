"""The chart's PrometheusRule as a plain Prometheus rule file, and the metric names of the
contract (docs/metrics.md) that dashboards and alerts may use."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.charts.rendering import find, render
from tests.charts.tools import REPO

METRICS_DOC = REPO / "docs" / "metrics.md"
# series Prometheus adds itself
BUILTIN_SERIES = {"up"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC_NAME = re.compile(r"\b(kvshm_[a-z0-9_]+)\b")


def rule_groups(sets: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """spec.groups of the rendered PrometheusRule (release kvshm in kvshm-system)."""
    groups: list[dict[str, Any]] = find(render(sets=sets), "PrometheusRule")["spec"]["groups"]
    return groups


def write_rule_file(directory: Path, sets: tuple[str, ...] = ()) -> Path:
    path = directory / "kvshm-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups(sets)}, sort_keys=False))
    return path


def contract_metrics() -> dict[str, str]:
    """name -> type, from the tables of docs/metrics.md."""
    metrics = {}
    for line in METRICS_DOC.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and re.fullmatch(r"kvshm_[a-z0-9_]+", cells[0]):
            metrics[cells[0]] = cells[1].split()[0]
    return metrics


def series_names(metrics: dict[str, str]) -> set[str]:
    """Every series name the contract's metrics produce (histograms: _bucket, _sum, _count)."""
    names = set(BUILTIN_SERIES)
    for name, kind in metrics.items():
        names.add(name)
        if kind == "histogram":
            names.update(name + suffix for suffix in _HISTOGRAM_SUFFIXES)
    return names


def metric_of_series(series: str, metrics: dict[str, str]) -> str:
    for suffix in _HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and metrics.get(base) == "histogram":
            return base
    return series


def names_in(expr: str) -> set[str]:
    return set(_METRIC_NAME.findall(expr)) | ({"up"} if re.search(r"\bup\{", expr) else set())
