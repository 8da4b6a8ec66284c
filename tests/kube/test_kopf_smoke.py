"""The real kopf runtime, in this test's loop, sees an OffloadRegion and patches its status."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, cast

import kopf
import kubernetes

from tests.kube.runner import KubeApi

REGION = {
    "apiVersion": "kvshm.dev/v1alpha1",
    "kind": "OffloadRegion",
    "metadata": {"name": "smoke"},
    "spec": {"layout": {"numBlocks": 8, "cpuPageSize": 4096, "numWorkers": 2}},
}


def trivial_operator() -> kopf.OperatorRegistry:
    """Its own registry: handlers other tests imported into kopf's default one stay out."""
    registry = kopf.OperatorRegistry()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        return kopf.login_via_client(**kwargs)  # reads the kubeconfig, as in production

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.watching.server_timeout = 5
        settings.posting.enabled = False

    @kopf.on.create("kvshm.dev", "v1alpha1", "offloadregions", registry=registry)
    def created(spec: kopf.Spec, patch: kopf.Patch, **_: Any) -> None:
        layout = spec["layout"]
        patch.status["phase"] = "Provisioning"
        patch.status["sizeBytes"] = (
            layout["numBlocks"] * layout["cpuPageSize"] * layout["numWorkers"]
        )

    return registry


def read_region(kube_api: KubeApi) -> dict[str, Any]:
    with kube_api.api_client() as client:
        obj = kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
            "kvshm.dev", "v1alpha1", "default", "offloadregions", "smoke"
        )
    return cast(dict[str, Any], obj)


def create_region(kube_api: KubeApi) -> None:
    with kube_api.api_client() as client:
        kubernetes.client.CustomObjectsApi(client).create_namespaced_custom_object(
            "kvshm.dev", "v1alpha1", "default", "offloadregions", REGION
        )


async def test_kopf_sees_a_region_and_patches_its_status(
    kube_api: KubeApi, kubeconfig: Path
) -> None:
    stop = asyncio.Event()
    operator = asyncio.create_task(
        kopf.operator(
            registry=trivial_operator(),
            standalone=True,
            clusterwide=True,
            stop_flag=stop,
        )
    )
    try:
        # the client is synchronous: keep it off this loop, where kopf runs
        await asyncio.to_thread(create_region, kube_api)
        status: dict[str, Any] = {}
        async with asyncio.timeout(30):
            while status.get("phase") != "Provisioning":
                await asyncio.sleep(0.05)
                status = (await asyncio.to_thread(read_region, kube_api)).get("status") or {}
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(operator, 10)
    assert status["sizeBytes"] == 8 * 4096 * 2
    assert operator.exception() is None
    assert kube_api.handler.failures == []
