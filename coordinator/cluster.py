"""The coordinator's model of the cluster: datasets and their copies, nodes, preload jobs.

Jobs, cleanup and scaling — the CacheManager — live in :mod:`coordinator.manager` and share this
model and its lock.

Durable state (datasets, copies, known nodes, preload jobs, training jobs, tasks) lives in a
:class:`StateStore` (LMDB or etcd) as JSON documents and is mirrored in memory; every change is
written through before it is acknowledged, so a restarted coordinator loses nothing. Soft state
(liveness, tier usage, cached bytes per shard, preload progress as workers report it) comes from
heartbeats and is rebuilt within one heartbeat interval after a restart.

Shard ownership is never stored: it is ``shard_owner(dataset, shard, live nodes of the copy)``,
computed the same way here and on every worker from the membership this module hands out in
heartbeat replies. Nodes known at start are presumed up for one ``down_after_s`` grace period,
so a restart does not reshuffle ownership while the workers' first heartbeats arrive.

All methods are blocking (store writes) and serialised by one lock: the API runs them in
threads. The lock is never held across network I/O other than the store's own.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cachefs.errors import CachefsError, ConfigError, DatasetExists, DatasetNotFound
from cachefs.preload_jobs import PreloadJob, Selection
from cachefs.protocol import SHARDS, DatasetSpec, shard_owner

from .copies import DEFAULT_COPY, CopyState
from .errors import StateConflict
from .manager import CacheManager
from .state import StateStore

log = logging.getLogger("coordinator.cluster")


class NodeNotFound(CachefsError):
    pass


class PreloadNotFound(CachefsError):
    pass


@dataclass
class NodeState:
    """What the coordinator knows of one worker: durable identity, soft stats."""

    node: str
    address: str
    registered_at: float
    last_seen: float
    gpus: int = 0
    tiers: list[dict] = field(default_factory=list)
    # dataset -> {"bytes": snapshot size, "files": n, "cached_bytes": n, "shards": {shard: bytes}}
    datasets: dict[str, dict] = field(default_factory=dict)
    # read counters as last reported (cachefs/metrics.py WorkerMetrics.activity; cachefs stats)
    activity: dict | None = None

    def durable(self) -> dict:
        return {"node": self.node, "address": self.address, "registered_at": self.registered_at}

    @property
    def cache_capacity(self) -> int:
        """Bytes of all its tiers, as last reported."""
        return sum(t.get("capacity", 0) for t in self.tiers)

    @property
    def cache_used(self) -> int:
        return sum(t.get("used", 0) for t in self.tiers)


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

    def to_json(self) -> dict:
        return {
            "spec": self.spec.to_json(),
            "refresh_epoch": self.refresh_epoch,
            "copies": {copy_id: copy.to_json() for copy_id, copy in self.copies.items()},
            "fill_seq": self.fill_seq,
        }

    @classmethod
    def from_json(cls, data: dict) -> DatasetState:
        copies = {copy_id: CopyState.from_json(c) for copy_id, c in data["copies"].items()}
        return cls(
            DatasetSpec.from_json(data["spec"]),
            data["refresh_epoch"],
            copies,
            data.get("fill_seq", 0),
        )


class Cluster:
    def __init__(
        self,
        store: StateStore,
        *,
        heartbeat_interval_s: float = 2.0,
        down_after_s: float | None = None,
        clock: Callable[[], float] = time.time,
        job_lease_s: float = 600.0,
        lru_high_watermark: float = 0.9,
        fill_timeout_s: float = 3600.0,
    ) -> None:
        self.store = store
        self.heartbeat_interval_s = heartbeat_interval_s
        self.down_after_s = down_after_s if down_after_s is not None else 3 * heartbeat_interval_s
        self._clock = clock
        self._lock = threading.RLock()
        self.cluster_id = self._load_cluster_id()
        now = clock()
        self.datasets: dict[str, DatasetState] = {
            key.removeprefix("datasets/"): DatasetState.from_json(json.loads(value))
            for key, value in store.list("datasets/")
        }
        self.nodes: dict[str, NodeState] = {}
        for _key, value in store.list("nodes/"):
            doc = json.loads(value)
            self.nodes[doc["node"]] = NodeState(
                doc["node"], doc["address"], doc["registered_at"], last_seen=now
            )
        self.preloads: dict[str, PreloadJob] = {}
        for _key, value in store.list("preloads/"):
            job = PreloadJob.from_json(json.loads(value))
            self.preloads[job.id] = job
        self.manager = CacheManager(
            self,
            job_lease_s=job_lease_s,
            lru_high_watermark=lru_high_watermark,
            fill_timeout_s=fill_timeout_s,
        )

    def _load_cluster_id(self) -> str:
        fresh = secrets.token_hex(8)
        self.store.put_if_absent("meta/cluster-id", fresh.encode())
        return self.store.get("meta/cluster-id").decode()

    def _save(self, key: str, doc: dict) -> None:
        self.store.put(key, json.dumps(doc, separators=(",", ":")).encode())

    def _save_dataset(self, state: DatasetState) -> None:
        self._save(f"datasets/{state.spec.name}", state.to_json())

    # --- datasets ------------------------------------------------------------------------------

    def add_dataset(self, spec: DatasetSpec, nodes: list[str] | None = None) -> dict:
        """Register a dataset. Its first copy spans ``nodes``, or every node (also those that
        join later) when None."""
        with self._lock:
            if spec.name in self.datasets:
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            if nodes is not None and not nodes:
                raise ConfigError("a copy needs at least one node")
            spec.created_at = spec.created_at or self._clock()
            copy = CopyState(
                nodes=sorted(set(nodes)) if nodes is not None else None,
                created_at=spec.created_at,
            )
            state = DatasetState(spec, copies={DEFAULT_COPY: copy})
            if not self.store.put_if_absent(
                f"datasets/{spec.name}", json.dumps(state.to_json()).encode()
            ):
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            self.datasets[spec.name] = state
            log.info("dataset %r added (%s)", spec.name, spec.uri)
            return self.dataset_status(spec.name)

    def _dataset(self, name: str) -> DatasetState:
        state = self.datasets.get(name)
        if state is None:
            raise DatasetNotFound(f"no dataset named {name!r}")
        return state

    def remove_dataset(self, name: str) -> dict:
        with self._lock:
            self._dataset(name)
            for job in [job for job in self.preloads.values() if job.dataset == name]:
                self.store.delete(f"preloads/{job.id}")
                del self.preloads[job.id]
            self.manager.forget_dataset(name)
            self.store.delete(f"datasets/{name}")
            del self.datasets[name]
            return {"name": name, "removed": True}

    def update_policy(self, name: str, changes: dict) -> dict:
        """Change a dataset's sharing and cleanup policy (``max_jobs_per_copy``, ``overflow``,
        ``cleanup``). A higher limit lets suspended jobs start at once."""
        allowed = {"max_jobs_per_copy", "overflow", "cleanup"}
        unknown = set(changes) - allowed
        if unknown:
            raise ConfigError(f"cannot change {', '.join(sorted(unknown))} of a dataset")
        with self._lock:
            state = self._dataset(name)
            spec = DatasetSpec.from_json({**state.spec.to_json(), **changes})  # validates
            state.spec = spec
            self._save_dataset(state)
            self.manager.policy_changed(name, changes)
            return self.dataset_status(name)

    def refresh_dataset(self, name: str) -> dict:
        """Ask every worker to re-list the source (they see a new refresh epoch)."""
        with self._lock:
            state = self._dataset(name)
            state.refresh_epoch += 1
            self._save_dataset(state)
            return self.dataset_status(name)

    def list_datasets(self) -> list[dict]:
        with self._lock:
            return [self.dataset_status(name) for name in sorted(self.datasets)]

    def dataset_status(self, name: str) -> dict:
        with self._lock:
            state = self._dataset(name)
            locality = self.locality(name)
            return {
                **state.spec.to_json(),
                "refresh_epoch": state.refresh_epoch,
                "copies": self.manager.copy_docs(name, state),
                "jobs": self.manager.job_counts(name),
                "freed_bytes": sum(
                    nbytes
                    for (dataset, _), nbytes in self.manager.freed_bytes.items()
                    if dataset == name
                ),
                "bytes": locality["bytes"],
                "files": locality["files"],
                "cached_bytes": locality["cached_bytes"],
                "cached_fraction": locality["fraction"],
            }

    # --- nodes and membership ------------------------------------------------------------------

    def is_up(self, node: NodeState, now: float | None = None) -> bool:
        return (now or self._clock()) - node.last_seen <= self.down_after_s

    def copy_nodes(self, dataset: str, copy_id: str) -> list[str]:
        """Every node of a copy, up or down, sorted."""
        members = self._dataset(dataset).copies[copy_id].nodes
        return sorted(self.nodes if members is None else members)

    def live_copy_nodes(self, dataset: str, copy_id: str) -> list[str]:
        now = self._clock()
        return [
            node
            for node in self.copy_nodes(dataset, copy_id)
            if node in self.nodes and self.is_up(self.nodes[node], now)
        ]

    def heartbeat(self, node: str, report: dict) -> dict:
        """Record a worker's heartbeat (registering it on first contact) and return its view of
        the cluster: live membership, datasets with their copies, running preload jobs."""
        with self._lock:
            now = self._clock()
            state = self.nodes.get(node)
            if state is None or state.address != report["address"]:
                registered_at = state.registered_at if state else now
                state = NodeState(node, report["address"], registered_at, now)
                self._save(f"nodes/{node}", state.durable())
                self.nodes[node] = state
                log.info("node %r registered at %s", node, state.address)
            was_down = not self.is_up(state, now)
            state.last_seen = now
            if was_down:
                log.info("node %r is up again", node)
            state.gpus = report.get("gpus", 0)
            state.tiers = report.get("tiers", [])
            state.datasets = report.get("datasets", {})
            state.activity = report.get("activity")
            for job_id, shards in report.get("preloads", {}).items():
                self._record_preload_progress(node, job_id, shards)
            self.manager.on_heartbeat(node, report)
            return self.view(node)

    def view(self, node: str | None = None) -> dict:
        """The cluster as ``node`` must see it (its pending tasks included)."""
        now = self._clock()
        return {
            "cluster_id": self.cluster_id,
            "heartbeat_interval_s": self.heartbeat_interval_s,
            "nodes": {
                name: {"address": n.address, "up": self.is_up(n, now)}
                for name, n in sorted(self.nodes.items())
            },
            "datasets": [
                {
                    "spec": state.spec.to_json(),
                    "refresh_epoch": state.refresh_epoch,
                    "copies": {
                        copy_id: self.live_copy_nodes(name, copy_id) for copy_id in state.copies
                    },
                    "fills": self.manager.fills_view(name, state),
                }
                for name, state in sorted(self.datasets.items())
            ],
            "preloads": [
                job.assignment() for job in self.preloads.values() if job.state == "running"
            ],
            "tasks": self.manager.tasks_for(node) if node is not None else [],
        }

    def node_status(self, node: str) -> dict:
        with self._lock:
            state = self.nodes.get(node)
            if state is None:
                raise NodeNotFound(f"no node named {node!r}")
            return self._node_doc(state)

    def list_nodes(self) -> list[dict]:
        with self._lock:
            return [self._node_doc(state) for _, state in sorted(self.nodes.items())]

    def _node_doc(self, state: NodeState) -> dict:
        now = self._clock()
        held = []
        for name, report in sorted(state.datasets.items()):
            if name not in self.datasets:
                continue
            total = report.get("bytes", 0)
            cached = report.get("cached_bytes", 0)
            held.append(
                {
                    "dataset": name,
                    "cached_bytes": cached,
                    "fraction": cached / total if total else 0,
                }
            )
        return {
            "node": state.node,
            "address": state.address,
            "state": "up" if self.is_up(state, now) else "down",
            "last_heartbeat_s_ago": round(now - state.last_seen, 3),
            "gpus": state.gpus,
            "tiers": state.tiers,
            "datasets": held,
            "activity": state.activity,
        }

    def check_liveness(self) -> list[str]:
        """Nodes that are down now (called periodically; logs transitions)."""
        with self._lock:
            now = self._clock()
            return [name for name, state in self.nodes.items() if not self.is_up(state, now)]

    # --- locality ------------------------------------------------------------------------------

    def locality(self, dataset: str) -> dict:
        """Nodes holding ``dataset``, with cached bytes and fraction (as of their last heartbeat;
        a node that is down is listed with its state but its bytes are not counted)."""
        with self._lock:
            state = self._dataset(dataset)
            now = self._clock()
            total = files = 0
            rows = []
            for _, node in sorted(self.nodes.items()):
                report = node.datasets.get(dataset)
                if report is None:
                    continue
                total = max(total, report.get("bytes", 0))
                files = max(files, report.get("files", 0))
                rows.append((node, report.get("cached_bytes", 0), self.is_up(node, now)))
            cached = sum(nbytes for _, nbytes, up in rows if up)
            return {
                "dataset": dataset,
                "bytes": total,
                "files": files,
                "cached_bytes": cached,
                "fraction": min(1.0, cached / total) if total else 0.0,
                "copies": [
                    {"id": copy_id, "nodes": self.copy_nodes(dataset, copy_id)}
                    for copy_id in state.copies
                ],
                "nodes": [
                    {
                        "node": node.node,
                        "address": node.address,
                        "state": "up" if up else "down",
                        "cached_bytes": nbytes,
                        "fraction": nbytes / total if total else 0.0,
                    }
                    for node, nbytes, up in rows
                    if nbytes or up
                ],
            }

    def locality_document(self) -> dict:
        """Everything the placement policies need, in the format of
        :func:`coordinator.scheduling.sources.parse_locality_document`."""
        with self._lock:
            datasets = {}
            for name in self.datasets:
                locality = self.locality(name)
                datasets[name] = {
                    "size": locality["bytes"],
                    "nodes": {
                        row["node"]: row["cached_bytes"]
                        for row in locality["nodes"]
                        if row["state"] == "up"
                    },
                }
            now = self._clock()
            nodes = {}
            for name, node in self.nodes.items():
                if not self.is_up(node, now):
                    continue
                nodes[name] = {
                    "gpus": node.gpus,
                    "free_gpus": node.gpus,
                    "cache_capacity": node.cache_capacity,
                    "cache_used": min(node.cache_used, node.cache_capacity),
                }
            return {"datasets": datasets, "nodes": nodes}

    # --- preload -------------------------------------------------------------------------------

    def start_preload(self, dataset: str, selection: Selection, *, copy: str | None = None) -> dict:
        with self._lock:
            state = self._dataset(dataset)
            copy_id = copy or next(iter(state.copies))
            if copy_id not in state.copies:
                raise StateConflict(f"dataset {dataset!r} has no copy {copy_id!r}")
            now = self._clock()
            job = PreloadJob(
                id=f"{dataset}-{int(now * 1000):013d}-{secrets.token_hex(2)}",
                dataset=dataset,
                copy=copy_id,
                selection=selection,
                created_at=now,
            )
            job.advance(now)
            self._save(f"preloads/{job.id}", job.to_json())
            self.preloads[job.id] = job
            log.info("preload %s of %r: %s", job.id, dataset, selection.describe())
            return self._preload_doc(job)

    def resume_preload(self, dataset: str) -> dict:
        """A new job with the latest job's selection: blocks already cached are skipped, so
        only what is missing (e.g. objects that failed) is fetched."""
        with self._lock:
            latest = self._latest_preload(dataset)
            if latest.state in ("running", "scheduled"):
                return self._preload_doc(latest)
            selection = Selection(**{**latest.selection.__dict__, "at": None})
            return self.start_preload(dataset, selection, copy=latest.copy)

    def cancel_preload(self, dataset: str) -> dict:
        with self._lock:
            job = self._latest_preload(dataset)
            if job.state in ("running", "scheduled"):
                job.state = "cancelled"
                job.finished_at = self._clock()
                self._save(f"preloads/{job.id}", job.to_json())
            return self._preload_doc(job)

    def _latest_preload(self, dataset: str) -> PreloadJob:
        self._dataset(dataset)
        jobs = [job for job in self.preloads.values() if job.dataset == dataset]
        if not jobs:
            raise PreloadNotFound(f"dataset {dataset!r} has no preload job")
        return max(jobs, key=lambda job: job.created_at)

    def preload_status(self, dataset: str) -> dict:
        with self._lock:
            return self._preload_doc(self._latest_preload(dataset))

    def preload_job(self, job_id: str) -> dict:
        with self._lock:
            job = self.preloads.get(job_id)
            if job is None:
                raise PreloadNotFound(f"no preload job {job_id!r}")
            return self._preload_doc(job)

    def list_preloads(self) -> list[dict]:
        with self._lock:
            return [
                self._preload_doc(job)
                for job in sorted(self.preloads.values(), key=lambda j: j.created_at)
            ]

    def _owners(self, job: PreloadJob) -> list[str | None]:
        live = self.live_copy_nodes(job.dataset, job.copy)
        return [shard_owner(job.dataset, shard, live) for shard in range(SHARDS)]

    def _preload_doc(self, job: PreloadJob) -> dict:
        return job.progress(self._owners(job), self._clock())

    def _record_preload_progress(self, node: str, job_id: str, shards: dict) -> None:
        job = self.preloads.get(job_id)
        if job is None or job.state != "running" or job.dataset not in self.datasets:
            return
        owners = self._owners(job)
        changed = False
        for shard_text, report in shards.items():
            shard = int(shard_text)
            if 0 <= shard < SHARDS and owners[shard] == node:
                changed |= job.record(shard, node, report)
        if job.advance(self._clock(), owners) or changed:
            self._save(f"preloads/{job.id}", job.to_json())

    def tick(self) -> None:
        """Periodic: start scheduled preloads whose time has come, finish jobs whose shards
        are all done (also after a node went down and its shards moved)."""
        with self._lock:
            now = self._clock()
            for job in self.preloads.values():
                active = job.state in ("scheduled", "running") and job.dataset in self.datasets
                if active and job.copy not in self.datasets[job.dataset].copies:
                    job.state, job.finished_at = "cancelled", now  # its copy was cleaned up
                    self._save(f"preloads/{job.id}", job.to_json())
                elif active and job.advance(now, self._owners(job)):
                    self._save(f"preloads/{job.id}", job.to_json())
        self.manager.tick()
