#!/usr/bin/env python3
"""Writes charts/kvshm/README.md (what `helm show readme` prints) from Chart.yaml and the
comments of values.yaml: every value's key, default and the comment above it.

    scripts/chart-readme.py          # rewrite the README
    scripts/chart-readme.py --check  # exit 1 if it differs from what would be written

tests/charts/test_readme.py runs --check, so the README cannot drift from values.yaml.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[1] / "charts" / "kvshm"
README = CHART / "README.md"
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")

INTRO = """\
# kvshm

{description}

Chart {version}, kvshm {app_version}, Kubernetes {kube_version}. Source and documentation:
{home} (docs/deploy.md: every object and why; docs/uninstall.md: removing it).

## Install

```sh
helm install kvshm oci://ghcr.io/kvshm/charts/kvshm --version {version} \\
    -n kvshm-system --create-namespace -f values-production.yaml
helm test kvshm -n kvshm-system --logs
```

`values-production.yaml` (in this chart) runs the agents on NVIDIA GPU nodes, tolerating their
taint, with the Prometheus Operator's monitors. Where Pod Security Admission enforces a level,
create the namespace first with the `privileged` level: the agent mounts a hostPath.

## Values

Generated from the comments in `values.yaml` by `scripts/chart-readme.py`;
`values.schema.json` checks every value's type, so a typo fails `helm install`.

| key | default | description |
|---|---|---|
"""


def values_rows(text: str) -> list[tuple[str, str, str]]:
    """(dotted key, default as JSON, description) for every leaf value, in file order."""
    values = yaml.safe_load(text)
    rows: list[tuple[str, str, str]] = []
    stack: list[tuple[int, str]] = []
    comment: list[str] = []
    item_indent: int | None = None  # the indent of a block list's "- ", while inside its item
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            comment = []
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        indent = len(line) - len(line.lstrip(" "))
        if stripped.startswith("- ") or (item_indent is not None and indent > item_indent):
            # an item of a block list, keys of its maps included: part of the list's default
            if stripped.startswith("- "):
                item_indent = indent
            comment = []
            continue
        item_indent = None
        match = KEY.match(line)
        if match is None:  # a line of a block list or a continued value
            comment = []
            continue
        indent = len(match["indent"])
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = [key for _, key in stack] + [match["key"]]
        default = _lookup(values, path)
        if match["rest"].strip() or not isinstance(default, dict) or not default:
            rows.append((".".join(path), json.dumps(default), " ".join(comment)))
        else:
            stack.append((indent, match["key"]))
            if comment:
                rows.append((".".join(path), "", " ".join(comment)))
        comment = []
    return rows


def _lookup(values: Any, path: list[str]) -> Any:
    for key in path:
        values = values[key]
    return values


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    out = INTRO.format(
        description=" ".join(chart["description"].split()),
        version=chart["version"],
        app_version=chart["appVersion"],
        kube_version=chart["kubeVersion"].replace("-0", ""),
        home=chart["home"],
    )
    for key, default, description in values_rows((CHART / "values.yaml").read_text()):
        shown = f"`{_cell(default)}`" if default else ""
        out += f"| `{key}` | {shown} | {_cell(description)} |\n"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the README is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not README.exists() or README.read_text() != text:
            print(f"{README} is stale: run scripts/chart-readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
