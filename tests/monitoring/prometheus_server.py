"""A real Prometheus server (Debian's binary from .tools/bin) on a free 127.0.0.1 port, with a
temporary configuration and storage, scraping the given targets every second."""

from __future__ import annotations

import json
import math
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.charts.tools import tool
from tests.monitoring.processes import Background, free_port, http_ok, http_text, wait_for

SCRAPE_INTERVAL = "1s"


class PrometheusServer:
    def __init__(self, work_dir: Path, jobs: Mapping[str, tuple[str, Mapping[str, str]]]) -> None:
        """jobs: job name -> (host:port, target labels)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [
                {
                    "job_name": job,
                    "scrape_timeout": SCRAPE_INTERVAL,
                    "static_configs": [{"targets": [address], "labels": dict(labels)}],
                }
                for job, (address, labels) in jobs.items()
            ],
        }
        config_path = work_dir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.process = Background(
            "prometheus",
            [
                tool("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={work_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            work_dir,
        )
        wait_for("Prometheus to be ready", lambda: http_ok(f"{self.url}/-/ready"), 30, self.process)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        body = json.loads(http_text(f"{self.url}/api/v1/{path}?{query}"))
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; a PromQL error raises (HTTP 400)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        result: list[dict[str, Any]] = data["result"]
        return result

    def finite_values(self, expr: str) -> list[float]:
        values = [float(sample["value"][1]) for sample in self.query(expr)]
        return [v for v in values if math.isfinite(v)]

    def targets_up(self) -> dict[str, bool]:
        targets = self.api("targets")["activeTargets"]
        return {t["labels"]["job"]: t["health"] == "up" for t in targets}

    def stop(self) -> None:
        self.process.stop()
