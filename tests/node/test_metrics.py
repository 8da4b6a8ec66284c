"""The metrics read through the chart's Services from another pod, as Prometheus reads them: a
real Prometheus in its own namespace scraping the Services the chart's ServiceMonitors select,
at their ports and paths, by their cluster DNS names, with the chart's PrometheusRule groups as
its rules."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.envtest.chart import render_chart
from tests.node.chart import CHART, Release, wait
from tests.node.node import Node
from tests.node.regions import apply_manifest, region_phase, remove_regions

MONITORING = "monitoring"
DEMO = CHART.parents[1] / "examples" / "regions" / "demo.yaml"


def service_jobs(services: list[dict[str, Any]], monitors: list[dict[str, Any]]) -> list[dict]:
    """A scrape job per Service that a ServiceMonitor selects, at the monitor's port and path:
    the Service's name resolved by the cluster's DNS, so the scrape crosses kube-dns and
    kube-proxy from Prometheus's pod. (Debian's Prometheus has no Kubernetes discovery.)"""
    jobs = []
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        [endpoint] = monitor["spec"]["endpoints"]
        for service in services:
            if selector.items() <= service["metadata"]["labels"].items():
                name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
                [port] = [
                    p["port"] for p in service["spec"]["ports"] if p["name"] == endpoint["port"]
                ]
                jobs.append(
                    {
                        "job_name": name,
                        "metrics_path": endpoint.get("path", "/metrics"),
                        "dns_sd_configs": [
                            {
                                "names": [f"{name}.{namespace}.svc.cluster.local"],
                                "type": "A",
                                "port": port,
                                "refresh_interval": "5s",
                            }
                        ],
                    }
                )
    return jobs


def _manifests(namespace: str) -> tuple[list[dict], list[dict], list[dict]]:
    """The chart's Services, ServiceMonitors and PrometheusRules as rendered where the
    Prometheus Operator's API is served."""
    rendered = render_chart(namespace, extra_args=["--api-versions", "monitoring.coreos.com/v1"])
    services = [o for o in rendered if o["kind"] == "Service"]
    monitors = [o for o in rendered if o["kind"] == "ServiceMonitor"]
    rules = [o for o in rendered if o["kind"] == "PrometheusRule"]
    assert services and monitors and rules
    return services, monitors, rules


def _prometheus_objects(image: str, config: str, rules: str) -> list[dict[str, Any]]:
    labels = {"app": "prometheus"}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": "prometheus", "namespace": MONITORING}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": "node-tier-prometheus"},
         "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": "node-tier-prometheus"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": "node-tier-prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus",
                       "namespace": MONITORING}]},
        {"apiVersion": "v1", "kind": "ConfigMap",
         "metadata": {"name": "prometheus", "namespace": MONITORING},
         "data": {"prometheus.yml": config, "kvshm-rules.yml": rules}},
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "prometheus", "namespace": MONITORING, "labels": labels},
         "spec": {
             "serviceAccountName": "prometheus",
             "containers": [{
                 "name": "prometheus", "image": image, "imagePullPolicy": "Never",
                 "args": ["--config.file=/etc/prometheus/prometheus.yml",
                          "--storage.tsdb.path=/prometheus", "--web.listen-address=:9090"],
                 "ports": [{"name": "web", "containerPort": 9090}],
                 "volumeMounts": [{"name": "config", "mountPath": "/etc/prometheus"},
                                  {"name": "data", "mountPath": "/prometheus"}],
             }],
             "volumes": [{"name": "config", "configMap": {"name": "prometheus"}},
                         {"name": "data", "emptyDir": {}}],
         }},
    ]  # fmt: skip


@pytest.fixture
def prometheus(
    node: Node, kvshm_image: str, prometheus_image: str, helm_home: Path
) -> Iterator[str]:
    """The chart installed, a region Ready, and Prometheus scraping them; yields its URL."""
    release = Release(node, helm_home)
    release.install()
    release.wait_ready()
    apply_manifest(node, DEMO.read_text())
    wait(lambda: region_phase(node, "default", "demo") == "Ready", 120, "demo Ready", node)
    services, monitors, rules = _manifests(release.namespace)
    config = yaml.safe_dump(
        {
            "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
            "rule_files": ["/etc/prometheus/kvshm-rules.yml"],
            "scrape_configs": service_jobs(services, monitors),
        }
    )
    groups = yaml.safe_dump({"groups": [g for r in rules for g in r["spec"]["groups"]]})
    node.kubectl("create", "namespace", MONITORING)
    for manifest in _prometheus_objects(prometheus_image, config, groups):
        apply_manifest(node, yaml.safe_dump(manifest))
    pod = wait(
        lambda: (p := _pod(node)) and p["status"].get("podIP") and p["status"].get("phase")
        == "Running" and p,
        120, "Prometheus running", node,
    )  # fmt: skip
    yield f"http://{pod['status']['podIP']}:9090"
    node.kubectl("delete", "namespace", MONITORING, "--wait=true", timeout=180)
    node.kubectl("delete", "clusterrole,clusterrolebinding", "node-tier-prometheus")
    remove_regions(node)
    release.uninstall()


def _pod(node: Node) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(
        node.kubectl("get", "pod", "prometheus", "-n", MONITORING, "-o", "json")
    )
    return found


def _query(url: str, expression: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expression})
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as response:
            body = json.load(response)
    except OSError:
        return []
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_prometheus_scrapes_the_agent_and_the_operator_through_their_services(
    node: Node, prometheus: str
) -> None:
    up = wait(
        lambda: len(r := _query(prometheus, "up == 1")) >= 2 and r,
        120, "both targets up", node,
    )  # fmt: skip
    jobs = {r["metric"]["job"]: r["metric"] for r in up}
    assert set(jobs) == {"kvshm-agent", "kvshm-operator"}, up
    assert _query(prometheus, 'kvshm_agent_info{job="kvshm-agent"}')
    ready = wait(
        lambda: _query(prometheus, 'kvshm_agent_regions{phase="Ready"} == 1'),
        60,
        "the agent's region gauge",
        node,
    )
    assert ready, ready
    assert wait(
        lambda: _query(prometheus, '{job="kvshm-operator", __name__=~"kvshm_operator_.+"}'),
        60, "the operator's metrics", node,
    )  # fmt: skip
    # the chart's rules load and evaluate against these metrics
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{prometheus}/api/v1/rules", timeout=10) as response:
            groups = json.load(response)["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        time.sleep(2)
    assert rules and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ]
    firing = [r["name"] for r in rules if r.get("state") == "firing"]
    assert firing == [], firing
