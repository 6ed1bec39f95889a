"""Where the placement endpoint gets live locality and cluster state from.

Two small protocols: :class:`LocalitySource` (cached bytes per node and size of a dataset)
and :class:`ClusterSource` (nodes with GPUs and free GPUs). Both have an async ``refresh()`` the
endpoint awaits before answering, so a source that polls can bring its snapshot up to date.

Implementations: :class:`InMemorySource` (set by the caller; tests, embedding) and
:class:`HttpSource`, which polls a URL serving the coordinator's locality document::

    {
      "datasets": {"<name>": {"size": <bytes>, "nodes": {"<node>": <cached bytes>, ...}}, ...},
      "nodes": {"<node>": {"gpus": <int>, "free_gpus": <int>, ...optional hardware...}, ...}
    }

Optional node fields: ``peak_flops``, ``memory_bandwidth``, ``network_bits_per_s``,
``overhead_s``, ``cache_capacity``, ``cache_used`` (see :class:`.model.Node`). Unknown keys
are ignored, so the document may carry more than the scheduler needs.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import anyio
import httpx

from .model import Dataset, Node, SchedulingError

_NODE_NUMBERS = (
    "peak_flops",
    "memory_bandwidth",
    "network_bits_per_s",
    "overhead_s",
    "cache_capacity",
    "cache_used",
)


class UnknownDataset(SchedulingError):
    """The locality source has never heard of this dataset."""


class SourceUnavailable(SchedulingError):
    """The locality/cluster source could not be read; the message says which and why."""


class LocalitySource(Protocol):
    async def refresh(self) -> None: ...

    def cached_bytes(self, dataset: str) -> dict[str, int]:
        """node -> bytes of ``dataset`` cached there; raises :class:`UnknownDataset`."""
        ...

    def dataset_size(self, dataset: str) -> int:
        """Bytes in ``dataset``; raises :class:`UnknownDataset`."""
        ...


class ClusterSource(Protocol):
    async def refresh(self) -> None: ...

    def nodes(self) -> dict[str, Node]:
        """Every node with its GPUs and free GPUs now."""
        ...


class InMemorySource:
    """Locality and cluster state held in memory, replaced wholesale by :meth:`update`."""

    def __init__(
        self,
        datasets: Mapping[str, Dataset] | None = None,
        nodes: Mapping[str, Node] | None = None,
    ) -> None:
        self._datasets: dict[str, Dataset] = dict(datasets or {})
        self._nodes: dict[str, Node] = dict(nodes or {})

    def update(
        self,
        datasets: Mapping[str, Dataset] | None = None,
        nodes: Mapping[str, Node] | None = None,
    ) -> None:
        if datasets is not None:
            self._datasets = dict(datasets)
        if nodes is not None:
            self._nodes = dict(nodes)

    async def refresh(self) -> None:
        """Nothing to fetch: the state is whatever :meth:`update` last set."""

    def _dataset(self, name: str) -> Dataset:
        try:
            return self._datasets[name]
        except KeyError:
            raise UnknownDataset(f"dataset {name!r} is not known to the locality source") from None

    def cached_bytes(self, dataset: str) -> dict[str, int]:
        return dict(self._dataset(dataset).cached)

    def dataset_size(self, dataset: str) -> int:
        return self._dataset(dataset).size

    def nodes(self) -> dict[str, Node]:
        return dict(self._nodes)


class HttpSource(InMemorySource):
    """Polls the coordinator's locality document over HTTP, at most once per ``max_age_s``.

    A failed fetch raises :class:`SourceUnavailable` naming the URL without credentials; the
    last good snapshot is not served silently in its place.
    """

    def __init__(
        self,
        url: str,
        *,
        client: httpx.AsyncClient | None = None,
        max_age_s: float = 2.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.url = url
        self._client = client
        self._timeout_s = timeout_s
        self._max_age_s = max_age_s
        self._clock = clock
        self._fetched_at: float | None = None
        self._lock = anyio.Lock()

    @property
    def where(self) -> str:
        """The URL without user, password or query (safe for messages and logs)."""
        parts = urllib.parse.urlsplit(self.url)
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{host}{port}{parts.path}"

    async def refresh(self) -> None:
        async with self._lock:
            now = self._clock()
            if self._fetched_at is not None and now - self._fetched_at < self._max_age_s:
                return
            document = await self._fetch()
            datasets, nodes = parse_locality_document(document, self.where)
            self.update(datasets, nodes)
            self._fetched_at = now

    async def _fetch(self) -> object:
        try:
            if self._client is not None:
                response = await self._client.get(self.url, timeout=self._timeout_s)
            else:
                async with httpx.AsyncClient() as client:
                    response = await client.get(self.url, timeout=self._timeout_s)
        except httpx.HTTPError as err:
            raise SourceUnavailable(f"locality source {self.where}: {type(err).__name__}") from None
        if response.status_code != 200:
            raise SourceUnavailable(f"locality source {self.where}: HTTP {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise SourceUnavailable(f"locality source {self.where}: body is not JSON") from None


def parse_locality_document(
    document: object, where: str
) -> tuple[dict[str, Dataset], dict[str, Node]]:
    """Check and convert the locality document; every error names the field."""

    def fail(field: str, why: str) -> SourceUnavailable:
        return SourceUnavailable(f"locality source {where}: {field} {why}")

    def count(value: object, field: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise fail(field, "must be a non-negative integer")
        return value

    if not isinstance(document, dict):
        raise fail("the document", "must be a JSON object")
    raw_datasets = document.get("datasets", {})
    raw_nodes = document.get("nodes", {})
    if not isinstance(raw_datasets, dict) or not isinstance(raw_nodes, dict):
        raise fail("'datasets' and 'nodes'", "must be JSON objects")

    datasets = {}
    for name, entry in raw_datasets.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("nodes", {}), dict):
            raise fail(f"datasets.{name}", "must be an object with 'size' and 'nodes'")
        size = count(entry.get("size"), f"datasets.{name}.size")
        cached = {
            node: count(held, f"datasets.{name}.nodes.{node}")
            for node, held in entry.get("nodes", {}).items()
        }
        datasets[name] = Dataset(name, size, cached)

    nodes = {}
    for name, entry in raw_nodes.items():
        if not isinstance(entry, dict):
            raise fail(f"nodes.{name}", "must be an object with 'gpus' and 'free_gpus'")
        gpus = count(entry.get("gpus"), f"nodes.{name}.gpus")
        free = count(entry.get("free_gpus"), f"nodes.{name}.free_gpus")
        extra = {}
        for key in _NODE_NUMBERS:
            value = entry.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise fail(f"nodes.{name}.{key}", "must be a non-negative number")
            extra[key] = int(value) if key.startswith("cache_") else float(value)
        try:
            nodes[name] = Node(name, gpus, free, **extra)  # type: ignore[arg-type]
        except SchedulingError as err:
            raise fail(f"nodes.{name}", str(err)) from None
    return datasets, nodes


class WorkerSource(InMemorySource):
    """Live locality read straight from cachefs workers' control sockets (single-node mode,
    before a coordinator exists): each worker is one node named by its ``--node``; a dataset's
    size is taken from the snapshot, its cached bytes from the worker's block index.

    GPUs are not known to workers, so each node is given ``gpus_per_node`` GPUs, all free (a
    scheduler that knows better passes ``candidates``). Polled at most once per ``max_age_s``.
    """

    def __init__(
        self,
        state_dirs: list[str],
        *,
        gpus_per_node: int = 8,
        max_age_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.state_dirs = list(state_dirs)
        self._gpus_per_node = gpus_per_node
        self._max_age_s = max_age_s
        self._clock = clock
        self._fetched_at: float | None = None
        self._lock = anyio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            now = self._clock()
            if self._fetched_at is not None and now - self._fetched_at < self._max_age_s:
                return
            statuses = [await anyio.to_thread.run_sync(_worker_status, d) for d in self.state_dirs]
            sizes: dict[str, int] = {}
            cached: dict[str, dict[str, int]] = {}
            nodes: dict[str, Node] = {}
            for status in statuses:
                node = status["node"]
                nodes[node] = Node(node, self._gpus_per_node, self._gpus_per_node)
                for dataset in status["datasets"]:
                    if dataset.get("state") != "ready":
                        continue
                    sizes[dataset["name"]] = dataset["bytes"]
                    cached.setdefault(dataset["name"], {})[node] = dataset["cached_bytes"]
            datasets = {name: Dataset(name, size, cached[name]) for name, size in sizes.items()}
            self.update(datasets, nodes)
            self._fetched_at = now


def _worker_status(state_dir: str) -> dict[str, Any]:
    from cachefs.client import ControlClient, WorkerNotRunning

    try:
        with ControlClient(state_dir, timeout=5.0) as client:
            return client.status()
    except WorkerNotRunning as err:
        raise SourceUnavailable(str(err)) from None
