"""The Grafana dashboards of charts/kvshm/dashboards: panels, their queries, variables, and the
substitutions Grafana makes before a query reaches Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.charts.tools import CHART

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
# what Grafana puts in place of its variables: every value of a multi-value variable
# ("All" = .*), and a rate interval of at least four scrape intervals
RATE_INTERVAL = "1m"


@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    expr: str

    @property
    def name(self) -> str:
        return f"{self.dashboard} / {self.panel} / {self.ref}"


def load(path: Path) -> dict[str, Any]:
    board: dict[str, Any] = json.loads(path.read_text())
    return board


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in board["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(rate_interval: str = RATE_INTERVAL) -> list[Query]:
    found = []
    for path in DASHBOARDS:
        board = load(path)
        for panel in panels(board):
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], rate_interval)
                found.append(Query(path.stem, panel["title"], target["refId"], expr))
    return found


def substitute(expr: str, rate_interval: str = RATE_INTERVAL) -> str:
    expr = expr.replace("$__rate_interval", rate_interval)
    # every other variable is a multi-value one matched with =~, "All" is .*
    return re.sub(r"\$\{?([a-z_]+)\}?", ".*", expr)


def variable_queries() -> list[tuple[str, str, str]]:
    """(dashboard/variable, metric, label) of every label_values(metric, label) variable."""
    found = []
    for path in DASHBOARDS:
        for variable in load(path)["templating"]["list"]:
            if variable["type"] != "query":
                continue
            match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", variable["definition"])
            assert match, f"{path.stem}/{variable['name']}: unexpected {variable['definition']}"
            found.append((f"{path.stem}/{variable['name']}", match.group(1), match.group(2)))
    return found
