"""helm template, cached: the chart rendered for each example values file."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.charts.tools import CHART, run, tool
from tests.envtest.chart import load_documents

MONITORING_API = "monitoring.coreos.com/v1"
# every values file a user is pointed at: the defaults and the examples in ci/
EXAMPLE_VALUES: tuple[Path | None, ...] = (
    None,
    CHART / "values-production.yaml",
    *sorted((CHART / "ci").glob("*.yaml")),
)


def values_id(values: Path | None) -> str:
    return "defaults" if values is None else values.stem


def helm_args(values: Path | None, sets: tuple[str, ...] = ()) -> list[str]:
    """--values, and each "key=<YAML value>" as --set-json (so 0.25 stays a number)."""
    args = [] if values is None else ["--values", str(values)]
    for item in sets:
        key, _, value = item.partition("=")
        args += ["--set-json", f"{key}={json.dumps(yaml.safe_load(value))}"]
    return args


@functools.cache
def render(
    values: Path | None = None,
    *,
    monitoring: bool = True,
    sets: tuple[str, ...] = (),
    include_crds: bool = False,
    api_versions: tuple[str, ...] = (),
) -> tuple[dict[str, Any], ...]:
    """Every object of `helm template` (hooks and test pods included; a List's items in its
    place); api_versions: more APIs the cluster serves (group/version/Kind), as `helm install`
    finds them."""
    args = [tool("helm"), "template", "kvshm", str(CHART), "--namespace", "kvshm-system"]
    args += helm_args(values, sets)
    if monitoring:
        args += ["--api-versions", MONITORING_API]
    for api in api_versions:
        args += ["--api-versions", api]
    if include_crds:
        args.append("--include-crds")
    result = run(*args)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    return tuple(load_documents(result.stdout))


def find(objects: tuple[dict[str, Any], ...], kind: str, name_suffix: str = "") -> dict[str, Any]:
    """The one object of this kind whose name ends with name_suffix."""
    matches = [
        obj
        for obj in objects
        if obj["kind"] == kind and obj["metadata"]["name"].endswith(name_suffix)
    ]
    assert len(matches) == 1, f"expected one {kind} *{name_suffix}, got {len(matches)}"
    return matches[0]


def pod_specs(objects: tuple[dict[str, Any], ...]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload, Job and bare Pod."""
    for obj in objects:
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] == "Pod":
            yield name, obj["spec"]
        elif obj["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            yield name, obj["spec"]["template"]["spec"]


def load_yaml_documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc]
