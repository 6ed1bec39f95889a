"""What the scaler's integration tests run against: the fake Kubernetes API (``kube_api``), a
real coordinator process, and :class:`HeartbeatingNodes` standing in for cachefs workers."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import kubernetes

from cachefs.client import CoordinatorClient
from coordinator.scaler.controller import Scaler
from tests.e2e.coordinator.scaler.kube_api import FakeKubeAPI

GIB = 1 << 30


def core_api(kube: FakeKubeAPI) -> kubernetes.client.CoreV1Api:
    """The real client, configured as a kubeconfig with a bearer token would configure it."""
    configuration = kubernetes.client.Configuration(
        host=kube.url,
        api_key={"authorization": kube.token},
        api_key_prefix={"authorization": "Bearer"},
    )
    return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))


class HeartbeatingNodes:
    """cachefs nodes as the coordinator sees them, without FUSE: each "node" sends the worker's
    heartbeat (``POST /v1/nodes/{node}/heartbeat``) every ``interval`` with the cache usage the
    test sets, and reports every hand-off (fill) of its copies done on the next beat — unless
    :meth:`hold_fills` is on, which keeps the coordinator's copies busy (409 on scale)."""

    def __init__(self, client: CoordinatorClient, interval: float = 0.15):
        self._client = client
        self._interval = interval
        self._lock = threading.Lock()
        self._nodes: dict[str, dict] = {}  # node -> {"capacity", "used", "cached": {ds: bytes}}
        self._views: dict[str, dict] = {}  # node -> the coordinator's last heartbeat reply
        self._hold_fills = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeats")

    def __enter__(self) -> HeartbeatingNodes:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def up(self, node: str, *, capacity: int = 10 * GIB, used: int = 0, cached=None) -> None:
        with self._lock:
            self._nodes[node] = {"capacity": capacity, "used": used, "cached": dict(cached or {})}
        self._beat(node)  # registered before this returns

    def set_used(self, node: str, used: int) -> None:
        with self._lock:
            self._nodes[node]["used"] = used

    def hold_fills(self, hold: bool) -> None:
        with self._lock:
            self._hold_fills = hold

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                nodes = list(self._nodes)
            for node in nodes:
                self._beat(node)

    def _beat(self, node: str) -> None:
        with self._lock:
            state = self._nodes[node]
            view = self._views.get(node, {})
            hold = self._hold_fills
        fills = {}
        for dataset in view.get("datasets", []):
            name = dataset["spec"]["name"]
            for copy_id, fill in dataset["fills"].items():
                if node in dataset["copies"].get(copy_id, []):
                    fills[name] = {"copy": copy_id, "id": fill["id"], "done": not hold}
        report = {
            "address": "127.0.0.1:9",
            "tiers": [{"name": "ram", "capacity": state["capacity"], "used": state["used"]}],
            "datasets": {
                ds: {"bytes": 4 * GIB, "files": 1, "cached_bytes": nbytes}
                for ds, nbytes in state["cached"].items()
            },
            "fills": fills,
            "tasks_done": {task["id"]: {"freed_bytes": 0} for task in view.get("tasks", [])},
        }
        reply = self._client.heartbeat(node, report)
        with self._lock:
            self._views[node] = reply


@contextmanager
def running(scaler: Scaler) -> Iterator[Scaler]:
    """The scaler's loop in a thread; stopped, and every thread it started joined, on exit."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            scaler.run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="scaler")
    thread.start()
    try:
        yield scaler
    finally:
        scaler.stop()
        thread.join(timeout=30)
        assert not thread.is_alive(), "the scaler did not stop"
        leftover = [t.name for t in threading.enumerate() if t.name.startswith("scaler ")]
        assert not leftover, f"threads left running: {leftover}"
    if failure:
        raise failure[0]
