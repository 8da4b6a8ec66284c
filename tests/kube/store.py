"""The emulator's state: objects by resource, a resourceVersion counter and the event log.

Every method runs on the server's event loop and never awaits, so each one is atomic with
respect to watches: an event is logged and fanned out in the same step that changes the object.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tests.kube import meta, patching, schema
from tests.kube.errors import (
    ApiError,
    Cause,
    already_exists,
    bad_request,
    conflict,
    gone,
    invalid,
    not_found,
)
from tests.kube.resources import BUILTIN_TYPES, CRD_TYPE, ResourceType, types_from_crd
from tests.kube.selectors import Matcher
from tests.kube.watching import Change, EventLog, Watcher

Key = tuple[str | None, str]  # (namespace, name)


@dataclass
class Write:
    """Options of one write request, and the warnings the API server sends back for it."""

    dry_run: bool = False  # ?dryRun=All: validate and answer, store nothing
    strict_fields: bool = False  # ?fieldValidation=Strict: unknown fields are an error
    warnings: list[str] = dataclasses.field(default_factory=list)


INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class Store:
    def __init__(self) -> None:
        self.types: dict[tuple[str, str, str], ResourceType] = {}
        self._objects: dict[tuple[str, str], dict[Key, dict[str, Any]]] = {}
        self._rv = 0
        self.log = EventLog()
        # fields of custom resources the schema pruned ("Kind ns/name: path"): silently lost
        # data on a real cluster, so tests can assert a component writes none
        self.unknown_fields: list[str] = []
        for rtype in BUILTIN_TYPES:
            self.register(rtype)
        namespaces = self.resource("", "v1", "namespaces")
        for name in INITIAL_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})

    # -- resource types ------------------------------------------------------------------
    def register(self, rtype: ResourceType) -> None:
        self.types[(rtype.group, rtype.version, rtype.plural)] = rtype
        self._objects.setdefault((rtype.group, rtype.plural), {})

    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        try:
            return self.types[(group, version, plural)]
        except KeyError:
            path = f"/apis/{group}/{version}/{plural}" if group else f"/api/{version}/{plural}"
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            ) from None

    @property
    def resource_version(self) -> int:
        return self._rv

    # -- reads ---------------------------------------------------------------------------
    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._bucket(rtype).get((self._ns(rtype, namespace), name))
        if obj is None:
            raise not_found(rtype.plural, rtype.group, name)
        return self._view(rtype, obj)

    def list_objects(
        self, rtype: ResourceType, namespace: str | None, matches: Matcher
    ) -> list[dict[str, Any]]:
        items = [
            obj
            for (ns, _), obj in self._bucket(rtype).items()
            if (namespace is None or ns == namespace) and matches(obj)
        ]
        items.sort(key=lambda o: ((o["metadata"].get("namespace") or ""), o["metadata"]["name"]))
        return [self._view(rtype, obj) for obj in items]

    def watch(
        self, rtype: ResourceType, namespace: str | None, matches: Matcher, since: str | None
    ) -> tuple[Watcher, list[dict[str, Any]]]:
        """Subscribe a watcher; returns it and the events due before live ones (one atomic step)."""
        watcher = Watcher((rtype.group, rtype.plural), namespace, matches)
        if since in (None, "", "0"):
            # "any"/"most recent": the current state as ADDED events, then what follows
            initial = [
                {"type": "ADDED", "object": obj}
                for obj in self.list_objects(rtype, namespace, matches)
            ]
        else:
            rv = _parse_rv(since)
            if rv < self.log.floor_rv:
                raise gone(f"too old resource version: {rv} ({self.log.floor_rv})")
            initial = self.log.replay(watcher, rv)
        self.log.subscribe(watcher)
        return watcher, [self._event_view(rtype, event) for event in initial]

    # -- writes --------------------------------------------------------------------------
    def create(
        self, rtype: ResourceType, namespace: str | None, body: Any, *, write: Write | None = None
    ) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise bad_request("the request body must be a JSON object")
        obj = copy.deepcopy(dict(body))
        metadata = dict(obj.get("metadata") or {})
        self._check_kind(rtype, obj)
        namespace = self._check_namespace(rtype, namespace, metadata)
        if not metadata.get("name") and metadata.get("generateName"):
            metadata["name"] = meta.generated_name(metadata["generateName"])
        name = metadata.get("name")
        causes = meta.name_causes(name, label=rtype.plural == "namespaces")
        if causes:
            raise invalid(rtype.kind, rtype.group, str(name or ""), causes)
        for field in (*meta.SYSTEM_FIELDS, "resourceVersion", "managedFields", "selfLink"):
            metadata.pop(field, None)
        metadata.update(uid=meta.new_uid(), creationTimestamp=meta.now())
        if namespace is not None:
            metadata["namespace"] = namespace
        if rtype.custom or rtype is CRD_TYPE:
            metadata["generation"] = 1
        obj["metadata"] = metadata
        obj.update(apiVersion=rtype.api_version, kind=rtype.kind)
        if rtype.custom and rtype.has_status:
            obj.pop("status", None)  # status is written through /status only
        if rtype.plural == "namespaces" and not rtype.group:
            obj["status"] = {"phase": "Active"}
        obj = self._admit(rtype, obj, None, write or Write())
        if (namespace, name) in self._bucket(rtype):  # after validation, as in the API server
            raise already_exists(rtype.plural, rtype.group, str(name))
        if write is not None and write.dry_run:
            return self._view(rtype, obj)
        return self._commit(rtype, None, obj)

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        subresource: str | None,
        *,
        write: Write | None = None,
    ) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise bad_request("the request body must be a JSON object")
        old = self._stored(rtype, namespace, name)
        body_meta = body.get("metadata") or {}
        if body_meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({body_meta.get('name')}) does not match "
                f"the name on the URL ({name})"
            )
        if rtype.custom and not body_meta.get("resourceVersion"):
            cause = Cause(
                "metadata.resourceVersion",
                "FieldValueInvalid",
                "Invalid value: 0x0: must be specified for an update",
            )
            raise invalid(rtype.kind, rtype.group, name, [cause])
        return self._replace(rtype, old, dict(body), subresource, write=write or Write())

    def patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None,
        *,
        write: Write | None = None,
    ) -> dict[str, Any]:
        old = self._stored(rtype, namespace, name)
        target = copy.deepcopy(old)
        try:
            if content_type == patching.MERGE_PATCH:
                patched = patching.merge_patch(target, patch)
            elif content_type == patching.JSON_PATCH:
                patched = patching.json_patch(target, patch)
            elif content_type == patching.STRATEGIC_MERGE_PATCH and not rtype.custom:
                patched = patching.strategic_merge_patch(target, patch)
            else:
                raise _unsupported_media_type(content_type, rtype)
        except patching.MalformedPatchError as exc:
            raise bad_request(str(exc)) from exc
        except patching.PatchError as exc:
            message = f"the server rejected our request due to an error in our request: {exc}"
            raise ApiError(422, "Invalid", message) from exc
        if not isinstance(patched, dict):
            raise bad_request("the patch made the object something other than an object")
        return self._replace(rtype, old, patched, subresource, write=write or Write())

    def delete(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        options: Mapping[str, Any] | None = None,
        *,
        write: Write | None = None,
    ) -> dict[str, Any]:
        old = self._stored(rtype, namespace, name)
        self._check_preconditions(rtype, old, (options or {}).get("preconditions") or {})
        if write is not None and write.dry_run:
            return self._view(rtype, old)
        if meta.is_deleting(old):
            return self._view(rtype, old)
        if rtype.plural == "namespaces" and not rtype.group:
            return self._delete_namespace(rtype, old)
        if meta.finalizers(old):
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = meta.now()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            if "generation" in new["metadata"]:
                new["metadata"]["generation"] += 1  # as the API server does on graceful deletion
            return self._commit(rtype, old, new)
        return self._remove(rtype, old)

    def delete_collection(
        self, rtype: ResourceType, namespace: str | None, matches: Matcher
    ) -> list[dict[str, Any]]:
        return [
            self.delete(rtype, obj["metadata"].get("namespace"), obj["metadata"]["name"])
            for obj in self.list_objects(rtype, namespace, matches)
        ]

    # -- internals -----------------------------------------------------------------------
    def _bucket(self, rtype: ResourceType) -> dict[Key, dict[str, Any]]:
        return self._objects[(rtype.group, rtype.plural)]

    def _ns(self, rtype: ResourceType, namespace: str | None) -> str | None:
        return namespace if rtype.namespaced else None

    def _stored(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self._bucket(rtype).get((self._ns(rtype, namespace), name))
        if obj is None:
            raise not_found(rtype.plural, rtype.group, name)
        return obj

    def _view(self, rtype: ResourceType, obj: Mapping[str, Any]) -> dict[str, Any]:
        view = copy.deepcopy(dict(obj))
        view["apiVersion"] = rtype.api_version  # the version asked for, storage is shared
        return view

    def _event_view(self, rtype: ResourceType, event: dict[str, Any]) -> dict[str, Any]:
        return {"type": event["type"], "object": self._view(rtype, event["object"])}

    def _check_kind(self, rtype: ResourceType, obj: Mapping[str, Any]) -> None:
        if (
            obj.get("kind", rtype.kind) != rtype.kind
            or obj.get("apiVersion", rtype.api_version) != rtype.api_version
        ):
            raise bad_request(
                f"the API version in the data ({obj.get('apiVersion')}) "
                f"or kind ({obj.get('kind')}) does not "
                f"match the expected {rtype.api_version} {rtype.kind}"
            )

    def _check_namespace(
        self, rtype: ResourceType, namespace: str | None, metadata: Mapping[str, Any]
    ) -> str | None:
        if not rtype.namespaced:
            return None
        if namespace is None:
            raise bad_request(
                f"{rtype.plural} are namespaced: create them under /namespaces/<namespace>/"
            )
        if metadata.get("namespace") not in (None, "", namespace):
            raise bad_request(
                "the namespace of the provided object does not match "
                "the namespace sent on the request"
            )
        ns_obj = self._objects[("", "namespaces")].get((None, namespace))
        if ns_obj is None:
            raise not_found("namespaces", "", namespace)
        if meta.is_deleting(ns_obj):
            message = (
                f"{rtype.plural} is forbidden: unable to create new content in namespace "
                f"{namespace} because it is being terminated"
            )
            raise ApiError(403, "Forbidden", message)
        return namespace

    def _check_preconditions(
        self, rtype: ResourceType, old: Mapping[str, Any], preconditions: Mapping[str, Any]
    ) -> None:
        name = old["metadata"]["name"]
        for field in ("uid", "resourceVersion"):
            wanted = preconditions.get(field)
            if wanted and wanted != old["metadata"].get(field):
                raise conflict(
                    rtype.plural,
                    rtype.group,
                    name,
                    f"Precondition failed: {field} in precondition: {wanted}, "
                    f"{field} in object meta: {old['metadata'].get(field)}",
                )

    def _replace(
        self,
        rtype: ResourceType,
        old: dict[str, Any],
        incoming: dict[str, Any],
        subresource: str | None,
        *,
        write: Write,
    ) -> dict[str, Any]:
        name = old["metadata"]["name"]
        if subresource not in (None, "status") or (
            subresource == "status" and not rtype.has_status
        ):
            raise ApiError(
                404,
                "NotFound",
                f"the server could not find the requested resource ({rtype.plural}/{subresource})",
            )
        incoming_rv = (incoming.get("metadata") or {}).get("resourceVersion")
        if incoming_rv and incoming_rv != old["metadata"]["resourceVersion"]:
            raise conflict(
                rtype.plural,
                rtype.group,
                name,
                "the object has been modified; "
                "please apply your changes to the latest version and try again",
            )
        new = self._merge_update(rtype, old, incoming, subresource)
        new = self._admit(rtype, new, old, write)
        if write.dry_run:
            return self._view(rtype, new)
        return self._commit(rtype, old, new)

    def _merge_update(
        self,
        rtype: ResourceType,
        old: dict[str, Any],
        incoming: dict[str, Any],
        subresource: str | None,
    ) -> dict[str, Any]:
        """The object an update asks for, with what this endpoint may not change kept from old."""
        if subresource == "status":
            new = copy.deepcopy(old)
            if incoming.get("status") is None:
                new.pop("status", None)
            else:
                new["status"] = copy.deepcopy(incoming["status"])
            return new
        new = copy.deepcopy(incoming)
        new.update(apiVersion=rtype.api_version, kind=rtype.kind)
        if rtype.has_status:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        metadata = dict(new.get("metadata") or {})
        for field in (*meta.SYSTEM_FIELDS, "name", "namespace", "resourceVersion"):
            if field in old["metadata"]:
                metadata[field] = old["metadata"][field]
            else:
                metadata.pop(field, None)
        new["metadata"] = metadata
        added = set(meta.finalizers(new)) - set(meta.finalizers(old))
        if meta.is_deleting(old) and added:
            cause = Cause(
                "metadata.finalizers",
                "FieldValueForbidden",
                "Forbidden: no new finalizers can be added if the object is being deleted, "
                "found new finalizers " + str(sorted(added)),
            )
            raise invalid(rtype.kind, rtype.group, old["metadata"]["name"], [cause])
        if "generation" in metadata and meta.content(new) != meta.content(old):
            metadata["generation"] = old["metadata"]["generation"] + 1
        return new

    def _admit(
        self, rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, write: Write
    ) -> dict[str, Any]:
        """Schema defaults and validation of custom resources; CRDs get their types registered."""
        if rtype.custom and rtype.schema is not None:
            obj, pruned = schema.prepare(obj, rtype.schema)
            if pruned and write.strict_fields:
                raise bad_request(f'strict decoding error: unknown field "{pruned[0]}"')
            where = f"{rtype.kind} {_key_text(obj)}"
            self.unknown_fields += [f"{where}: {path}" for path in pruned]
            write.warnings += [f'unknown field "{path}"' for path in pruned]
            causes = schema.validate(obj, rtype.schema, old)
            if causes:
                raise invalid(rtype.kind, rtype.group, obj["metadata"]["name"], causes)
        if rtype is CRD_TYPE:
            obj = self._admit_crd(obj)
        return obj

    def _admit_crd(self, crd: dict[str, Any]) -> dict[str, Any]:
        try:
            new_types = types_from_crd(crd)
        except (KeyError, TypeError) as exc:
            raise invalid(
                "CustomResourceDefinition",
                "apiextensions.k8s.io",
                crd["metadata"]["name"],
                [Cause("spec", "FieldValueRequired", f"Required value: {exc}")],
            ) from exc
        expected = f"{crd['spec']['names']['plural']}.{crd['spec']['group']}"
        if crd["metadata"]["name"] != expected:
            cause = Cause(
                "metadata.name",
                "FieldValueInvalid",
                f'Invalid value: "{crd["metadata"]["name"]}": '
                'must be spec.names.plural+"."+spec.group',
            )
            raise invalid(
                "CustomResourceDefinition", "apiextensions.k8s.io", crd["metadata"]["name"], [cause]
            )
        for rtype in new_types:
            self.register(rtype)
        crd = copy.deepcopy(crd)
        crd["status"] = {
            "acceptedNames": crd["spec"]["names"],
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {
                    "type": t,
                    "status": "True",
                    "reason": r,
                    "message": m,
                    "lastTransitionTime": meta.now(),
                }
                for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
                )
            ],
        }
        return crd

    def _commit(
        self, rtype: ResourceType, old: dict[str, Any] | None, new: dict[str, Any]
    ) -> dict[str, Any]:
        if old is not None and _without_rv(old) == _without_rv(new):
            return self._view(rtype, old)  # a no-op write: same resourceVersion, no event
        if meta.is_deleting(new) and not meta.finalizers(new):
            return self._remove(rtype, new)
        self._rv += 1
        new["metadata"]["resourceVersion"] = str(self._rv)
        namespace = new["metadata"].get("namespace")
        self._bucket(rtype)[(namespace, new["metadata"]["name"])] = new
        self._log(rtype, "ADDED" if old is None else "MODIFIED", new, old)
        return self._view(rtype, new)

    def _remove(self, rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        namespace = obj["metadata"].get("namespace")
        old = self._bucket(rtype).pop((namespace, obj["metadata"]["name"]))
        gone_obj = copy.deepcopy(obj)
        self._rv += 1
        gone_obj["metadata"]["resourceVersion"] = str(self._rv)
        self._log(rtype, "DELETED", gone_obj, old)
        if rtype is CRD_TYPE:
            self._drop_crd(obj)
        if namespace is not None:
            self._reap_namespace(namespace)
        return self._view(rtype, gone_obj)

    def _log(
        self, rtype: ResourceType, kind: str, obj: dict[str, Any], old: dict[str, Any] | None
    ) -> None:
        namespace = obj["metadata"].get("namespace")
        change = Change(
            self._rv, kind, (rtype.group, rtype.plural), namespace, copy.deepcopy(obj), old
        )
        self.log.append(change)

    def _drop_crd(self, crd: Mapping[str, Any]) -> None:
        for rtype in types_from_crd(crd):
            for obj in list(self._bucket(rtype).values()):
                self._remove(rtype, obj)
            self.types.pop((rtype.group, rtype.version, rtype.plural), None)

    def _delete_namespace(self, rtype: ResourceType, ns_obj: dict[str, Any]) -> dict[str, Any]:
        """Mark it Terminating, delete its contents; it goes once nothing is left in it."""
        new = copy.deepcopy(ns_obj)
        new["metadata"]["deletionTimestamp"] = meta.now()
        new["metadata"]["finalizers"] = ["kubernetes"]  # stands for the namespace controller
        new["status"] = {"phase": "Terminating"}
        result = self._commit(rtype, ns_obj, new)
        name = ns_obj["metadata"]["name"]
        for other in list(self.types.values()):
            if other.namespaced:
                for ns, obj_name in list(self._bucket(other)):
                    if ns == name:
                        self.delete(other, ns, obj_name)
        self._reap_namespace(name)
        return result if (None, name) not in self._bucket(rtype) else self.get(rtype, None, name)

    def _reap_namespace(self, name: str) -> None:
        namespaces = self.resource("", "v1", "namespaces")
        ns_obj = self._bucket(namespaces).get((None, name))
        if ns_obj is None or not meta.is_deleting(ns_obj):
            return
        if any(ns == name for bucket in self._objects.values() for (ns, _) in bucket):
            return
        self._remove(namespaces, ns_obj)


def _key_text(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta["name"])


def _without_rv(obj: Mapping[str, Any]) -> dict[str, Any]:
    metadata = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
    return {**obj, "metadata": metadata}


def _parse_rv(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise bad_request(
            f"invalid resourceVersion {value!r}: it must be one a response gave"
        ) from None


def _unsupported_media_type(content_type: str, rtype: ResourceType) -> ApiError:
    accepted = [patching.JSON_PATCH, patching.MERGE_PATCH]
    if not rtype.custom:
        accepted.append(patching.STRATEGIC_MERGE_PATCH)
    note = " (server-side apply is not emulated)" if content_type == patching.APPLY_PATCH else ""
    message = (
        f"the body of the request was in an unknown format{note} - "
        f"accepted media types include: {', '.join(accepted)}"
    )
    return ApiError(415, "UnsupportedMediaType", message)
