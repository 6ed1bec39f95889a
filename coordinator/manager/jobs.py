"""Training jobs sharing cached copies: placement (TDCS), the suspend queue, clones, leases.

A job registers with the dataset it reads and how many nodes it wants. It is placed on a copy
of the dataset (TDCS ranking, :func:`~coordinator.copies.rank_nodes`) and counts against that
copy until released. At most ``max_jobs_per_copy`` jobs share one copy; over the limit the
dataset's ``overflow`` policy applies: ``suspend`` queues the job (FIFO per dataset; the head is
placed as soon as a copy has room), ``clone`` makes a new copy on candidate nodes outside every
copy and places the job there at once. Jobs are durable (``jobs/<id>``); lease renewals are
kept in memory, so a restarted coordinator gives every job one full lease to renew.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field

from cachefs.errors import ConfigError

from ..copies import (
    CopyState,
    FillState,
    Locality,
    choose_copy,
    clone_nodes,
    next_copy_id,
    rank_nodes,
)
from ..errors import JobExists, JobNotFound, StateConflict
from ..json_types import JsonDoc
from ..model import ClusterModel, DatasetState
from .journal import Journal

log = logging.getLogger("coordinator.manager")


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
    ranking: list[JsonDoc] = field(default_factory=list)  # every candidate, with the reason
    explanation: str = ""
    started_at: float | None = None
    cloned: bool = False  # placed on a copy made for it

    def to_json(self) -> JsonDoc:
        return asdict(self)

    @classmethod
    def from_json(cls, data: JsonDoc) -> Job:
        return cls(**data)

    def same_request(self, dataset: str, nodes_wanted: int, candidates: list[str] | None) -> bool:
        return (self.dataset, self.nodes_wanted, self.candidates) == (
            dataset,
            nodes_wanted,
            candidates,
        )


class Jobs:
    """The registered jobs and their placement (call under the model's lock)."""

    def __init__(self, model: ClusterModel, journal: Journal, *, job_lease_s: float) -> None:
        self.model = model
        self.journal = journal
        self.job_lease_s = job_lease_s
        now = model.now()
        #: job id -> job, every job registered and not released.
        self.by_id: dict[str, Job] = {}
        for doc in model.load("jobs/"):
            job = Job.from_json(doc)
            self.by_id[job.id] = job
        self._renewed_at = {job_id: now for job_id in self.by_id}
        self._seq = max((job.seq for job in self.by_id.values()), default=0)
        #: Bumped whenever a job changes: long-polls compare it instead of taking the lock.
        self.version = 0

    # --- the API's calls -----------------------------------------------------------------------

    def submit(
        self,
        job_id: str,
        dataset: str,
        nodes_wanted: int,
        candidates: list[str] | None = None,
        lease_s: float | None = None,
    ) -> JsonDoc:
        with self.model.lock:
            state = self.model.dataset(dataset)
            existing = self.by_id.get(job_id)
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
            now = self.model.now()
            self._seq += 1
            job = Job(
                id=job_id,
                dataset=dataset,
                nodes_wanted=nodes_wanted,
                candidates=candidates,
                lease_s=self.job_lease_s if lease_s is None else lease_s,
                seq=self._seq,
                submitted_at=now,
            )
            ahead = self.queue(dataset)
            if ahead:
                job.explanation = (
                    f"suspended behind {len(ahead)} earlier job(s) of {dataset} (FIFO)"
                )
            else:
                self._place(job, state)
            self.by_id[job.id] = job
            self._renewed_at[job.id] = now
            self._save(job)
            self.journal.event(
                "job", dataset, job.copy, f"job {job.id}: {job.explanation}", job=job.id
            )
            return self.job_doc(job)

    def release(self, job_id: str, *, reason: str = "released") -> JsonDoc:
        with self.model.lock:
            job = self._job(job_id)
            del self.by_id[job_id]
            self._renewed_at.pop(job_id, None)
            self.model.delete(f"jobs/{job_id}")
            self.version += 1
            state = self.model.datasets.get(job.dataset)
            if state is not None and job.state == "running" and job.copy:
                self._touch_copy(state, job.copy)
            self.journal.event("job", job.dataset, job.copy, f"job {job_id} {reason}", job=job_id)
            promoted = self.promote(job.dataset)
            return {"id": job_id, "released": True, "reason": reason, "promoted": promoted}

    def renew(self, job_id: str) -> JsonDoc:
        with self.model.lock:
            job = self._job(job_id)
            self._renewed_at[job_id] = self.model.now()
            return self.job_doc(job)

    def job(self, job_id: str) -> JsonDoc:
        with self.model.lock:
            return self.job_doc(self._job(job_id))

    def list_jobs(self, dataset: str | None = None) -> list[JsonDoc]:
        with self.model.lock:
            jobs = sorted(self.by_id.values(), key=lambda j: j.seq)
            return [self.job_doc(j) for j in jobs if dataset is None or j.dataset == dataset]

    def _job(self, job_id: str) -> Job:
        job = self.by_id.get(job_id)
        if job is None:
            raise JobNotFound(f"no job named {job_id!r} (never submitted, or released)")
        return job

    def job_doc(self, job: Job) -> JsonDoc:
        """The job as the API shows it. ``nodes`` are the placed nodes that are up now: one that
        went down is listed under ``down_nodes`` instead (it is back in ``nodes`` once it is up
        again), so a job never points its owner at a dead node."""
        now = self.model.now()
        doc = job.to_json()
        down = [node for node in job.nodes if not self.model.node_is_up(node, now)]
        doc["nodes"] = [node for node in job.nodes if node not in down]
        doc["down_nodes"] = down
        if down:
            doc["explanation"] += f" ({', '.join(down)} down now)"
            doc["ranking"] = [
                {**row, "why": row["why"] + " (down now)"} if row["node"] in down else row
                for row in job.ranking
            ]
        if job.state == "suspended":
            queue = self.queue(job.dataset)
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

    def _save(self, job: Job) -> None:
        self.model.save(f"jobs/{job.id}", job.to_json())

    # --- what other parts ask ------------------------------------------------------------------

    def queue(self, dataset: str) -> list[Job]:
        """The suspended jobs of ``dataset``, head first."""
        waiting = [
            j for j in self.by_id.values() if j.dataset == dataset and j.state == "suspended"
        ]
        return sorted(waiting, key=lambda j: j.seq)

    def running_per_copy(self, dataset: str) -> dict[str, int]:
        counts: dict[str, int] = {}
        for job in self.by_id.values():
            if job.dataset == dataset and job.state == "running" and job.copy:
                counts[job.copy] = counts.get(job.copy, 0) + 1
        return counts

    def counts(self, dataset: str) -> dict[str, int]:
        """Running and suspended jobs of ``dataset``."""
        running = sum(self.running_per_copy(dataset).values())
        return {"running": running, "suspended": len(self.queue(dataset))}

    def on_copy(self, dataset: str, copy_id: str) -> bool:
        """A job (running or suspended) is placed on the copy."""
        return any(j.dataset == dataset and j.copy == copy_id for j in self.by_id.values())

    def datasets_in_use(self) -> set[str]:
        return {job.dataset for job in self.by_id.values()}

    # --- the periodic work ---------------------------------------------------------------------

    def release_expired(self, now: float) -> None:
        """Release every job whose owner stopped renewing its lease."""
        for job in list(self.by_id.values()):
            renewed = self._renewed_at.get(job.id, now)
            if job.lease_s > 0 and now - renewed > job.lease_s:
                log.warning("job %s: lease of %g s expired, releasing it", job.id, job.lease_s)
                self.release(job.id, reason=f"released: lease of {job.lease_s:g} s expired")

    def promote_waiting(self) -> None:
        for dataset in {job.dataset for job in self.by_id.values() if job.state == "suspended"}:
            self.promote(dataset)

    def promote(self, dataset: str) -> list[str]:
        """Place suspended jobs of ``dataset`` in FIFO order while they fit: the head first, and
        a head that cannot run yet holds the others back."""
        state = self.model.datasets.get(dataset)
        if state is None:
            return []
        promoted = []
        for job in self.queue(dataset):
            if not self._place(job, state):
                break
            self._save(job)
            waited = (job.started_at or 0) - job.submitted_at
            self.journal.event(
                "job", dataset, job.copy,
                f"job {job.id} promoted after {waited:.1f} s: {job.explanation}", job=job.id,
            )  # fmt: skip
            promoted.append(job.id)
        return promoted

    def forget_dataset(self, dataset: str) -> None:
        for job in [j for j in self.by_id.values() if j.dataset == dataset]:
            self.model.delete(f"jobs/{job.id}")
            del self.by_id[job.id]
            self._renewed_at.pop(job.id, None)
        self.version += 1

    # --- placement -----------------------------------------------------------------------------

    def _candidates(self, candidates: list[str] | None) -> list[str]:
        """S2: the candidates that are live workers (names the coordinator does not know, or
        nodes that are down, cannot hold the job's data, so they are left out)."""
        live = self.model.live_nodes()
        return live if candidates is None else sorted(set(live) & set(candidates))

    def _locality(self, dataset: str) -> Locality:
        size, cached = 0, {}
        now = self.model.now()
        for name, node in self.model.nodes.items():
            report = node.datasets.get(dataset)
            if report is None or not self.model.is_up(node, now):
                continue
            size = max(size, report.get("bytes", 0))
            cached[name] = report.get("cached_bytes", 0)
        return Locality(size, cached)

    def _place(self, job: Job, state: DatasetState) -> bool:
        """Place ``job`` on a copy with room, or clone one; else leave it suspended with the
        reason. Returns whether it runs now."""
        name = state.spec.name
        limit = state.spec.max_jobs_per_copy
        per_copy = self.running_per_copy(name)
        candidates = self._candidates(job.candidates)
        if len(candidates) < job.nodes_wanted:
            job.explanation = (
                f"waiting for {job.nodes_wanted} candidate nodes to be up ({len(candidates)} are)"
            )
            return False
        locality = self._locality(name)
        open_copies = [
            (copy_id, self.model.live_copy_nodes(name, copy_id))
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
            candidates, copy_id, self.model.live_copy_nodes(name, copy_id), locality
        )
        job.state, job.copy, job.cloned = "running", copy_id, cloned
        job.ranking = [row.to_json() for row in ranked]
        job.nodes = [row.node for row in ranked[: job.nodes_wanted]]
        job.started_at = self.model.now()
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
            in_copies.update(self.model.copy_nodes(name, copy_id))
        free = {
            node: max(0, stats.cache_capacity - stats.cache_used)
            for node, stats in self.model.nodes.items()
        }
        chosen = clone_nodes(candidates, in_copies, free, job.nodes_wanted)
        if chosen is None:
            return None
        # Fill from the copy holding the most data now.
        source = max(
            state.copies,
            key=lambda c: sum(
                locality.cached.get(n, 0) for n in self.model.live_copy_nodes(name, c)
            ),
        )
        copy_id = next_copy_id(state.copies)
        now = self.model.now()
        state.copies[copy_id] = CopyState(
            nodes=chosen,
            created_at=now,
            origin=f"clone of {source} for job {job.id}",
            fill=FillState(
                id=state.next_fill_id(copy_id),
                sources=self.model.copy_nodes(name, source),
                leaving=[],
                reason=f"clone of copy {source}",
                started_at=now,
            ),
        )
        self.model.save_dataset(state)
        self.journal.cancel_tasks(name, chosen)
        self.journal.event(
            "clone", name, copy_id, f"copy {copy_id} of {name} cloned from {source} onto "
            f"{', '.join(chosen)} for job {job.id}", nodes=chosen, source=source,
        )  # fmt: skip
        return copy_id

    def _touch_copy(self, state: DatasetState, copy_id: str) -> None:
        copy = state.copies.get(copy_id)
        if copy is not None:
            copy.last_used_at = self.model.now()
            copy.freed_at = None
            self.model.save_dataset(state)
