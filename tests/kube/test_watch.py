"""Watches behave like the API server's: from a resourceVersion, every later event exactly once."""

from __future__ import annotations

import json
import threading
import urllib.request
from typing import Any

import kubernetes
import pytest

from tests.kube.manifests import GROUP, REGIONS, VERSION, region
from tests.kube.runner import KubeApi

Event = tuple[str, str, int]  # type, name, resourceVersion


def regions_api(client: kubernetes.client.ApiClient) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(client)


def create(kube_api: KubeApi, name: str, **spec: Any) -> dict[str, Any]:
    with kube_api.api_client() as client:
        created: dict[str, Any] = regions_api(client).create_namespaced_custom_object(
            GROUP, VERSION, "default", REGIONS, region(name, **spec)
        )
    return created


def patch(kube_api: KubeApi, name: str, body: dict[str, Any]) -> dict[str, Any]:
    with kube_api.api_client() as client:
        patched: dict[str, Any] = regions_api(client).patch_namespaced_custom_object(
            GROUP, VERSION, "default", REGIONS, name, body
        )
    return patched


def delete(kube_api: KubeApi, name: str) -> None:
    with kube_api.api_client() as client:
        regions_api(client).delete_namespaced_custom_object(
            GROUP, VERSION, "default", REGIONS, name
        )


def list_rv(kube_api: KubeApi) -> int:
    with kube_api.api_client() as client:
        listed = regions_api(client).list_namespaced_custom_object(
            GROUP, VERSION, "default", REGIONS
        )
    return int(listed["metadata"]["resourceVersion"])


def watch(
    kube_api: KubeApi, since: str | None, *, until: str | None = None, **params: Any
) -> list[Event]:
    """Events of a watch from `since`, until the server's 1 s timeout or an ADDED `until`."""
    events: list[Event] = []
    with kube_api.api_client() as client:
        stream = kubernetes.watch.Watch()
        kwargs = {"timeout_seconds": 1 if until is None else 10, **params}
        if since is not None:
            kwargs["resource_version"] = since
        for event in stream.stream(
            regions_api(client).list_namespaced_custom_object,
            GROUP,
            VERSION,
            "default",
            REGIONS,
            **kwargs,
        ):
            meta = event["object"]["metadata"]
            events.append((event["type"], meta["name"], int(meta["resourceVersion"])))
            if until is not None and event["type"] == "ADDED" and meta["name"] == until:
                stream.stop()
    return events


def test_watch_from_a_version_gets_each_later_event_once_and_none_earlier(
    kube_api: KubeApi,
) -> None:
    create(kube_api, "a")
    b = create(kube_api, "b")
    mark = int(b["metadata"]["resourceVersion"])
    patch(kube_api, "a", {"spec": {"populate": False}})
    delete(kube_api, "b")
    create(kube_api, "c")

    events = watch(kube_api, str(mark))

    assert [(kind, name) for kind, name, _ in events] == [
        ("MODIFIED", "a"),
        ("DELETED", "b"),
        ("ADDED", "c"),
    ]
    versions = [rv for _, _, rv in events]
    assert versions == sorted(versions) and len(set(versions)) == 3 and versions[0] > mark


def test_resource_versions_increase_with_every_change(kube_api: KubeApi) -> None:
    first = int(create(kube_api, "a")["metadata"]["resourceVersion"])
    second = int(
        patch(kube_api, "a", {"metadata": {"labels": {"x": "1"}}})["metadata"]["resourceVersion"]
    )
    third = int(create(kube_api, "b")["metadata"]["resourceVersion"])
    assert first < second < third <= list_rv(kube_api)


def test_watch_without_a_version_starts_with_the_current_objects(kube_api: KubeApi) -> None:
    create(kube_api, "a")
    create(kube_api, "b")
    delete(kube_api, "a")
    assert [(kind, name) for kind, name, _ in watch(kube_api, None)] == [("ADDED", "b")]
    assert [(kind, name) for kind, name, _ in watch(kube_api, "0")] == [("ADDED", "b")]


def test_no_event_is_lost_or_repeated_between_replay_and_live_events(kube_api: KubeApi) -> None:
    """Watches start while a writer creates objects: each sees exactly those created after it."""
    count = 60
    created_rv: dict[str, int] = {}
    marks: list[int] = []
    results: list[tuple[int, list[Event]]] = []

    def writer() -> None:
        for i in range(count):
            created_rv[f"o{i}"] = int(create(kube_api, f"o{i}")["metadata"]["resourceVersion"])

    def watcher(mark: int) -> None:
        results.append((mark, watch(kube_api, str(mark), until=f"o{count - 1}")))

    writing = threading.Thread(target=writer)
    writing.start()
    watchers = []
    while writing.is_alive() and len(watchers) < 8:
        mark = list_rv(kube_api)
        marks.append(mark)
        watchers.append(threading.Thread(target=watcher, args=(mark,)))
        watchers[-1].start()
    writing.join()
    for thread in watchers:
        thread.join(timeout=30)

    assert len(results) == len(watchers) >= 2
    for mark, events in results:
        expected = sorted((rv, name) for name, rv in created_rv.items() if rv > mark)
        assert [(rv, name) for _, name, rv in events] == expected
        assert all(kind == "ADDED" for kind, _, _ in events)


def test_watch_from_a_compacted_version_is_410_gone(kube_api: KubeApi) -> None:
    mark = int(create(kube_api, "a")["metadata"]["resourceVersion"])
    create(kube_api, "b")
    kube_api.compact()
    with pytest.raises(kubernetes.client.ApiException) as raised:
        watch(kube_api, str(mark))
    assert raised.value.status == 410
    assert [name for _, name, _ in watch(kube_api, str(kube_api.resource_version))] == []


def test_a_selector_watch_sees_objects_enter_and_leave_it(kube_api: KubeApi) -> None:
    mark = int(create(kube_api, "a")["metadata"]["resourceVersion"])
    patch(kube_api, "a", {"metadata": {"labels": {"tier": "kv"}}})
    patch(kube_api, "a", {"spec": {"lock": False}})
    patch(kube_api, "a", {"metadata": {"labels": {"tier": None}}})
    events = watch(kube_api, str(mark), label_selector="tier=kv")
    assert [kind for kind, _, _ in events] == ["ADDED", "MODIFIED", "DELETED"]


def test_initial_events_end_with_a_bookmark(kube_api: KubeApi) -> None:
    create(kube_api, "a")
    url = (
        f"{kube_api.url}/apis/{GROUP}/{VERSION}/namespaces/default/{REGIONS}?watch=true"
        "&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true"
        "&timeoutSeconds=1"
    )
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = [json.loads(line) for line in response.read().splitlines() if line]
    assert [line["type"] for line in lines] == ["ADDED", "BOOKMARK", "BOOKMARK"]
    annotations = lines[1]["object"]["metadata"]["annotations"]
    assert annotations == {"k8s.io/initial-events-end": "true"}


def test_dropping_watches_ends_open_streams(kube_api: KubeApi) -> None:
    ended = threading.Event()

    def follow() -> None:
        with kube_api.api_client() as client:
            url = f"/apis/{GROUP}/{VERSION}/namespaces/default/{REGIONS}"
            response = client.call_api(
                *client.param_serialize("GET", url, query_params=[("watch", "true")]),
            )
            response.read()
        ended.set()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    for _ in range(100):
        if kube_api.drop_watches():
            break
        ended.wait(0.05)
    assert ended.wait(5)


def test_a_watch_can_follow_one_object(kube_api: KubeApi) -> None:
    mark = int(create(kube_api, "a")["metadata"]["resourceVersion"])
    create(kube_api, "b")
    patch(kube_api, "a", {"spec": {"lock": False}})
    patch(kube_api, "b", {"spec": {"lock": False}})
    by_selector = watch(kube_api, str(mark), field_selector="metadata.name=a")
    assert [(kind, name) for kind, name, _ in by_selector] == [("MODIFIED", "a")]
    url = (
        f"{kube_api.url}/apis/{GROUP}/{VERSION}/namespaces/default/{REGIONS}/a"
        f"?watch=true&resourceVersion={mark}&timeoutSeconds=1"
    )
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = [json.loads(line) for line in response.read().splitlines() if line]
    assert [(line["type"], line["object"]["metadata"]["name"]) for line in lines] == [
        ("MODIFIED", "a")
    ]
