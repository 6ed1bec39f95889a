"""The coordinator composed: who builds what, and the calls that need more than one part.

::

    api.py, server.py        HTTP routes, metrics, the ticker
        service.py           Coordinator: builds the parts below, composes their answers
    cluster.py | manager/    membership, ownership, preload | jobs, copies, cleanup, scaling
        model.py             nodes, datasets, copies, preload jobs; the lock; durable writes
        state/               the key-value store (LMDB, etcd)

The Cluster and the CacheManager never import each other (``lint-imports`` keeps it so): what
needs both is here. A heartbeat is recorded by the Cluster, acknowledged tasks and fill reports
by the CacheManager, and answered with the Cluster's view carrying the CacheManager's fills and
tasks; a dataset's status is the model's spec, the Cluster's locality and the CacheManager's
copies and jobs; removing a dataset asks both to forget it. Each such call holds the model's
lock throughout, so what it composes is one moment's state.

Calls that belong to one part go to it directly: ``coordinator.cluster.start_preload(…)``,
``coordinator.manager.jobs.submit(…)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cachefs.protocol import DatasetSpec

from .cluster import Cluster
from .json_types import JsonDoc
from .manager import CacheManager
from .model import ClusterModel
from .settings import CoordinatorSettings
from .state import StateStore


class Coordinator:
    """The model, the Cluster and the CacheManager over one state store, built from one
    :class:`~coordinator.settings.CoordinatorSettings`. Blocking: the API calls it in
    threads."""

    def __init__(
        self,
        store: StateStore,
        settings: CoordinatorSettings = CoordinatorSettings(),
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.model = ClusterModel(store, down_after_s=settings.node_down_after_s, clock=clock)
        self.cluster = Cluster(self.model, heartbeat_interval_s=settings.heartbeat_interval_s)
        self.manager = CacheManager(
            self.model,
            job_lease_s=settings.job_lease_s,
            lru_high_watermark=settings.lru_high_watermark,
            fill_timeout_s=settings.fill_timeout_s,
        )

    @property
    def cluster_id(self) -> str:
        return self.model.cluster_id

    # --- workers -------------------------------------------------------------------------------

    def heartbeat(self, node: str, report: JsonDoc) -> JsonDoc:
        """Record a worker's heartbeat (registering it on first contact) and return its view of
        the cluster: live membership, datasets with their copies and fills, running preload
        jobs, its pending tasks."""
        with self.model.lock:
            self.cluster.record_heartbeat(node, report)
            self.manager.on_heartbeat(node, report)
            return self.view(node)

    def view(self, node: str | None = None) -> JsonDoc:
        """The cluster as ``node`` must see it (its pending tasks included)."""
        with self.model.lock:
            tasks = self.manager.tasks_for(node) if node is not None else []
            return self.cluster.view(self.manager.fills_view(), tasks)

    def tick(self) -> None:
        """Periodic (the server's ticker): preload jobs, then the CacheManager's work."""
        with self.model.lock:
            self.cluster.tick()
            self.manager.tick()

    # --- datasets ------------------------------------------------------------------------------

    def add_dataset(self, spec: DatasetSpec, nodes: list[str] | None = None) -> JsonDoc:
        """Register a dataset. Its first copy spans ``nodes``, or every node (also those that
        join later) when None."""
        with self.model.lock:
            self.model.add_dataset(spec, nodes)
            return self.dataset_status(spec.name)

    def remove_dataset(self, name: str) -> JsonDoc:
        with self.model.lock:
            self.model.dataset(name)
            self.manager.forget_dataset(name)
            self.model.remove_dataset(name)
            return {"name": name, "removed": True}

    def update_policy(self, name: str, changes: JsonDoc) -> JsonDoc:
        """Change a dataset's sharing and cleanup policy (``max_jobs_per_copy``, ``overflow``,
        ``cleanup``). A higher limit lets suspended jobs start at once."""
        with self.model.lock:
            self.model.update_policy(name, changes)
            self.manager.policy_changed(name, changes)
            return self.dataset_status(name)

    def refresh_dataset(self, name: str) -> JsonDoc:
        """Ask every worker to re-list the source (they see a new refresh epoch)."""
        with self.model.lock:
            self.model.refresh_dataset(name)
            return self.dataset_status(name)

    def scale_copy(self, dataset: str, copy_id: str, add: list[str], remove: list[str]) -> JsonDoc:
        """Add and remove nodes of a copy; the dataset's status, with ``moved_shards`` when the
        copy's nodes changed."""
        with self.model.lock:
            moved = self.manager.fills.scale(dataset, copy_id, add, remove)
            status = self.dataset_status(dataset)
            return status if moved is None else {**status, "moved_shards": moved}

    def list_datasets(self) -> list[JsonDoc]:
        with self.model.lock:
            return [self.dataset_status(name) for name in sorted(self.model.datasets)]

    def dataset_status(self, name: str) -> JsonDoc:
        with self.model.lock:
            state = self.model.dataset(name)
            locality = self.cluster.locality(name)
            return {
                **state.spec.to_json(),
                "refresh_epoch": state.refresh_epoch,
                **self.manager.dataset_status(name),
                "bytes": locality["bytes"],
                "files": locality["files"],
                "cached_bytes": locality["cached_bytes"],
                "cached_fraction": locality["fraction"],
            }
