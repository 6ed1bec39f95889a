"""The coordinator's shared state: nodes, datasets with their copies, preload jobs; the one lock
that guards them and the durable writes that keep them.

Who may change what, and under which lock:

- Everything here is guarded by :attr:`ClusterModel.lock` (one re-entrant lock). Every call
  the API makes takes it (the public methods of :class:`~coordinator.service.Coordinator`, of
  :class:`~coordinator.cluster.Cluster`, of :class:`~coordinator.manager.CacheManager`, and
  the entry points of the manager's parts: ``jobs.submit``/``release``/``renew``/``job``/
  ``list_jobs``, ``fills.scale``, ``journal.list_events``), and so does every change this
  model makes; the model's reading helpers (``dataset``, ``is_up``, ``copy_nodes``, …) and
  the parts' other methods run with it held by their caller. Re-entrant, so the calls nest,
  and a call sees and leaves the state whole. The lock is never held across network I/O
  other than the store's own.
- Datasets (their spec, refresh epoch, copies and fills) change through this model's methods
  (:meth:`~ClusterModel.add_dataset`, :meth:`~ClusterModel.update_policy`,
  :meth:`~ClusterModel.refresh_dataset`, :meth:`~ClusterModel.remove_dataset`); the
  CacheManager changes a dataset's copies in place and writes them with
  :meth:`~ClusterModel.save_dataset`.
- Nodes are registered and their soft state refreshed by the Cluster (heartbeats); preload
  jobs are the Cluster's too. The CacheManager only reads them.
- Every change is written through to the :class:`~coordinator.state.StateStore` (JSON
  documents under ``datasets/``, ``nodes/``, ``preloads/``; the CacheManager's ``jobs/``,
  ``tasks/`` and ``events/`` through :meth:`~ClusterModel.save`) before the call returns, so a
  restarted coordinator loses nothing. Soft state (liveness, tier usage, cached bytes per
  shard, preload progress as workers report it) comes from heartbeats and is rebuilt within
  one heartbeat interval after a restart.

Shard ownership is never stored: it is ``shard_owner(dataset, shard, live nodes of the copy)``,
computed the same way here and on every worker from the membership the Cluster hands out in
heartbeat replies. Nodes known at start are presumed up for one ``down_after_s`` grace period,
so a restart does not reshuffle ownership while the workers' first heartbeats arrive.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cachefs.errors import ConfigError, DatasetExists, DatasetNotFound
from cachefs.preload_jobs import PreloadJob
from cachefs.protocol import DatasetSpec

from .copies import DEFAULT_COPY, CopyState
from .json_types import JsonDoc
from .state import StateStore, StateStoreError

log = logging.getLogger("coordinator.model")

#: What ``PATCH /v1/datasets/{name}`` may change of a dataset.
POLICY_FIELDS = frozenset({"max_jobs_per_copy", "overflow", "cleanup"})


@dataclass
class NodeState:
    """What the coordinator knows of one worker: durable identity, soft stats."""

    node: str
    address: str
    registered_at: float
    last_seen: float
    gpus: int = 0
    tiers: list[JsonDoc] = field(default_factory=list)
    # dataset -> {"bytes": snapshot size, "files": n, "cached_bytes": n, "shards": {shard: bytes},
    # "last_read_at": t}
    datasets: dict[str, JsonDoc] = field(default_factory=dict)
    # read counters as last reported (cachefs/metrics.py WorkerMetrics.activity; cachefs stats)
    activity: JsonDoc | None = None

    def durable(self) -> JsonDoc:
        return {"node": self.node, "address": self.address, "registered_at": self.registered_at}

    @property
    def cache_capacity(self) -> int:
        """Bytes of all its tiers, as last reported."""
        return sum(t.get("capacity", 0) for t in self.tiers)

    @property
    def cache_used(self) -> int:
        return sum(t.get("used", 0) for t in self.tiers)

    def shard_bytes(self, dataset: str) -> dict[int, int]:
        """Its cached bytes of ``dataset`` per shard, as of its latest heartbeat."""
        shards = self.datasets.get(dataset, {}).get("shards") or {}
        return {int(shard): nbytes for shard, nbytes in shards.items()}


@dataclass
class DatasetState:
    spec: DatasetSpec
    refresh_epoch: int = 0
    # Copies of the dataset, in creation order (the first is the one readers outside every
    # copy read through).
    copies: dict[str, CopyState] = field(
        default_factory=lambda: {DEFAULT_COPY: CopyState(nodes=None)}
    )
    fill_seq: int = 0  # numbers the fills of the dataset's copies

    def to_json(self) -> JsonDoc:
        return {
            "spec": self.spec.to_json(),
            "refresh_epoch": self.refresh_epoch,
            "copies": {copy_id: copy.to_json() for copy_id, copy in self.copies.items()},
            "fill_seq": self.fill_seq,
        }

    @classmethod
    def from_json(cls, data: JsonDoc) -> DatasetState:
        copies = {copy_id: CopyState.from_json(c) for copy_id, c in data["copies"].items()}
        return cls(
            DatasetSpec.from_json(data["spec"]),
            data["refresh_epoch"],
            copies,
            data.get("fill_seq", 0),
        )

    def next_fill_id(self, copy_id: str) -> str:
        """A new fill's id: numbered per dataset ("B-3"), so (dataset, copy, id) names it."""
        self.fill_seq += 1
        return f"{copy_id}-{self.fill_seq}"


class ClusterModel:
    """Nodes, datasets and preload jobs, mirrored from the state store; see the module's
    docstring for who changes what under :attr:`lock`."""

    def __init__(
        self, store: StateStore, *, down_after_s: float, clock: Callable[[], float]
    ) -> None:
        self.store = store
        self.down_after_s = down_after_s
        self.clock = clock
        self.lock = threading.RLock()
        self.cluster_id = self._load_cluster_id()
        now = clock()
        self.datasets: dict[str, DatasetState] = {
            key.removeprefix("datasets/"): DatasetState.from_json(json.loads(value))
            for key, value in store.list("datasets/")
        }
        self.nodes: dict[str, NodeState] = {}
        for doc in self.load("nodes/"):
            self.nodes[doc["node"]] = NodeState(
                doc["node"], doc["address"], doc["registered_at"], last_seen=now
            )
        self.preloads: dict[str, PreloadJob] = {}
        for doc in self.load("preloads/"):
            job = PreloadJob.from_json(doc)
            self.preloads[job.id] = job

    def _load_cluster_id(self) -> str:
        self.store.put_if_absent("meta/cluster-id", secrets.token_hex(8).encode())
        stored = self.store.get("meta/cluster-id")
        if stored is None:  # a store that lost the key it just confirmed
            raise StateStoreError(f"{self.store.where} lost the cluster id it just stored")
        return stored.decode()

    # --- durable writes ------------------------------------------------------------------------

    def load(self, prefix: str) -> Iterator[JsonDoc]:
        """The JSON documents stored under ``prefix``, in key order."""
        for _key, value in self.store.list(prefix):
            yield json.loads(value)

    def save(self, key: str, doc: JsonDoc) -> None:
        """Write ``doc`` under ``key`` (call under :attr:`lock`)."""
        self.store.put(key, json.dumps(doc, separators=(",", ":")).encode())

    def delete(self, key: str) -> None:
        self.store.delete(key)

    def save_dataset(self, state: DatasetState) -> None:
        """Write a dataset changed in place (its copies, fills, spec)."""
        self.save(f"datasets/{state.spec.name}", state.to_json())

    def save_preload(self, job: PreloadJob) -> None:
        self.save(f"preloads/{job.id}", job.to_json())

    def now(self) -> float:
        return self.clock()

    # --- datasets ------------------------------------------------------------------------------

    def dataset(self, name: str) -> DatasetState:
        """The dataset named ``name``; :class:`DatasetNotFound` if there is none."""
        state = self.datasets.get(name)
        if state is None:
            raise DatasetNotFound(f"no dataset named {name!r}")
        return state

    def add_dataset(self, spec: DatasetSpec, nodes: list[str] | None = None) -> DatasetState:
        """Register a dataset. Its first copy spans ``nodes``, or every node (also those that
        join later) when None."""
        with self.lock:
            if spec.name in self.datasets:
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            if nodes is not None and not nodes:
                raise ConfigError("a copy needs at least one node")
            spec.created_at = spec.created_at or self.clock()
            copy = CopyState(
                nodes=sorted(set(nodes)) if nodes is not None else None,
                created_at=spec.created_at,
            )
            state = DatasetState(spec, copies={DEFAULT_COPY: copy})
            # Atomic in the store too: two coordinators sharing one etcd add it once.
            if not self.store.put_if_absent(
                f"datasets/{spec.name}", json.dumps(state.to_json()).encode()
            ):
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            self.datasets[spec.name] = state
            log.info("dataset %r added (%s)", spec.name, spec.uri)
            return state

    def update_policy(self, name: str, changes: JsonDoc) -> DatasetState:
        """Change a dataset's sharing and cleanup policy (:data:`POLICY_FIELDS`), validated as
        a whole spec."""
        unknown = set(changes) - POLICY_FIELDS
        if unknown:
            raise ConfigError(f"cannot change {', '.join(sorted(unknown))} of a dataset")
        with self.lock:
            state = self.dataset(name)
            state.spec = DatasetSpec.from_json({**state.spec.to_json(), **changes})
            self.save_dataset(state)
            return state

    def refresh_dataset(self, name: str) -> DatasetState:
        """A new refresh epoch: every worker re-lists the source when it sees it."""
        with self.lock:
            state = self.dataset(name)
            state.refresh_epoch += 1
            self.save_dataset(state)
            return state

    def remove_dataset(self, name: str) -> None:
        """Forget the dataset and its preload jobs (the CacheManager forgets its jobs and tasks:
        :meth:`coordinator.service.Coordinator.remove_dataset` calls both)."""
        with self.lock:
            self.dataset(name)
            for job in [job for job in self.preloads.values() if job.dataset == name]:
                self.delete(f"preloads/{job.id}")
                del self.preloads[job.id]
            self.delete(f"datasets/{name}")
            del self.datasets[name]

    # --- nodes and copies ----------------------------------------------------------------------

    def is_up(self, node: NodeState, now: float | None = None) -> bool:
        return (now or self.clock()) - node.last_seen <= self.down_after_s

    def node_is_up(self, name: str, now: float | None = None) -> bool:
        """``name`` is a registered node that is up."""
        node = self.nodes.get(name)
        return node is not None and self.is_up(node, now)

    def live_nodes(self, now: float | None = None) -> list[str]:
        """Every node that is up, sorted."""
        now = now or self.clock()
        return sorted(name for name, node in self.nodes.items() if self.is_up(node, now))

    def copy_nodes(self, dataset: str, copy_id: str) -> list[str]:
        """Every node of a copy, up or down, sorted."""
        members = self.dataset(dataset).copies[copy_id].nodes
        return sorted(self.nodes if members is None else members)

    def live_copy_nodes(self, dataset: str, copy_id: str) -> list[str]:
        """The nodes of a copy that are up: the membership shard ownership is computed over."""
        now = self.clock()
        return [node for node in self.copy_nodes(dataset, copy_id) if self.node_is_up(node, now)]

    def shard_bytes(self, node: str, dataset: str) -> dict[int, int]:
        """``node``'s cached bytes of ``dataset`` per shard (empty for an unknown node)."""
        state = self.nodes.get(node)
        return state.shard_bytes(dataset) if state is not None else {}
