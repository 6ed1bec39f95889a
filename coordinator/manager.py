"""The CacheManager (P1's TDCS): jobs sharing cached copies, Suspend / Clone, cleanup, scaling.

- **Jobs.** A training job registers with the dataset it reads and how many nodes it wants. It
  is placed on a copy of the dataset (TDCS ranking: the copy's nodes among its candidates
  first) and counts against that copy until released. Jobs are durable; a job whose owner stops
  renewing its lease is released, so a crashed client cannot leak a copy's capacity.
- **Hot copies.** At most ``max_jobs_per_copy`` jobs share one copy. Over the limit the
  dataset's ``overflow`` policy applies: ``suspend`` queues the job (FIFO per dataset; the head
  is placed as soon as a copy has room), ``clone`` makes a new copy on candidate nodes outside
  every copy (most free cache first) and places the job there at once; the clone's owners copy
  blocks from the source copy's peers, not the object store, while the job already reads.
- **Cleanup** per dataset: ``lock`` never frees; ``ttl:<d>`` frees a copy no job used and no
  node read for ``d`` (a clone is removed, the last copy kept empty); ``lru`` frees, on a node
  whose cache is nearly full, the least recently used such dataset. Freeing is a task sent to
  the node in its heartbeat reply; workers never touch their reserve.
- **Scaling** (the CacheScaler's API trigger): a copy gains or loses nodes; rendezvous hashing
  moves only the shards whose owner changed, and the new owners copy those from the previous
  owners (a hand-off, like a clone's fill) before the old nodes drop what they no longer own.

**The hand-off invariant: a node drops a shard it handed off only once another node holds it.**
A fill is named by (dataset, copy, id) in the view, in the workers' reports and here; a fill
ends when every live node of the copy reported it done (or it timed out). Then, for every node
that held data of the copy before (its previous nodes, the nodes leaving it, and nodes still
waiting from an earlier hand-off), :meth:`CacheManager._settle_hand_off` compares heartbeats:
a shard the node holds and no longer owns is trimmed (a ``trim`` task naming the shards) only
if the shard's owner in the copy now reports at least as many bytes of it
(:func:`~coordinator.copies.split_handed_off`) and no block of it failed to copy in a fill
(``copy.failed_in_fill``, :meth:`CacheManager._note_failed_shards`); the others wait in the
copy's ``handed_off`` and are judged again on every tick. A scale folds the trims still
pending for the copy back into ``handed_off``, so a trim decided before a scale is never
carried out after it; a worker also never trims a shard it owns under its current view
(:mod:`cachefs.cluster.tasks`).

Everything runs under the :class:`~coordinator.cluster.Cluster`'s lock and writes through to
its state store before answering. Lease renewals are kept in memory: a restarted coordinator
gives every job one full lease to renew.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from cachefs.errors import CachefsError, ConfigError
from cachefs.protocol import SHARDS, CleanupPolicy, shard_owner

from .copies import (
    CopyState,
    FillState,
    Locality,
    choose_copy,
    clone_nodes,
    next_copy_id,
    rank_nodes,
    split_handed_off,
)
from .errors import CopyNotFound, StateConflict

if TYPE_CHECKING:
    from .cluster import Cluster, DatasetState

log = logging.getLogger("coordinator.manager")

EVENTS_KEPT = 1000


class JobNotFound(CachefsError):
    pass


class JobExists(CachefsError):
    pass


class CopyBusy(CachefsError):
    """The copy is still being filled (a clone or an earlier scale's hand-off)."""


@dataclass
class Job:
    id: str
    dataset: str
    nodes_wanted: int
    candidates: list[str] | None  # None: every live node
    lease_s: float  # 0: no lease (released only explicitly)
    seq: int  # submission order: the suspend queue is FIFO by it
    submitted_at: float
    state: str = "suspended"  # running | suspended
    copy: str | None = None
    nodes: list[str] = field(default_factory=list)  # the placement, best first
    ranking: list[dict] = field(default_factory=list)  # every candidate, with the reason
    explanation: str = ""
    started_at: float | None = None
    cloned: bool = False  # placed on a copy made for it

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Job:
        return cls(**data)

    def same_request(self, dataset: str, nodes_wanted: int, candidates: list[str] | None) -> bool:
        return (self.dataset, self.nodes_wanted, self.candidates) == (
            dataset,
            nodes_wanted,
            candidates,
        )


@dataclass
class Task:
    """Work for one worker, sent in its heartbeat replies until it acknowledges it."""

    id: str
    node: str
    kind: str  # "free": drop the dataset's blocks; "trim": drop the listed shards
    dataset: str
    reason: str
    created_at: float
    copy: str | None = None  # trim: the copy whose hand-off it ends
    shards: list[int] | None = None  # trim: the shards the node may drop (their owner holds them)

    def to_json(self) -> dict:
        return asdict(self)


class CacheManager:
    def __init__(
        self,
        cluster: Cluster,
        *,
        job_lease_s: float = 600.0,
        lru_high_watermark: float = 0.9,
        fill_timeout_s: float = 3600.0,
    ) -> None:
        self.cluster = cluster
        self.store = cluster.store
        self._clock = cluster._clock
        self.job_lease_s = job_lease_s
        self.lru_high_watermark = lru_high_watermark
        self.fill_timeout_s = fill_timeout_s
        now = self._clock()
        self.jobs: dict[str, Job] = {}
        for _key, value in self.store.list("jobs/"):
            job = Job.from_json(json.loads(value))
            self.jobs[job.id] = job
        self._renewed_at = {job_id: now for job_id in self.jobs}
        self._job_seq = max((job.seq for job in self.jobs.values()), default=0)
        self.tasks: dict[str, Task] = {}
        for _key, value in self.store.list("tasks/"):
            task = Task(**json.loads(value))
            self.tasks[task.id] = task
        self.events: deque[dict] = deque(
            (json.loads(value) for _key, value in self.store.list("events/")), maxlen=EVENTS_KEPT
        )
        # Soft state, rebuilt from heartbeats.
        # node -> {(dataset, copy, fill id): its latest report}; a fill's reports are dropped
        # when it ends and a dataset's when it is removed (a re-added dataset numbers its fills
        # from 1 again).
        self._fill_reports: dict[str, dict[tuple[str, str, str], dict]] = {}
        self._lru_freed: dict[tuple[str, str], float] = {}  # (node, dataset) -> when
        self.freed_bytes: dict[tuple[str, str], int] = {}  # (dataset, task kind) -> bytes
        #: Bumped whenever a job changes: long-polls compare it instead of taking the lock.
        self.version = 0

    # --- jobs ----------------------------------------------------------------------------------

    def submit(
        self,
        job_id: str,
        dataset: str,
        nodes_wanted: int,
        candidates: list[str] | None = None,
        lease_s: float | None = None,
    ) -> dict:
        with self.cluster._lock:
            state = self.cluster._dataset(dataset)
            existing = self.jobs.get(job_id)
            if existing is not None:
                if existing.same_request(dataset, nodes_wanted, candidates):
                    return self.job_doc(existing)  # a client retrying its submission
                raise JobExists(f"job {job_id!r} already exists (on dataset {existing.dataset!r})")
            if nodes_wanted < 1:
                raise ConfigError("a job needs at least one node")
            usable = self._candidates(candidates)
            if len(usable) < nodes_wanted:
                raise StateConflict(
                    f"job {job_id!r} wants {nodes_wanted} nodes but only {len(usable)} "
                    f"candidate nodes are up ({', '.join(usable) or 'none'})"
                )
            now = self._clock()
            self._job_seq += 1
            job = Job(
                id=job_id,
                dataset=dataset,
                nodes_wanted=nodes_wanted,
                candidates=candidates,
                lease_s=self.job_lease_s if lease_s is None else lease_s,
                seq=self._job_seq,
                submitted_at=now,
            )
            ahead = self._queue(dataset)
            if ahead:
                job.explanation = (
                    f"suspended behind {len(ahead)} earlier job(s) of {dataset} (FIFO)"
                )
            else:
                self._place(job, state)
            self.jobs[job.id] = job
            self._renewed_at[job.id] = now
            self._save_job(job)
            self._event("job", dataset, job.copy, f"job {job.id}: {job.explanation}", job=job.id)
            return self.job_doc(job)

    def _is_up(self, node: str, now: float) -> bool:
        state = self.cluster.nodes.get(node)
        return state is not None and self.cluster.is_up(state, now)

    def _candidates(self, candidates: list[str] | None) -> list[str]:
        """S2: the candidates that are live workers (names the coordinator does not know, or
        nodes that are down, cannot hold the job's data, so they are left out)."""
        now = self._clock()
        live = {name for name, node in self.cluster.nodes.items() if self.cluster.is_up(node, now)}
        return sorted(live if candidates is None else live & set(candidates))

    def _queue(self, dataset: str) -> list[Job]:
        """The suspended jobs of ``dataset``, head first."""
        waiting = [j for j in self.jobs.values() if j.dataset == dataset and j.state == "suspended"]
        return sorted(waiting, key=lambda j: j.seq)

    def job_counts(self, dataset: str) -> dict[str, int]:
        """Running and suspended jobs of ``dataset``."""
        running = sum(self._running_per_copy(dataset).values())
        return {"running": running, "suspended": len(self._queue(dataset))}

    def _running_per_copy(self, dataset: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.jobs.values():
            if job.dataset == dataset and job.state == "running" and job.copy:
                counts[job.copy] = counts.get(job.copy, 0) + 1
        return counts

    def _locality(self, dataset: str) -> Locality:
        size, cached = 0, {}
        now = self._clock()
        for name, node in self.cluster.nodes.items():
            report = node.datasets.get(dataset)
            if report is None or not self.cluster.is_up(node, now):
                continue
            size = max(size, report.get("bytes", 0))
            cached[name] = report.get("cached_bytes", 0)
        return Locality(size, cached)

    def _place(self, job: Job, state: DatasetState) -> bool:
        """Place ``job`` on a copy with room, or clone one; else leave it suspended with the
        reason. Returns whether it runs now."""
        name = state.spec.name
        limit = state.spec.max_jobs_per_copy
        per_copy = self._running_per_copy(name)
        candidates = self._candidates(job.candidates)
        if len(candidates) < job.nodes_wanted:
            job.explanation = (
                f"waiting for {job.nodes_wanted} candidate nodes to be up ({len(candidates)} are)"
            )
            return False
        locality = self._locality(name)
        open_copies = [
            (copy_id, self.cluster.live_copy_nodes(name, copy_id))
            for copy_id in state.copies
            if limit is None or per_copy.get(copy_id, 0) < limit
        ]
        copy_id = choose_copy(open_copies, set(candidates), locality)
        cloned = False
        if copy_id is None and state.spec.overflow == "clone":
            copy_id = self._clone(job, state, candidates, locality)
            cloned = copy_id is not None
        if copy_id is None:
            if state.spec.overflow == "clone":
                job.explanation = (
                    f"suspended: every copy of {name} runs {limit} jobs and fewer than "
                    f"{job.nodes_wanted} candidate nodes are outside its copies to clone onto"
                )
            else:
                job.explanation = (
                    f"suspended: every copy of {name} runs {limit} jobs (max_jobs_per_copy)"
                )
            return False
        ranked = rank_nodes(
            candidates, copy_id, self.cluster.live_copy_nodes(name, copy_id), locality
        )
        job.state, job.copy, job.cloned = "running", copy_id, cloned
        job.ranking = [row.to_json() for row in ranked]
        job.nodes = [row.node for row in ranked[: job.nodes_wanted]]
        job.started_at = self._clock()
        in_copy = sum(1 for row in ranked[: job.nodes_wanted] if row.in_copy)
        job.explanation = (
            f"{'running on new copy' if cloned else 'running on copy'} {copy_id}: "
            f"{in_copy} of {job.nodes_wanted} nodes hold the copy"
        )
        self._touch_copy(state, copy_id)
        self.version += 1
        return True

    def _clone(
        self, job: Job, state: DatasetState, candidates: list[str], locality: Locality
    ) -> str | None:
        name = state.spec.name
        in_copies = set()
        for copy_id in state.copies:
            in_copies.update(self.cluster.copy_nodes(name, copy_id))
        free = self._free_cache()
        chosen = clone_nodes(candidates, in_copies, free, job.nodes_wanted)
        if chosen is None:
            return None
        # Fill from the copy holding the most data now.
        source = max(
            state.copies,
            key=lambda c: sum(
                locality.cached.get(n, 0) for n in self.cluster.live_copy_nodes(name, c)
            ),
        )
        copy_id = next_copy_id(state.copies)
        now = self._clock()
        state.copies[copy_id] = CopyState(
            nodes=chosen,
            created_at=now,
            origin=f"clone of {source} for job {job.id}",
            fill=FillState(
                id=self._fill_id(state, copy_id),
                sources=self.cluster.copy_nodes(name, source),
                leaving=[],
                reason=f"clone of copy {source}",
                started_at=now,
            ),
        )
        self.cluster._save_dataset(state)
        self._cancel_tasks(name, chosen)
        self._event(
            "clone", name, copy_id, f"copy {copy_id} of {name} cloned from {source} onto "
            f"{', '.join(chosen)} for job {job.id}", nodes=chosen, source=source,
        )  # fmt: skip
        return copy_id

    @staticmethod
    def _fill_id(state: DatasetState, copy_id: str) -> str:
        state.fill_seq += 1
        return f"{copy_id}-{state.fill_seq}"

    def _free_cache(self) -> dict[str, int]:
        return {
            name: max(0, node.cache_capacity - node.cache_used)
            for name, node in self.cluster.nodes.items()
        }

    def _touch_copy(self, state: DatasetState, copy_id: str) -> None:
        copy = state.copies.get(copy_id)
        if copy is not None:
            copy.last_used_at = self._clock()
            copy.freed_at = None
            self.cluster._save_dataset(state)

    def release(self, job_id: str, *, reason: str = "released") -> dict:
        with self.cluster._lock:
            job = self._job(job_id)
            del self.jobs[job_id]
            self._renewed_at.pop(job_id, None)
            self.store.delete(f"jobs/{job_id}")
            self.version += 1
            state = self.cluster.datasets.get(job.dataset)
            if state is not None and job.state == "running" and job.copy:
                self._touch_copy(state, job.copy)
            self._event("job", job.dataset, job.copy, f"job {job_id} {reason}", job=job_id)
            promoted = self._promote(job.dataset)
            return {"id": job_id, "released": True, "reason": reason, "promoted": promoted}

    def _promote(self, dataset: str) -> list[str]:
        """Place suspended jobs of ``dataset`` in FIFO order while they fit: the head first, and
        a head that cannot run yet holds the others back."""
        state = self.cluster.datasets.get(dataset)
        if state is None:
            return []
        promoted = []
        for job in self._queue(dataset):
            if not self._place(job, state):
                break
            self._save_job(job)
            waited = (job.started_at or 0) - job.submitted_at
            self._event(
                "job", dataset, job.copy,
                f"job {job.id} promoted after {waited:.1f} s: {job.explanation}", job=job.id,
            )  # fmt: skip
            promoted.append(job.id)
        return promoted

    def policy_changed(self, dataset: str, changes: dict) -> None:
        described = ", ".join(f"{k}={v}" for k, v in sorted(changes.items()))
        self._event("policy", dataset, None, f"policy of {dataset} changed: {described}")
        self._promote(dataset)

    def renew(self, job_id: str) -> dict:
        with self.cluster._lock:
            job = self._job(job_id)
            self._renewed_at[job_id] = self._clock()
            return self.job_doc(job)

    def job(self, job_id: str) -> dict:
        with self.cluster._lock:
            return self.job_doc(self._job(job_id))

    def list_jobs(self, dataset: str | None = None) -> list[dict]:
        with self.cluster._lock:
            jobs = sorted(self.jobs.values(), key=lambda j: j.seq)
            return [self.job_doc(j) for j in jobs if dataset is None or j.dataset == dataset]

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise JobNotFound(f"no job named {job_id!r} (never submitted, or released)")
        return job

    def job_doc(self, job: Job) -> dict:
        """The job as the API shows it. ``nodes`` are the placed nodes that are up now: one that
        went down is listed under ``down_nodes`` instead (it is back in ``nodes`` once it is up
        again), so a job never points its owner at a dead node."""
        now = self._clock()
        doc = job.to_json()
        down = [node for node in job.nodes if not self._is_up(node, now)]
        doc["nodes"] = [node for node in job.nodes if node not in down]
        doc["down_nodes"] = down
        if down:
            doc["explanation"] += f" ({', '.join(down)} down now)"
            doc["ranking"] = [
                {**row, "why": row["why"] + " (down now)"} if row["node"] in down else row
                for row in job.ranking
            ]
        if job.state == "suspended":
            queue = self._queue(job.dataset)
            doc["position"] = next(i for i, j in enumerate(queue, 1) if j.id == job.id)
            doc["waited_s"] = round(now - job.submitted_at, 3)
        else:
            doc["position"] = None
            doc["waited_s"] = round((job.started_at or now) - job.submitted_at, 3)
        renewed = self._renewed_at.get(job.id, now)
        doc["lease_expires_in_s"] = (
            round(job.lease_s - (now - renewed), 3) if job.lease_s > 0 else None
        )
        return doc

    def _save_job(self, job: Job) -> None:
        self.cluster._save(f"jobs/{job.id}", job.to_json())

    # --- scaling -------------------------------------------------------------------------------

    def scale(self, dataset: str, copy_id: str, add: list[str], remove: list[str]) -> dict:
        """Add and remove nodes of a copy. The shards whose owner changes are handed off: the
        new owners copy them from the old ones (who keep serving them meanwhile), then the old
        owners drop what they no longer own."""
        from .cluster import NodeNotFound

        with self.cluster._lock:
            state = self.cluster._dataset(dataset)
            copy = state.copies.get(copy_id)
            if copy is None:
                raise CopyNotFound(f"dataset {dataset!r} has no copy {copy_id!r}")
            if copy.fill is not None:
                raise CopyBusy(
                    f"copy {copy_id} of {dataset} is still being filled ({copy.fill.reason}, "
                    f"fill {copy.fill.id}); scale it again once that is done"
                )
            unknown = sorted(set(add) - set(self.cluster.nodes))
            if unknown:
                raise NodeNotFound(f"no node named {', '.join(map(repr, unknown))}")
            current = self.cluster.copy_nodes(dataset, copy_id)
            elsewhere = {
                node
                for other in state.copies
                if other != copy_id
                for node in self.cluster.copy_nodes(dataset, other)
            }
            clash = sorted(set(add) & elsewhere)
            if clash:
                raise StateConflict(
                    f"{', '.join(clash)} already belong to another copy of {dataset}"
                )
            absent = sorted(set(remove) - set(current))
            if absent:
                raise StateConflict(f"{', '.join(absent)} are not in copy {copy_id} of {dataset}")
            new = sorted((set(current) | set(add)) - set(remove))
            if not new:
                raise StateConflict(f"copy {copy_id} of {dataset} needs at least one node")
            if new == current:
                return self.cluster.dataset_status(dataset)
            now = self._clock()
            live_before = self.cluster.live_copy_nodes(dataset, copy_id)
            copy.nodes = new
            live_after = self.cluster.live_copy_nodes(dataset, copy_id)
            moved = sum(
                shard_owner(dataset, shard, live_before) != shard_owner(dataset, shard, live_after)
                for shard in range(SHARDS)
            )
            added, removed = sorted(set(new) - set(current)), sorted(set(current) - set(new))
            copy.fill = FillState(
                id=self._fill_id(state, copy_id),
                sources=current,
                leaving=removed,
                reason=f"scale: +{','.join(added) or '-'} -{','.join(removed) or '-'}",
                started_at=now,
            )
            self._fold_pending_trims(dataset, copy_id, copy)
            self.cluster._save_dataset(state)
            self._cancel_tasks(dataset, added)
            self._event(
                "scale", dataset, copy_id,
                f"copy {copy_id} of {dataset} scaled to {', '.join(new)} "
                f"(added {', '.join(added) or 'none'}, removed {', '.join(removed) or 'none'}): "
                f"{moved} of {SHARDS} shards change owner and are handed off",
                added=added, removed=removed, moved_shards=moved,
            )  # fmt: skip
            return {**self.cluster.dataset_status(dataset), "moved_shards": moved}

    def _finish_fills(self, now: float) -> None:
        for name, state in self.cluster.datasets.items():
            for copy_id, copy in state.copies.items():
                fill = copy.fill
                if fill is None:
                    continue
                live = self.cluster.live_copy_nodes(name, copy_id)
                reports = [self._fill_report(node, name, copy_id, fill.id) for node in live]
                done = all(r and r.get("done") for r in reports)
                timed_out = now - fill.started_at > self.fill_timeout_s
                if not (done or timed_out):
                    continue
                copied = sum(r.get("copied_bytes", 0) for r in reports if r)
                absent = sum(r.get("absent_blocks", 0) for r in reports if r)
                failed = sum(r.get("failed_blocks", 0) for r in reports if r)
                copy.fill = None
                for node in list(self._fill_reports):
                    self._fill_reports[node].pop((name, copy_id, fill.id), None)
                    if not self._fill_reports[node]:
                        del self._fill_reports[node]
                outcome = "timed out" if not done else "done"
                message = (
                    f"fill {fill.id} of copy {copy_id} ({fill.reason}) {outcome}: {copied} bytes "
                    f"copied from peers, {absent} blocks the sources did not hold, {failed} failed"
                )
                details = {"copied_bytes": copied, "absent_blocks": absent, "failed_blocks": failed}
                if fill.hands_off:
                    # The invariant (module docstring): the nodes that held the copy's data drop
                    # only the shards their new owner holds; the rest wait in ``handed_off``.
                    self._note_failed_shards(
                        name, copy_id, copy, fill, dict(zip(live, reports, strict=True))
                    )
                    holders = set(fill.sources) | set(fill.leaving) | set(copy.handed_off)
                    trimmed, kept = self._settle_hand_off(
                        name, copy_id, copy, holders, None, f"hand-off {fill.id} finished"
                    )
                    message += f"; {trimmed} shards dropped by the nodes that handed them off"
                    if kept:
                        message += f", {kept} kept until their new owner holds them"
                    details.update(trimmed_shards=trimmed, kept_shards=kept)
                self.cluster._save_dataset(state)
                self._event("fill", name, copy_id, message, **details)

    def _note_failed_shards(
        self,
        dataset: str,
        copy_id: str,
        copy: CopyState,
        fill: FillState,
        reports: dict[str, dict | None],
    ) -> None:
        """A hand-off's fill ended: record in ``copy.failed_in_fill`` the shards whose new owner
        failed to copy blocks (their holders keep them whatever the bytes say), and take out the
        shards recorded by an earlier fill that this one walked without a failure. Only a node
        that reported done walked its shards, and only one with no absent blocks proves them
        whole: this fill's source for a shard is its previous owner, which may lack blocks the
        earlier holder still has."""
        failed: set[int] = set()
        for report in reports.values():
            for shard, count in ((report or {}).get("failed_shards") or {}).items():
                if count > 0:
                    failed.add(int(shard))
        recorded = set(copy.failed_in_fill)
        if recorded:
            live = self.cluster.live_copy_nodes(dataset, copy_id)
            sources = [
                n for n in fill.sources
                if n in self.cluster.nodes and self.cluster.is_up(self.cluster.nodes[n])
            ]  # fmt: skip
            for shard in sorted(recorded):
                owner = shard_owner(dataset, shard, live)
                source = shard_owner(dataset, shard, sources)
                report = reports.get(owner) if owner is not None else None
                walked = source not in (None, owner) and report is not None and report.get("done")
                if walked and not report.get("absent_blocks", 0) and shard not in failed:
                    recorded.discard(shard)
        copy.failed_in_fill = sorted(recorded | failed)

    @staticmethod
    def _forget_failed_not_held(copy: CopyState) -> None:
        """A shard no node holds back any more needs no confirming: nothing can be lost."""
        held_back = {shard for shards in copy.handed_off.values() for shard in shards}
        copy.failed_in_fill = [s for s in copy.failed_in_fill if s in held_back]

    def _fill_report(self, node: str, dataset: str, copy_id: str, fill_id: str) -> dict | None:
        """``node``'s latest report of the fill (dataset, copy, id), or None."""
        return self._fill_reports.get(node, {}).get((dataset, copy_id, fill_id))

    # --- the hand-off invariant ----------------------------------------------------------------

    def _shard_bytes(self, node: str, dataset: str) -> dict[int, int]:
        """``node``'s cached bytes of ``dataset`` per shard, as of its latest heartbeat."""
        state = self.cluster.nodes.get(node)
        report = state.datasets.get(dataset) if state is not None else None
        shards = (report or {}).get("shards") or {}
        return {int(shard): nbytes for shard, nbytes in shards.items()}

    def _owned_among(self, dataset: str, node: str, shards: set[int]) -> set[int]:
        """Those of ``shards`` that ``node`` owns in its own copy of ``dataset`` now (none when
        it is in no copy, or down)."""
        for copy_id in self.cluster.datasets[dataset].copies:
            if node in self.cluster.copy_nodes(dataset, copy_id):
                live = self.cluster.live_copy_nodes(dataset, copy_id)
                return {shard for shard in shards if shard_owner(dataset, shard, live) == node}
        return set()

    def _settle_hand_off(
        self,
        dataset: str,
        copy_id: str,
        copy: CopyState,
        nodes: set[str],
        only: dict[str, list[int]] | None,
        reason: str,
    ) -> tuple[int, int]:
        """Apply the hand-off invariant to ``nodes`` (every shard they hold, or ``only`` those
        listed per node): a ``trim`` task for the shards whose owner in the copy holds them, the
        others recorded in ``copy.handed_off``. Returns (shards trimmed, shards kept). The
        caller saves the dataset."""
        live = self.cluster.live_copy_nodes(dataset, copy_id)
        trimmed = kept = 0
        for node in sorted(nodes):
            held = self._shard_bytes(node, dataset)
            if only is not None:
                listed = set(only.get(node, ()))
                held = {shard: nbytes for shard, nbytes in held.items() if shard in listed}
            owners = {shard: shard_owner(dataset, shard, live) for shard in held}
            owner_holds = {
                owner: self._shard_bytes(owner, dataset)
                for owner in set(owners.values())
                if owner is not None
            }
            owned = self._owned_among(dataset, node, set(held))
            trim, wait = split_handed_off(
                node, held, owned, owners, owner_holds, set(copy.failed_in_fill)
            )
            if trim:
                self._add_task(node, "trim", dataset, reason, copy=copy_id, shards=sorted(trim))
            if wait:
                copy.handed_off[node] = sorted(wait)
            else:
                copy.handed_off.pop(node, None)
            trimmed, kept = trimmed + len(trim), kept + len(wait)
        self._forget_failed_not_held(copy)
        return trimmed, kept

    def _settle_waiting_hand_offs(self) -> None:
        """Judge again the shards kept after a hand-off (their owner may hold them now: read
        through, preloaded). Not while the copy is filling: that fill's end judges them."""
        for name, state in self.cluster.datasets.items():
            for copy_id, copy in state.copies.items():
                if copy.fill is not None or not copy.handed_off:
                    continue
                before = dict(copy.handed_off)
                waiting = set(before)
                trimmed, _ = self._settle_hand_off(
                    name, copy_id, copy, waiting, before, "shards handed off earlier: "
                    f"their owner in copy {copy_id} holds them now",
                )  # fmt: skip
                if copy.handed_off != before:
                    self.cluster._save_dataset(state)
                if trimmed:
                    self._event(
                        "trim", name, copy_id,
                        f"{trimmed} shards of copy {copy_id} handed off earlier are dropped by "
                        f"{', '.join(sorted(waiting))}: their owner holds them now",
                        trimmed_shards=trimmed,
                    )  # fmt: skip

    def _fold_pending_trims(self, dataset: str, copy_id: str, copy: CopyState) -> None:
        """A scale starts: trims of the copy not yet acknowledged were decided under the old
        membership. They go back to ``handed_off``, judged again when this scale's fill ends
        (a worker may still be running one: it never drops a shard it owns then)."""
        for task in list(self.tasks.values()):
            if task.dataset == dataset and task.kind == "trim" and task.copy == copy_id:
                waiting = set(copy.handed_off.get(task.node, ())) | set(task.shards or ())
                copy.handed_off[task.node] = sorted(waiting)
                self.store.delete(f"tasks/{task.id}")
                del self.tasks[task.id]

    # --- cleanup -------------------------------------------------------------------------------

    def _last_read(self, dataset: str, nodes: list[str]) -> float:
        return max(
            (
                self.cluster.nodes[n].datasets.get(dataset, {}).get("last_read_at", 0.0)
                for n in nodes
                if n in self.cluster.nodes
            ),
            default=0.0,
        )

    def _last_preload(self, dataset: str, copy_id: str) -> float:
        """When a preload of the copy last ended: freshly preloaded data counts as used."""
        return max(
            (
                p.finished_at or p.created_at
                for p in self.cluster.preloads.values()
                if p.dataset == dataset and p.copy == copy_id
            ),
            default=0.0,
        )

    def _copy_busy(self, dataset: str, copy_id: str) -> bool:
        """A job runs on it, a preload fills it or it is being filled from peers."""
        if any(j.dataset == dataset and j.copy == copy_id for j in self.jobs.values()):
            return True
        return any(
            p.dataset == dataset and p.copy == copy_id and p.state in ("running", "scheduled")
            for p in self.cluster.preloads.values()
        )

    def _cleanup_ttl(self, now: float) -> None:
        for name, state in list(self.cluster.datasets.items()):
            policy = CleanupPolicy.parse(state.spec.cleanup)
            if policy.kind != "ttl":
                continue
            for copy_id in reversed(list(state.copies)):  # newest first: clones go first
                copy = state.copies[copy_id]
                if copy.fill is not None or self._copy_busy(name, copy_id):
                    continue
                nodes = self.cluster.copy_nodes(name, copy_id)
                last_used = max(
                    copy.created_at,
                    copy.last_used_at,
                    self._last_read(name, nodes),
                    self._last_preload(name, copy_id),
                )
                if copy.freed_at is not None and copy.freed_at >= last_used:
                    continue  # freed, and nobody used it since
                idle = now - last_used
                if idle < policy.ttl_s:
                    continue
                reason = f"ttl: copy {copy_id} idle for {idle:.0f} s (ttl {policy.ttl_s:g} s)"
                for node in nodes:
                    self._add_task(node, "free", name, reason)
                if len(state.copies) > 1:
                    del state.copies[copy_id]
                    what = "freed and removed"
                else:
                    copy.freed_at = now
                    what = "freed (kept as the dataset's only copy)"
                self.cluster._save_dataset(state)
                self._event("cleanup", name, copy_id, f"copy {copy_id} of {name} {what}: {reason}")

    def _cleanup_lru(self, now: float) -> None:
        """On each node whose cache is at least ``lru_high_watermark`` full, free the least
        recently used ``lru`` dataset — one at a time, re-judged on the next heartbeat."""
        busy_nodes = {task.node for task in self.tasks.values()}
        in_use = {job.dataset for job in self.jobs.values()}
        for name, node in self.cluster.nodes.items():
            if name in busy_nodes or not self.cluster.is_up(node, now):
                continue
            capacity, used = node.cache_capacity, node.cache_used
            if not capacity or used / capacity < self.lru_high_watermark:
                continue
            held = {
                dataset: report
                for dataset, report in node.datasets.items()
                if dataset in self.cluster.datasets and report.get("cached_bytes", 0) > 0
            }
            if len(held) < 2:
                continue  # freeing the one dataset being read would only make it thrash

            def last_used(dataset: str, held: dict[str, dict] = held) -> float:
                return max(
                    held[dataset].get("last_read_at", 0.0),
                    self.cluster.datasets[dataset].spec.created_at,
                )

            newest = max(held, key=last_used)
            candidates = [
                dataset
                for dataset in held
                if dataset != newest
                and dataset not in in_use
                and CleanupPolicy.parse(self.cluster.datasets[dataset].spec.cleanup).kind == "lru"
                and self._lru_freed.get((name, dataset), -1.0) < last_used(dataset)
            ]
            if not candidates:
                continue
            victim = min(candidates, key=last_used)
            self._lru_freed[(name, victim)] = now
            reason = (
                f"lru: {name}'s cache is {used / capacity:.0%} full; {victim} is its least "
                f"recently used dataset (last read {now - last_used(victim):.0f} s ago)"
            )
            self._add_task(name, "free", victim, reason)
            self._event("cleanup", victim, None, f"{victim} freed on {name}: {reason}", node=name)

    # --- tasks and heartbeats ------------------------------------------------------------------

    def _add_task(
        self,
        node: str,
        kind: str,
        dataset: str,
        reason: str,
        *,
        copy: str | None = None,
        shards: list[int] | None = None,
    ) -> None:
        task = Task(
            f"t-{secrets.token_hex(6)}", node, kind, dataset, reason, self._clock(), copy, shards
        )
        self.cluster._save(f"tasks/{task.id}", task.to_json())
        self.tasks[task.id] = task

    def _cancel_tasks(self, dataset: str, nodes: list[str]) -> None:
        """Nodes joining a copy keep their blocks: drop pending frees of the dataset there."""
        for task in list(self.tasks.values()):
            if task.dataset == dataset and task.node in nodes:
                self.store.delete(f"tasks/{task.id}")
                del self.tasks[task.id]

    def tasks_for(self, node: str) -> list[dict]:
        tasks = [t for t in self.tasks.values() if t.node == node]
        return [
            {"id": t.id, "kind": t.kind, "dataset": t.dataset, "reason": t.reason}
            | ({"shards": t.shards} if t.shards is not None else {})
            for t in sorted(tasks, key=lambda t: t.created_at)
        ]

    def fills_view(self, dataset: str, state: DatasetState) -> dict:
        return {
            copy_id: {
                "id": copy.fill.id,
                "from": sorted(
                    n for n in copy.fill.sources if n in self.cluster.nodes
                    and self.cluster.is_up(self.cluster.nodes[n])
                ),
            }
            for copy_id, copy in state.copies.items()
            if copy.fill is not None
        }  # fmt: skip

    def on_heartbeat(self, node: str, report: dict) -> None:
        for task_id, result in report.get("tasks_done", {}).items():
            task = self.tasks.pop(task_id, None)
            if task is None or task.node != node:
                if task is not None:
                    self.tasks[task_id] = task  # another node's: not this one's to finish
                continue
            self.store.delete(f"tasks/{task_id}")
            freed = result.get("freed_bytes", 0)
            key = (task.dataset, task.kind)
            self.freed_bytes[key] = self.freed_bytes.get(key, 0) + freed
            error = result.get("error")
            self._event(
                "freed", task.dataset, None,
                f"{node} {'failed to free' if error else 'freed'} {freed} bytes of "
                f"{task.dataset} ({task.kind}: {task.reason})" + (f": {error}" if error else ""),
                node=node, freed_bytes=freed,
            )  # fmt: skip
        # Only a copy's current fill counts: a heartbeat sent before the node saw a fill end
        # still reports it, and keeping that report would leak it (_finish_fills dropped the
        # fill's reports already).
        for dataset, fill in report.get("fills", {}).items():
            key = (dataset, fill.get("copy"), fill.get("id"))
            if self._is_current_fill(*key):
                self._fill_reports.setdefault(node, {})[key] = fill

    def _drop_reports_of_nodes_gone(self, now: float) -> None:
        """A node that left (no longer registered, or down) counts for no fill: its reports go;
        back up, it reports again in its next heartbeat."""
        for node in list(self._fill_reports):
            state = self.cluster.nodes.get(node)
            if state is None or not self.cluster.is_up(state, now):
                del self._fill_reports[node]

    def _is_current_fill(self, dataset: str, copy_id: str | None, fill_id: str | None) -> bool:
        state = self.cluster.datasets.get(dataset)
        copy = state.copies.get(copy_id) if state is not None and copy_id is not None else None
        return copy is not None and copy.fill is not None and copy.fill.id == fill_id

    def tick(self) -> None:
        with self.cluster._lock:
            now = self._clock()
            for job in list(self.jobs.values()):
                renewed = self._renewed_at.get(job.id, now)
                if job.lease_s > 0 and now - renewed > job.lease_s:
                    log.warning("job %s: lease of %g s expired, releasing it", job.id, job.lease_s)
                    self.release(job.id, reason=f"released: lease of {job.lease_s:g} s expired")
            for dataset in {job.dataset for job in self.jobs.values() if job.state == "suspended"}:
                self._promote(dataset)
            self._drop_reports_of_nodes_gone(now)
            self._finish_fills(now)
            self._settle_waiting_hand_offs()
            self._cleanup_ttl(now)
            self._cleanup_lru(now)

    def forget_dataset(self, dataset: str) -> None:
        """The dataset was removed: its jobs and tasks go with it (the workers drop its cache
        when their view no longer lists it)."""
        for job in [j for j in self.jobs.values() if j.dataset == dataset]:
            self.store.delete(f"jobs/{job.id}")
            del self.jobs[job.id]
            self._renewed_at.pop(job.id, None)
        for task in [t for t in self.tasks.values() if t.dataset == dataset]:
            self.store.delete(f"tasks/{task.id}")
            del self.tasks[task.id]
        for node_reports in self._fill_reports.values():
            for key in [key for key in node_reports if key[0] == dataset]:
                del node_reports[key]
        self.version += 1

    # --- status --------------------------------------------------------------------------------

    def copy_docs(self, dataset: str, state: DatasetState) -> list[dict]:
        per_copy = self._running_per_copy(dataset)
        docs = []
        for copy_id, copy in state.copies.items():
            doc = {
                "id": copy_id,
                "nodes": self.cluster.copy_nodes(dataset, copy_id),
                "origin": copy.origin,
                "created_at": copy.created_at,
                "running_jobs": per_copy.get(copy_id, 0),
                "freed_at": copy.freed_at,
                "used_ratio": self.used_ratio(dataset, copy_id),
                "fill": None,
                # node -> shards it handed off and keeps until their owner here holds them
                "handed_off": {n: len(shards) for n, shards in sorted(copy.handed_off.items())},
            }
            if copy.fill is not None:
                reports = [
                    self._fill_report(n, dataset, copy_id, copy.fill.id)
                    for n in self.cluster.live_copy_nodes(dataset, copy_id)
                ]
                reports = [r for r in reports if r]
                doc["fill"] = {
                    **copy.fill.to_json(),
                    "copied_bytes": sum(r.get("copied_bytes", 0) for r in reports),
                    "nodes_done": sum(1 for r in reports if r.get("done")),
                }
            docs.append(doc)
        return docs

    def used_ratio(self, dataset: str, copy_id: str) -> float:
        """Cache used / capacity over the copy's live nodes (the CacheScaler's HPA metric)."""
        nodes = [self.cluster.nodes[n] for n in self.cluster.live_copy_nodes(dataset, copy_id)]
        capacity = sum(node.cache_capacity for node in nodes)
        used = sum(node.cache_used for node in nodes)
        return min(1.0, used / capacity) if capacity else 0.0

    def list_events(self, dataset: str | None = None, limit: int = 100) -> list[dict]:
        with self.cluster._lock:
            events = [e for e in self.events if dataset is None or e["dataset"] == dataset]
            return events[-limit:]

    def _event(self, kind: str, dataset: str, copy: str | None, message: str, **details) -> None:
        """Record what the CacheManager did and why (``GET /v1/events``); the newest
        ``EVENTS_KEPT`` are kept in the store."""
        now = self._clock()
        key = f"events/{int(now * 1000):013d}-{secrets.token_hex(3)}"
        event = {"id": key.removeprefix("events/"), "at": now, "kind": kind, "dataset": dataset,
                 "copy": copy, "message": message, **details}  # fmt: skip
        self.cluster._save(key, event)
        if len(self.events) == EVENTS_KEPT:
            self.store.delete(f"events/{self.events[0]['id']}")
        self.events.append(event)
        log.info("%s", message)
