"""Running the emulator on 127.0.0.1 in a thread of its own, with a synchronous handle for tests.

The server gets its own event loop, so synchronous clients (the kubernetes client), subprocesses
(the agent, `kopf run`) and async code on another loop (kopf in a test) all reach it over HTTP.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kubernetes.client
import yaml

from tests.kube.app import KubeApiHandler
from tests.kube.resources import CRD_TYPE, ResourceType
from tests.kube.store import Store

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = REPO_ROOT / "charts" / "kvshm" / "crds"


def load_crds(directory: Path = CRD_DIR) -> list[dict[str, Any]]:
    documents = []
    for path in sorted(directory.glob("*.yaml")):
        documents += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return documents


class KubeApi:
    """A running emulator: `url`, `api_client()`, `write_kubeconfig()`; inspect with `call()`."""

    def __init__(self, crds: Iterable[dict[str, Any]] = ()) -> None:
        self._crds = list(crds)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kube-api-emulator", daemon=True
        )
        self.handler = KubeApiHandler()
        self._server: kmock.Server | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> KubeApi:
        if self._thread.is_alive():
            return self  # already running (start_kube_api() then `with`)
        self._thread.start()
        self._run(self._start())
        return self

    async def _start(self) -> None:
        for crd in self._crds:
            self.handler.store.create(CRD_TYPE, None, crd)
        await self.handler.__aenter__()
        self._server = kmock.Server(self.handler)
        await self._server.__aenter__()

    def stop(self) -> None:
        if self._server is not None:
            self._run(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        self.handler.store.log.close_all()
        assert self._server is not None
        await self._server.__aexit__(None, None, None)
        await self.handler.__aexit__(None, None, None)
        self._server = None

    def __enter__(self) -> KubeApi:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    # -- connecting ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None, "start() the emulator first"
        return f"http://127.0.0.1:{self._server.port}"

    def configuration(self) -> kubernetes.client.Configuration:
        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        """A kubernetes.client.ApiClient for this server; close it (or use `with`) when done."""
        return kubernetes.client.ApiClient(self.configuration())

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kvshm-emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
            "contexts": [
                {
                    "name": "kvshm-emulator",
                    "context": {
                        "cluster": "kvshm-emulator",
                        "user": "emulator",
                        "namespace": namespace,
                    },
                }
            ],
            "current-context": "kvshm-emulator",
        }

    def write_kubeconfig(self, path: Path | str, namespace: str = "default") -> Path:
        """Write a kubeconfig for this server (KUBECONFIG= for a subprocess); returns its path."""
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig(namespace)))
        return path

    # -- inspecting and steering -----------------------------------------------------------
    def call(self, fn: Callable[[Store], T]) -> T:
        """Run fn(store) on the server's loop (atomically with respect to requests)."""

        async def run() -> T:
            return fn(self.handler.store)

        result: T = self._run(run())
        return result

    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        return self.call(lambda store: store.resource(group, version, plural))

    def get(
        self, group: str, version: str, plural: str, name: str, namespace: str | None = None
    ) -> dict[str, Any]:
        return self.call(lambda s: s.get(s.resource(group, version, plural), namespace, name))

    def create(
        self,
        group: str,
        version: str,
        plural: str,
        body: dict[str, Any],
        namespace: str | None = None,
    ) -> dict[str, Any]:
        return self.call(lambda s: s.create(s.resource(group, version, plural), namespace, body))

    @property
    def resource_version(self) -> int:
        return self.call(lambda store: store.resource_version)

    def compact(self) -> None:
        """Forget all history: watches from any earlier resourceVersion now get 410 Gone."""
        self.call(lambda store: store.log.compact(store.resource_version))

    def drop_watches(self) -> int:
        """End every open watch stream abruptly, as an API server restart does."""
        return self.call(lambda store: store.log.close_all())

    @property
    def unknown_fields(self) -> list[str]:
        """Fields of custom resources the CRD schemas pruned ("Kind ns/name: path").

        A real API server drops them silently, so a component that writes one loses data:
        integration tests should assert this stays empty.
        """
        return self.call(lambda store: list(store.unknown_fields))

    @property
    def requests(self) -> list[kmock.Request]:
        """Every request served so far (kmock's record), for assertions."""
        return list(self.handler)


def start_kube_api(crd_dir: Path = CRD_DIR) -> KubeApi:
    """A started emulator with the project's CRDs loaded; stop() it when done."""
    return KubeApi(load_crds(crd_dir)).start()
