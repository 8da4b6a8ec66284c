"""The HTTP face of the emulator: a kmock handler that serves the Store like an API server.

Reactions added with kmock's DSL (`handler['patch', kmock.resource(...)] << 500`) are tried first,
so tests can inject faults; everything else is answered from the Store.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import aiohttp.web
import attrs
import kmock

from tests.kube import discovery, routes, tables
from tests.kube.errors import ApiError, bad_request
from tests.kube.resources import ResourceType
from tests.kube.selectors import field_matcher, label_matcher
from tests.kube.store import Store, Write
from tests.kube.watching import STOP

JSON = "application/json"


@attrs.define(kw_only=True)
class KubeApiHandler(kmock.RawHandler):
    store: Store = attrs.field(factory=Store)
    failures: list[BaseException] = attrs.field(factory=list)  # emulator bugs, for test teardown

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's entry point, minus its path parser's crash on /api/v1/namespaces."""
        request = await _parse_request(raw_request, len(self._requests))
        self._requests.append(request)
        try:
            return await self._handle(request)
        except Exception as exc:  # a bug in the emulator: answer like an API server, keep it
            self.failures.append(exc)
            status = ApiError(500, "InternalError", f"emulator failure: {exc!r}").status()
            return aiohttp.web.json_response(status, status=500)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        try:
            return await super()._handle(request)  # reactions a test added, if any match
        except NotImplementedError:
            pass
        try:
            return await self._serve(request)
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        path = raw.path
        static = self._static(path, raw.host)
        if static is not None:
            if raw.method != "GET":
                raise ApiError(405, "MethodNotAllowed", f"{raw.method} is not allowed on {path}")
            return aiohttp.web.json_response(static)
        target = routes.parse(path, self.store.types)
        if target is None:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            )
        if target.plural is None:
            if target.group:
                body = discovery.api_resource_list(
                    self.store.types.values(), target.group, target.version
                )
            else:
                body = discovery.api_resource_list(self.store.types.values(), "", target.version)
            return aiohttp.web.json_response(body)
        rtype = self.store.resource(target.group, target.version, target.plural)
        return await self._serve_resource(raw, request, rtype, target)

    def _static(self, path: str, host: str) -> dict[str, Any] | None:
        stripped = path.rstrip("/") or "/"
        if stripped == "/version":
            return discovery.SERVER_VERSION
        if stripped == "/api":
            return discovery.api_versions(host)
        if stripped == "/apis":
            return discovery.api_group_list(self.store.types.values())
        parts = stripped.strip("/").split("/")
        if len(parts) == 2 and parts[0] == "apis":
            return discovery.api_group(self.store.types.values(), parts[1])
        if stripped in ("/healthz", "/livez", "/readyz"):
            return {"status": "ok"}
        return None

    async def _serve_resource(
        self,
        raw: aiohttp.web.BaseRequest,
        request: kmock.Request,
        rtype: ResourceType,
        target: routes.Target,
    ) -> aiohttp.web.StreamResponse:
        query = raw.query
        method = raw.method
        store = self.store
        write = Write(
            dry_run=query.get("dryRun") == "All",
            strict_fields=query.get("fieldValidation") == "Strict",
        )
        namespace = target.namespace if rtype.namespaced else None
        if target.name is None:
            matches = _matcher(query)
            if method == "GET" and query.get("watch") in ("true", "1"):
                return await self._watch(raw, rtype, namespace, query)
            if method == "GET":
                items = store.list_objects(rtype, namespace, matches)
                if tables.wants_table(raw.headers.get("Accept", "")):
                    return aiohttp.web.json_response(tables.table(rtype, items))
                return aiohttp.web.json_response(self._list_body(rtype, items, query))
            if method == "POST":
                created = store.create(rtype, target.namespace, _body(request), write=write)
                return _written(created, write, status=201)
            if method == "DELETE":
                deleted = store.delete_collection(rtype, namespace, matches)
                return aiohttp.web.json_response(self._list_body(rtype, deleted, {}))
        else:
            if method == "GET" and query.get("watch") in ("true", "1") and not target.subresource:
                # the old single-object form: a watch with fieldSelector=metadata.name=<name>
                named = {**query, "fieldSelector": f"metadata.name={target.name}"}
                return await self._watch(raw, rtype, namespace, named)
            if method == "GET" and target.subresource in (None, "status"):
                obj = store.get(rtype, namespace, target.name)
                return aiohttp.web.json_response(obj)
            if method == "PUT":
                obj = store.update(
                    rtype,
                    namespace,
                    target.name,
                    _body(request),
                    target.subresource,
                    write=write,
                )
                return _written(obj, write)
            if method == "PATCH":
                content_type = raw.headers.get("Content-Type", "").split(";")[0].strip()
                obj = store.patch(
                    rtype,
                    namespace,
                    target.name,
                    content_type,
                    _body(request),
                    target.subresource,
                    write=write,
                )
                return _written(obj, write)
            if method == "DELETE" and target.subresource is None:
                options = request.data if isinstance(request.data, dict) else {}
                obj = store.delete(rtype, namespace, target.name, options, write=write)
                return aiohttp.web.json_response(obj)
        raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {raw.path}")

    def _list_body(
        self, rtype: ResourceType, items: list[dict[str, Any]], query: Any
    ) -> dict[str, Any]:
        rv = str(self.store.resource_version)
        offset = 0
        if query.get("continue"):
            try:
                token = json.loads(base64.urlsafe_b64decode(query["continue"]))
                offset, rv = int(token["offset"]), str(token["rv"])
            except (ValueError, KeyError, TypeError):
                raise bad_request(
                    "invalid continue token: use the one the previous page gave"
                ) from None
        metadata: dict[str, Any] = {"resourceVersion": rv}
        limit = int(query.get("limit") or 0)
        page = items[offset : offset + limit] if limit > 0 else items[offset:]
        remaining = len(items) - offset - len(page)
        if remaining > 0:
            token = {"offset": offset + len(page), "rv": rv}
            metadata["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            metadata["remainingItemCount"] = remaining
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version,
            "metadata": metadata,
            "items": page,
        }

    async def _watch(
        self, raw: aiohttp.web.BaseRequest, rtype: ResourceType, namespace: str | None, query: Any
    ) -> aiohttp.web.StreamResponse:
        response = aiohttp.web.StreamResponse(status=200, headers={"Content-Type": JSON})
        try:
            watcher, initial = self.store.watch(
                rtype, namespace, _matcher(query), query.get("resourceVersion")
            )
        except ApiError as exc:
            if exc.code != 410:
                raise
            await response.prepare(raw)
            await _write(response, {"type": "ERROR", "object": exc.status()})
            await response.write_eof()
            return response
        bookmarks = query.get("allowWatchBookmarks") == "true"
        timeout = float(query.get("timeoutSeconds") or 0) or None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            await response.prepare(raw)
            for past in initial:
                await _write(response, past)
            if query.get("sendInitialEvents") == "true":
                await _write(response, self._bookmark(rtype, initial_end=True))
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if event is STOP:
                    return response  # dropped as by a restarting API server: no clean end
                event["object"]["apiVersion"] = rtype.api_version
                await _write(response, event)
            if bookmarks:
                await _write(response, self._bookmark(rtype, initial_end=False))
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went away
        finally:
            self.store.log.unsubscribe(watcher)
        return response

    def _bookmark(self, rtype: ResourceType, *, initial_end: bool) -> dict[str, Any]:
        metadata: dict[str, Any] = {"resourceVersion": str(self.store.resource_version)}
        if initial_end:
            metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {
            "type": "BOOKMARK",
            "object": {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": metadata},
        }


async def _parse_request(raw: aiohttp.web.BaseRequest, index: int) -> kmock.Request:
    try:
        return await kmock.Request._parse(raw, id=index)
    except ValueError:  # kmock 0.8 fails on some valid paths; keep the request, unparsed
        body = await raw.read()
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        return kmock.Request(
            id=index,
            raw_request=raw,
            url=raw.url,
            method=raw.method,
            params=dict(raw.query),
            headers=dict(raw.headers),
            body=body,
            text=body.decode(errors="replace"),
            data=data,
        )


def _matcher(query: Any) -> Any:
    labels = label_matcher(query.get("labelSelector"))
    fields = field_matcher(query.get("fieldSelector"))
    return lambda obj: labels(obj) and fields(obj)


def _body(request: kmock.Request) -> Any:
    if request.data is None and request.body:
        raise bad_request("the request body is not JSON (YAML bodies are not emulated)")
    return request.data


def _written(obj: Any, write: Write, status: int = 200) -> aiohttp.web.Response:
    """The object a write produced, with the API server's warnings (e.g. pruned fields)."""
    response = aiohttp.web.json_response(obj, status=status)
    for warning in write.warnings:
        response.headers.add("Warning", f"299 - {json.dumps(warning)}")
    return response


async def _write(response: aiohttp.web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(json.dumps(event).encode() + b"\n")
