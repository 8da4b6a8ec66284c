"""The few API calls the operator makes to objects other than the one a handler runs for.

kopf patches the handled object itself; marking retained files in other OffloadNodes, or
deleting an OffloadNode whose node is gone, needs a client. It is the kubernetes client,
configured the way kopf's default login configures it (in-cluster, else kubeconfig), called in a
worker thread so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol, cast

from kvshm.api import GROUP, NODE_PLURAL, VERSION
from kvshm.api.messages import status_message

# spec.retained is a list written whole; edits are read-modify-write, made safe by sending
# the resourceVersion read (a conflict means someone wrote in between: read again).
SpecEdit = Callable[[Mapping[str, Any]], dict[str, Any] | None]
CONFLICT_RETRIES = 5
# The server's answers that the same write would get again: 422 Invalid (the CRD's bounds),
# 413 too large (the object's size limit).
REFUSED_STATUSES = frozenset({413, 422})


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


class KubernetesClientWriter:
    """ClusterWriter over the official kubernetes client."""

    def __init__(self) -> None:
        import kubernetes

        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException:
            # KUBECONFIG is read now: the client library reads it only once, at its import
            kubernetes.config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        client = kubernetes.client.ApiClient(configuration)
        self._api = kubernetes.client.CustomObjectsApi(client)
        self._api_error = kubernetes.client.ApiException

    async def edit_offload_node_spec(self, name: str, edit: SpecEdit) -> bool:
        return await asyncio.to_thread(self._edit, name, edit)

    async def delete_offload_node(self, name: str) -> bool:
        def delete() -> bool:
            try:
                self._api.delete_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, name)
            except self._api_error as exc:
                if exc.status == 404:
                    return False
                raise
            return True

        return await asyncio.to_thread(delete)

    def _edit(self, name: str, edit: SpecEdit) -> bool:
        for _ in range(CONFLICT_RETRIES):
            try:
                current = cast(
                    dict[str, Any],
                    self._api.get_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, name),
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
                self._api.patch_cluster_custom_object(GROUP, VERSION, NODE_PLURAL, name, body)
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
