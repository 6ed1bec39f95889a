"""The CacheManager (P1's TDCS): jobs sharing cached copies, Suspend / Clone, cleanup, scaling.

- **Jobs** (:mod:`.jobs`). A training job registers with the dataset it reads and how many
  nodes it wants. It is placed on a copy of the dataset (TDCS ranking: the copy's nodes among
  its candidates first) and counts against that copy until released. Jobs are durable; a job
  whose owner stops renewing its lease is released, so a crashed client cannot leak a copy's
  capacity.
- **Hot copies.** At most ``max_jobs_per_copy`` jobs share one copy. Over the limit the
  dataset's ``overflow`` policy applies: ``suspend`` queues the job (FIFO per dataset; the head
  is placed as soon as a copy has room), ``clone`` makes a new copy on candidate nodes outside
  every copy (most free cache first) and places the job there at once; the clone's owners copy
  blocks from the source copy's peers, not the object store, while the job already reads.
- **Cleanup** per dataset (:mod:`.cleanup`): ``lock`` never frees; ``ttl:<d>`` frees a copy no
  job used and no node read for ``d`` (a clone is removed, the last copy kept empty); ``lru``
  frees, on a node whose cache is nearly full, the least recently used such dataset. Freeing
  is a task sent to the node in its heartbeat reply (:mod:`.journal`); workers never touch
  their reserve.
- **Scaling** (:mod:`.handoff`; the CacheScaler's API trigger): a copy gains or loses nodes;
  rendezvous hashing moves only the shards whose owner changed, and the new owners copy those
  from the previous owners (a hand-off, like a clone's fill) before the old nodes drop what
  they no longer own. **The hand-off invariant: a node drops a shard it handed off only once
  another node holds it** (:mod:`.handoff` says how it is kept).

The CacheManager is its four parts, which the API calls directly (``manager.jobs.submit``,
``manager.fills.scale``, ``manager.journal.list_events``), and what concerns them all: a
heartbeat's reports, the periodic tick, a dataset's removal, the status documents. It reads and
changes the :class:`~coordinator.model.ClusterModel` (a dataset's copies and fills, in place,
written with ``save_dataset``) and keeps its own durable state (``jobs/``, ``tasks/``,
``events/``) through the model's writes. The manager's public methods and the parts' entry
points take the model's lock (:mod:`coordinator.model` lists them); the parts' other methods
run with it held. It knows nothing of the :class:`~coordinator.cluster.Cluster`: the
:class:`~coordinator.service.Coordinator` calls both.
"""

from __future__ import annotations

from ..json_types import JsonDoc
from ..model import ClusterModel
from .cleanup import Cleanup
from .handoff import Fills
from .jobs import Job, Jobs
from .journal import Journal, Task

__all__ = ["CacheManager", "Job", "Task"]


class CacheManager:
    """Jobs, fills and scaling, cleanup, tasks and events over one model."""

    def __init__(
        self,
        model: ClusterModel,
        *,
        job_lease_s: float,
        lru_high_watermark: float,
        fill_timeout_s: float,
    ) -> None:
        self.model = model
        self.journal = Journal(model)
        self.jobs = Jobs(model, self.journal, job_lease_s=job_lease_s)
        self.fills = Fills(model, self.journal, fill_timeout_s=fill_timeout_s)
        self.cleanup = Cleanup(
            model, self.journal, self.jobs, lru_high_watermark=lru_high_watermark
        )

    # --- what the Coordinator asks for its other parts ------------------------------------------

    def on_heartbeat(self, node: str, report: JsonDoc) -> None:
        with self.model.lock:
            self.journal.acknowledge(node, report.get("tasks_done", {}))
            self.fills.record(node, report.get("fills", {}))

    def tasks_for(self, node: str) -> list[JsonDoc]:
        with self.model.lock:
            return self.journal.tasks_for(node)

    def fills_view(self) -> dict[str, JsonDoc]:
        """dataset -> its copies' fills, as heartbeat replies carry them."""
        with self.model.lock:
            return {name: self.fills.view(name) for name in self.model.datasets}

    def policy_changed(self, dataset: str, changes: JsonDoc) -> None:
        """A dataset's sharing policy changed: a higher limit lets suspended jobs start."""
        with self.model.lock:
            described = ", ".join(f"{k}={v}" for k, v in sorted(changes.items()))
            self.journal.event("policy", dataset, None, f"policy of {dataset} changed: {described}")
            self.jobs.promote(dataset)

    def forget_dataset(self, dataset: str) -> None:
        """The dataset was removed: its jobs and tasks go with it (the workers drop its cache
        when their view no longer lists it)."""
        with self.model.lock:
            self.jobs.forget_dataset(dataset)
            self.journal.forget_dataset(dataset)
            self.fills.forget_dataset(dataset)

    def tick(self) -> None:
        """Periodic: expired leases, the suspend queues, fills that end, hand-offs waiting,
        cleanup."""
        with self.model.lock:
            now = self.model.now()
            self.jobs.release_expired(now)
            self.jobs.promote_waiting()
            self.fills.tick(now)
            self.cleanup.tick(now)

    # --- status --------------------------------------------------------------------------------

    def dataset_status(self, dataset: str) -> JsonDoc:
        """The manager's part of ``GET /v1/datasets/{name}``: copies, jobs, freed bytes."""
        with self.model.lock:
            return {
                "copies": self._copy_docs(dataset),
                "jobs": self.jobs.counts(dataset),
                "freed_bytes": self.journal.freed_bytes_of(dataset),
            }

    def _copy_docs(self, dataset: str) -> list[JsonDoc]:
        per_copy = self.jobs.running_per_copy(dataset)
        docs = []
        for copy_id, copy in self.model.dataset(dataset).copies.items():
            docs.append(
                {
                    "id": copy_id,
                    "nodes": self.model.copy_nodes(dataset, copy_id),
                    "origin": copy.origin,
                    "created_at": copy.created_at,
                    "running_jobs": per_copy.get(copy_id, 0),
                    "freed_at": copy.freed_at,
                    "used_ratio": self._used_ratio(dataset, copy_id),
                    "fill": (
                        self.fills.progress(dataset, copy_id, copy.fill) if copy.fill else None
                    ),
                    # node -> shards it handed off and keeps until their owner here holds them
                    "handed_off": {n: len(s) for n, s in sorted(copy.handed_off.items())},
                }
            )
        return docs

    def _used_ratio(self, dataset: str, copy_id: str) -> float:
        """Cache used / capacity over the copy's live nodes (the CacheScaler's HPA metric)."""
        nodes = [self.model.nodes[n] for n in self.model.live_copy_nodes(dataset, copy_id)]
        capacity = sum(node.cache_capacity for node in nodes)
        used = sum(node.cache_used for node in nodes)
        return min(1.0, used / capacity) if capacity else 0.0

    @property
    def freed_bytes(self) -> dict[tuple[str, str], int]:
        """(dataset, task kind) -> bytes workers freed since the coordinator started."""
        return self.journal.freed_bytes
