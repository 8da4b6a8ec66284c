"""Plain JSON requests through a kubernetes ApiClient (its auth, TLS and timeouts).

Used for the two core calls the agent makes (read its Node, create Events): instantiating the
client's generated CoreV1Api builds validators for its hundreds of methods and costs ~20 MiB,
a quarter of the agent's memory budget.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from kvshm.api.requests import REQUEST_TIMEOUT


def request(
    api_client: client.ApiClient, method: str, path: str, body: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The decoded JSON answer; ApiException (status, reason, body) on any non-2xx."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    method, url, headers, serialized, _ = api_client.param_serialize(
        method=method,
        resource_path=path,
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    response = api_client.call_api(
        method, url, headers, serialized, _request_timeout=REQUEST_TIMEOUT
    )
    response.read()
    if not 200 <= response.status < 300:
        raise ApiException(http_resp=response)
    decoded: dict[str, Any] = json.loads(response.data or b"{}")
    return decoded
