"""The operator's own API writes: every write to a region (its finalizer and status), marking
retained files in OffloadNodes, deleting an OffloadNode whose node is gone.

kopf patches an object only as its handlers' bookkeeping asks, in patches of its own; kvshm
writes regions itself so that each write is one it chose (docs/operator.md, the write budget).
It is the kubernetes client, configured the way kopf's default login configures it
(in-cluster, else kubeconfig), called in worker threads so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, cast

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from kvshm.api.messages import status_message
from kvshm.api.requests import REQUEST_TIMEOUT

# spec.retained is a list written whole; edits are read-modify-write, made safe by sending
# the resourceVersion read (a conflict means someone wrote in between: read again).
SpecEdit = Callable[[Mapping[str, Any]], dict[str, Any] | None]
CONFLICT_RETRIES = 5
# The server's answers that the same write would get again: 422 Invalid (the CRD's bounds),
# 413 too large (the object's size limit).
REFUSED_STATUSES = frozenset({413, 422})
# requests in flight at once (a burst of regions queues here, not in the API server)
WRITE_THREADS = 4
JSON_PATCH = "application/json-patch+json"
# a JSON patch whose `test` failed: the object changed meanwhile, its next event decides again
TEST_FAILED = 422


def client_configuration() -> Any:
    """The kubernetes client's configuration as kopf's default login finds it: in-cluster,
    else the kubeconfig ($KUBECONFIG read now: the client library reads it only at import)."""
    import kubernetes

    configuration = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
        )
    return configuration


class SpecRefused(Exception):
    """A spec change that cannot be made as it is: the server refused it, or the edit found a
    bound it would cross. Retrying the same change cannot help; the message says why."""


class ClusterWriter(Protocol):
    async def edit_offload_node_spec(self, name: str, edit: SpecEdit) -> bool:
        """Apply edit(current spec) -> spec merge patch (None: nothing to do) to an OffloadNode.

        False if the OffloadNode does not exist; SpecRefused if the edit or the server refuses.
        """

    async def delete_offload_node(self, name: str) -> bool:
        """Delete an OffloadNode; False if it was already gone."""

    async def json_patch(
        self, plural: str, namespace: str | None, name: str, ops: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any] | None:
        """A JSON patch (its `test` ops are its only preconditions) of a region or OffloadNode;
        the object as written, or None if it is gone or a test failed (it changed meanwhile)."""

    async def patch_region_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """A merge patch of a region's status; the region as written, None if it is gone."""


class KubernetesClientWriter:
    """ClusterWriter over the official kubernetes client."""

    def __init__(self, request_timeout: tuple[float, float] = REQUEST_TIMEOUT) -> None:
        import kubernetes

        configuration = client_configuration()
        configuration.connection_pool_maxsize = WRITE_THREADS
        client = kubernetes.client.ApiClient(configuration)
        self._api = kubernetes.client.CustomObjectsApi(client)
        self._api_error = kubernetes.client.ApiException
        self._threads = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="kvshm-write")
        self._timeout = request_timeout  # a hung server holds a write thread this long at most

    async def _call(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn)

    async def edit_offload_node_spec(self, name: str, edit: SpecEdit) -> bool:
        return bool(await self._call(lambda: self._edit(name, edit)))

    async def json_patch(
        self, plural: str, namespace: str | None, name: str, ops: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any] | None:
        def patch() -> dict[str, Any] | None:
            body = [dict(op) for op in ops]
            try:
                if namespace is None:
                    result = self._api.patch_cluster_custom_object(
                        GROUP,
                        VERSION,
                        plural,
                        name,
                        body,
                        _content_type=JSON_PATCH,
                        _request_timeout=self._timeout,
                    )
                else:
                    result = self._api.patch_namespaced_custom_object(
                        GROUP,
                        VERSION,
                        namespace,
                        plural,
                        name,
                        body,
                        _content_type=JSON_PATCH,
                        _request_timeout=self._timeout,
                    )
            except self._api_error as exc:
                if exc.status in (404, TEST_FAILED):
                    return None
                raise
            return cast(dict[str, Any], result)

        return cast(dict[str, Any] | None, await self._call(patch))

    async def patch_region_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        def patch() -> dict[str, Any] | None:
            try:
                result = self._api.patch_namespaced_custom_object_status(
                    GROUP,
                    VERSION,
                    namespace,
                    REGION_PLURAL,
                    name,
                    {"status": dict(status)},
                    _request_timeout=self._timeout,
                )
            except self._api_error as exc:
                if exc.status == 404:
                    return None
                raise
            return cast(dict[str, Any], result)

        return cast(dict[str, Any] | None, await self._call(patch))

    async def delete_offload_node(self, name: str) -> bool:
        def delete() -> bool:
            try:
                self._api.delete_cluster_custom_object(
                    GROUP, VERSION, NODE_PLURAL, name, _request_timeout=self._timeout
                )
            except self._api_error as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        return bool(await self._call(delete))

    def _edit(self, name: str, edit: SpecEdit) -> bool:
        for _ in range(CONFLICT_RETRIES):
            try:
                current = cast(
                    dict[str, Any],
                    self._api.get_cluster_custom_object(
                        GROUP, VERSION, NODE_PLURAL, name, _request_timeout=self._timeout
                    ),
                )
            except self._api_error as exc:
                if exc.status == 404:
                    return False
                raise
            spec_patch = edit(current.get("spec") or {})
            if spec_patch is None:
                return True
            version = current["metadata"]["resourceVersion"]
            body = {"metadata": {"resourceVersion": version}, "spec": spec_patch}
            try:
                self._api.patch_cluster_custom_object(
                    GROUP, VERSION, NODE_PLURAL, name, body, _request_timeout=self._timeout
                )
            except self._api_error as exc:
                if exc.status == 409:
                    continue
                if exc.status == 404:
                    return False
                if exc.status in REFUSED_STATUSES:
                    raise SpecRefused(
                        f"the API server refused the change to OffloadNode {name}: "
                        f"{exc.status} {status_message(exc.body) or exc.reason}"
                    ) from exc
                raise
            return True
        raise RuntimeError(f"OffloadNode {name} kept changing: gave up after {CONFLICT_RETRIES}")
