"""Membership, shard ownership and preload jobs: what the coordinator tells its workers.

Workers heartbeat; :meth:`Cluster.record_heartbeat` registers a node on first contact, keeps its
soft stats (tiers, bytes per dataset and shard, read counters) and folds its preload progress
into the jobs. The reply is :meth:`Cluster.view`: live membership per copy, datasets, running
preload jobs (with the CacheManager's fills and tasks, which
:class:`~coordinator.service.Coordinator` passes in: this module knows nothing of jobs).

Shard ownership is computed, never stored (:mod:`coordinator.model`); a preload job's shards
are judged against their owner among the live nodes of the job's copy.

All methods are blocking (store writes) and run under the model's lock: the API runs them in
threads.
"""

from __future__ import annotations

import logging
import secrets

from cachefs.preload_jobs import PreloadJob, Selection
from cachefs.protocol import SHARDS, shard_owner

from .errors import NodeNotFound, PreloadNotFound, StateConflict
from .json_types import JsonDoc
from .model import ClusterModel, NodeState

log = logging.getLogger("coordinator.cluster")


class Cluster:
    def __init__(self, model: ClusterModel, *, heartbeat_interval_s: float) -> None:
        self.model = model
        self.heartbeat_interval_s = heartbeat_interval_s

    # --- heartbeats and the view ---------------------------------------------------------------

    def record_heartbeat(self, node: str, report: JsonDoc) -> None:
        """Record a worker's heartbeat, registering it on first contact (or at a new
        address)."""
        model = self.model
        with model.lock:
            now = model.now()
            state = model.nodes.get(node)
            if state is None or state.address != report["address"]:
                registered_at = state.registered_at if state else now
                state = NodeState(node, report["address"], registered_at, now)
                model.save(f"nodes/{node}", state.durable())
                model.nodes[node] = state
                log.info("node %r registered at %s", node, state.address)
            was_down = not model.is_up(state, now)
            state.last_seen = now
            if was_down:
                log.info("node %r is up again", node)
            state.gpus = report.get("gpus", 0)
            state.tiers = report.get("tiers", [])
            state.datasets = report.get("datasets", {})
            state.activity = report.get("activity")
            for job_id, shards in report.get("preloads", {}).items():
                self._record_preload_progress(node, job_id, shards)

    def view(self, fills: dict[str, JsonDoc], tasks: list[JsonDoc]) -> JsonDoc:
        """The cluster as a worker must see it: ``fills`` (dataset -> its copies' fills) and
        ``tasks`` (the worker's pending tasks) are the CacheManager's."""
        model = self.model
        with model.lock:
            now = model.now()
            return {
                "cluster_id": model.cluster_id,
                "heartbeat_interval_s": self.heartbeat_interval_s,
                "nodes": {
                    name: {"address": n.address, "up": model.is_up(n, now)}
                    for name, n in sorted(model.nodes.items())
                },
                "datasets": [
                    {
                        "spec": state.spec.to_json(),
                        "refresh_epoch": state.refresh_epoch,
                        "copies": {
                            copy_id: model.live_copy_nodes(name, copy_id)
                            for copy_id in state.copies
                        },
                        "fills": fills.get(name, {}),
                    }
                    for name, state in sorted(model.datasets.items())
                ],
                "preloads": [
                    job.assignment() for job in model.preloads.values() if job.state == "running"
                ],
                "tasks": tasks,
            }

    # --- nodes ---------------------------------------------------------------------------------

    def node_status(self, node: str) -> JsonDoc:
        with self.model.lock:
            state = self.model.nodes.get(node)
            if state is None:
                raise NodeNotFound(f"no node named {node!r}")
            return self._node_doc(state)

    def list_nodes(self) -> list[JsonDoc]:
        with self.model.lock:
            return [self._node_doc(state) for _, state in sorted(self.model.nodes.items())]

    def _node_doc(self, state: NodeState) -> JsonDoc:
        now = self.model.now()
        held = []
        for name, report in sorted(state.datasets.items()):
            if name not in self.model.datasets:
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
            "state": "up" if self.model.is_up(state, now) else "down",
            "last_heartbeat_s_ago": round(now - state.last_seen, 3),
            "gpus": state.gpus,
            "tiers": state.tiers,
            "datasets": held,
            "activity": state.activity,
        }

    def check_liveness(self) -> list[str]:
        """Nodes that are down now (called periodically; the caller logs transitions)."""
        with self.model.lock:
            now = self.model.now()
            return [
                name for name, node in self.model.nodes.items() if not self.model.is_up(node, now)
            ]

    # --- locality ------------------------------------------------------------------------------

    def locality(self, dataset: str) -> JsonDoc:
        """Nodes holding ``dataset``, with cached bytes and fraction (as of their last heartbeat;
        a node that is down is listed with its state but its bytes are not counted)."""
        model = self.model
        with model.lock:
            state = model.dataset(dataset)
            now = model.now()
            total = files = 0
            rows = []
            for _, node in sorted(model.nodes.items()):
                report = node.datasets.get(dataset)
                if report is None:
                    continue
                total = max(total, report.get("bytes", 0))
                files = max(files, report.get("files", 0))
                rows.append((node, report.get("cached_bytes", 0), model.is_up(node, now)))
            cached = sum(nbytes for _, nbytes, up in rows if up)
            return {
                "dataset": dataset,
                "bytes": total,
                "files": files,
                "cached_bytes": cached,
                "fraction": min(1.0, cached / total) if total else 0.0,
                "copies": [
                    {"id": copy_id, "nodes": model.copy_nodes(dataset, copy_id)}
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

    def locality_document(self) -> JsonDoc:
        """Everything the placement policies need, in the format of
        :func:`coordinator.scheduling.sources.parse_locality_document`."""
        model = self.model
        with model.lock:
            datasets = {}
            for name in model.datasets:
                locality = self.locality(name)
                datasets[name] = {
                    "size": locality["bytes"],
                    "nodes": {
                        row["node"]: row["cached_bytes"]
                        for row in locality["nodes"]
                        if row["state"] == "up"
                    },
                }
            now = model.now()
            nodes = {}
            for name, node in model.nodes.items():
                if not model.is_up(node, now):
                    continue
                nodes[name] = {
                    "gpus": node.gpus,
                    "free_gpus": node.gpus,
                    "cache_capacity": node.cache_capacity,
                    "cache_used": min(node.cache_used, node.cache_capacity),
                }
            return {"datasets": datasets, "nodes": nodes}

    # --- preload -------------------------------------------------------------------------------

    def start_preload(
        self, dataset: str, selection: Selection, *, copy: str | None = None
    ) -> JsonDoc:
        model = self.model
        with model.lock:
            state = model.dataset(dataset)
            copy_id = copy or next(iter(state.copies))
            if copy_id not in state.copies:
                raise StateConflict(f"dataset {dataset!r} has no copy {copy_id!r}")
            now = model.now()
            job = PreloadJob(
                id=f"{dataset}-{int(now * 1000):013d}-{secrets.token_hex(2)}",
                dataset=dataset,
                copy=copy_id,
                selection=selection,
                created_at=now,
            )
            job.advance(now)
            model.save_preload(job)
            model.preloads[job.id] = job
            log.info("preload %s of %r: %s", job.id, dataset, selection.describe())
            return self._preload_doc(job)

    def resume_preload(self, dataset: str) -> JsonDoc:
        """A new job with the latest job's selection: blocks already cached are skipped, so
        only what is missing (e.g. objects that failed) is fetched."""
        with self.model.lock:
            latest = self._latest_preload(dataset)
            if latest.state in ("running", "scheduled"):
                return self._preload_doc(latest)
            selection = Selection(**{**latest.selection.__dict__, "at": None})
            return self.start_preload(dataset, selection, copy=latest.copy)

    def cancel_preload(self, dataset: str) -> JsonDoc:
        with self.model.lock:
            job = self._latest_preload(dataset)
            if job.state in ("running", "scheduled"):
                job.state = "cancelled"
                job.finished_at = self.model.now()
                self.model.save_preload(job)
            return self._preload_doc(job)

    def _latest_preload(self, dataset: str) -> PreloadJob:
        self.model.dataset(dataset)
        jobs = [job for job in self.model.preloads.values() if job.dataset == dataset]
        if not jobs:
            raise PreloadNotFound(f"dataset {dataset!r} has no preload job")
        return max(jobs, key=lambda job: job.created_at)

    def preload_status(self, dataset: str) -> JsonDoc:
        with self.model.lock:
            return self._preload_doc(self._latest_preload(dataset))

    def preload_job(self, job_id: str) -> JsonDoc:
        with self.model.lock:
            job = self.model.preloads.get(job_id)
            if job is None:
                raise PreloadNotFound(f"no preload job {job_id!r}")
            return self._preload_doc(job)

    def list_preloads(self) -> list[JsonDoc]:
        with self.model.lock:
            return [
                self._preload_doc(job)
                for job in sorted(self.model.preloads.values(), key=lambda j: j.created_at)
            ]

    def _owners(self, job: PreloadJob) -> list[str | None]:
        live = self.model.live_copy_nodes(job.dataset, job.copy)
        return [shard_owner(job.dataset, shard, live) for shard in range(SHARDS)]

    def _preload_doc(self, job: PreloadJob) -> JsonDoc:
        return job.progress(self._owners(job), self.model.now())

    def _record_preload_progress(self, node: str, job_id: str, shards: JsonDoc) -> None:
        job = self.model.preloads.get(job_id)
        if job is None or job.state != "running" or job.dataset not in self.model.datasets:
            return
        owners = self._owners(job)
        changed = False
        for shard_text, report in shards.items():
            shard = int(shard_text)
            if 0 <= shard < SHARDS and owners[shard] == node:
                changed |= job.record(shard, node, report)
        if job.advance(self.model.now(), owners) or changed:
            self.model.save_preload(job)

    def tick(self) -> None:
        """Periodic: start scheduled preloads whose time has come, finish jobs whose shards
        are all done (also after a node went down and its shards moved)."""
        model = self.model
        with model.lock:
            now = model.now()
            for job in model.preloads.values():
                active = job.state in ("scheduled", "running") and job.dataset in model.datasets
                if active and job.copy not in model.datasets[job.dataset].copies:
                    job.state, job.finished_at = "cancelled", now  # its copy was cleaned up
                    model.save_preload(job)
                elif active and job.advance(now, self._owners(job)):
                    model.save_preload(job)
