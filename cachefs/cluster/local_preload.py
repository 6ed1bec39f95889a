"""Preload on a single node (`cachefs up`, no coordinator): the coordinator's half, in the worker.

In a cluster the coordinator keeps each preload job (:class:`cachefs.preload_jobs.PreloadJob`)
and every worker's :class:`~cachefs.cluster.preload.Preloader` plans and fetches the shards it
owns, reporting per-shard progress in its heartbeats. A single node owns every shard, so here
both halves run in one process: :class:`LocalPreloads` keeps the jobs, hands the running ones
to the very same Preloader — same selection (paths, fraction, byte budget) and planning, same
check of blocks already cached, same fetcher processes, so bulk fetches never run on the FUSE
loop — and folds its reports into the jobs as the coordinator does with heartbeats. Status
documents are therefore the coordinator's (objects and bytes done of planned, rate, ETA, the
failed objects and why), and the CLI prints both alike. ``resume`` starts a new job with the
latest one's selection: cached blocks are verified and skipped, so only what is missing —
what failed, what a cancel left — is fetched.

Jobs (the running and scheduled ones, and the latest of each dataset) are kept in
``<state>/preloads.json``: a worker restarted mid-preload carries on by itself, and a job
scheduled with ``--at`` still starts at its time.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from typing import Any

import trio

from cachefs.cache.base import BlockCache
from cachefs.errors import CachefsError, ConfigError, DatasetNotFound, PreloadNotFound
from cachefs.preload_jobs import PreloadJob, Selection
from cachefs.protocol import SHARDS

from .fetchers import FetcherPool
from .membership import Membership
from .preload import Preloader, PreloadTarget

log = logging.getLogger("cachefs.preload")

#: The copy named in a single node's jobs (a cluster's copies are "A", "B", …).
LOCAL_COPY = "local"
#: How often the Preloader's progress is folded into the jobs: the heartbeat's part in a cluster.
FOLD_INTERVAL_S = 0.5
#: Path prefixes one preload may name: what the coordinator's API accepts (coordinator/api.py).
MAX_SELECTION_PATHS = 1000
ACTIVE = ("scheduled", "running")


def selection_of(body: Any) -> Selection:
    """A preload request's body — ``{"paths", "fraction", "bytes", "at"}``, the coordinator's
    own, less ``copy`` — as a :class:`Selection`; anything else is one ConfigError line."""
    if not isinstance(body, dict):
        raise ConfigError('a preload request is a JSON object: {"paths": [...], "fraction": …}')
    unknown = sorted(set(body) - {"paths", "fraction", "bytes", "at"})
    if unknown:
        raise ConfigError(f"unknown preload option {', '.join(map(repr, unknown))}")
    paths = body.get("paths") or []
    if not isinstance(paths, list) or not all(isinstance(path, str) for path in paths):
        raise ConfigError("paths must be a list of path prefixes")
    if len(paths) > MAX_SELECTION_PATHS:
        raise ConfigError(f"{len(paths)} path prefixes; at most {MAX_SELECTION_PATHS} per preload")
    for name, kinds in (("fraction", (int, float)), ("at", (int, float)), ("bytes", (int,))):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    return Selection(
        paths=tuple(paths), fraction=body.get("fraction"), bytes=body.get("bytes"),
        at=body.get("at"),
    )  # fmt: skip


class LocalPreloads:
    """The preload jobs of a single-node worker. Every method runs on the worker's trio loop
    (the control API calls them); the planning, fetching and file writes run in threads."""

    def __init__(
        self,
        target: PreloadTarget,
        cache: BlockCache,
        pool: FetcherPool,
        *,
        node: str,
        state_file: str,
        concurrency: int,
        max_concurrency: int,
    ):
        self._target = target
        self._node = node
        self._state_file = state_file
        self._owners: list[str | None] = [node] * SHARDS  # this node owns every shard
        self._preloader = Preloader(
            target,
            cache,
            Membership(node),
            pool,
            concurrency=concurrency,
            max_concurrency=max_concurrency,
        )
        #: The adaptive limit on the preload's GETs in flight (its report is in the jobs' status).
        self.concurrency = self._preloader.concurrency
        #: The preload's fetch totals and GETs by outcome (status document, metrics).
        self.counters = self._preloader.counters
        self._jobs: dict[str, PreloadJob] = {}
        self._assigned: frozenset[str] | None = None  # job ids the Preloader runs; None: not yet
        self._save_limiter = trio.CapacityLimiter(1)  # one writer: the latest state wins

    # --- lifecycle -------------------------------------------------------------------------

    def load(self) -> None:
        """Blocking (call before serving, or in a thread): the jobs a previous run kept. A
        running job's progress is dropped: it is planned again, its cached blocks skipped."""
        try:
            with open(self._state_file) as f:
                documents = json.load(f)
            jobs = [PreloadJob.from_json(doc) for doc in documents]
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, CachefsError) as exc:
            log.error("preload jobs in %s not read (starting without them): %s",
                      self._state_file, exc)  # fmt: skip
            return
        for job in jobs:
            if job.state == "running":
                job.shards = {}
            self._jobs[job.id] = job

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the Preloader and fold its progress into the jobs until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._preloader.run)
                self._assigned = frozenset()
                self._assign()
                task_status.started()
                while True:
                    await trio.sleep(FOLD_INTERVAL_S)
                    if self._fold():
                        await self._commit()
        finally:
            self._assigned = None

    # --- the control API's calls -----------------------------------------------------------

    async def start(self, dataset: str, body: Any) -> dict[str, Any]:
        selection = selection_of(body)
        self._require_served(dataset)
        job = self._new_job(dataset, selection)
        await self._commit()
        return self._doc(job)

    async def status(self, dataset: str) -> dict[str, Any]:
        if self._fold():
            await self._commit()
        return self._doc(self._latest(dataset))

    async def resume(self, dataset: str) -> dict[str, Any]:
        """A new job with the latest job's selection (now, not at its ``at``); the latest job
        itself if it is still running or scheduled."""
        latest = self._latest(dataset)
        if latest.state in ACTIVE:
            return self._doc(latest)
        self._require_served(dataset)
        job = self._new_job(dataset, Selection(**{**latest.selection.__dict__, "at": None}))
        await self._commit()
        return self._doc(job)

    async def cancel(self, dataset: str) -> dict[str, Any]:
        """Cancel the latest job if it runs or waits; what it fetched stays cached."""
        job = self._latest(dataset)
        if job.state in ACTIVE:
            job.state, job.finished_at = "cancelled", time.time()
            log.info("preload %s cancelled", job.id)
            await self._commit()
        return self._doc(job)

    # --- internals ---------------------------------------------------------------------------

    def _require_served(self, dataset: str) -> None:
        if self._target.preload_source(dataset) is None:
            raise DatasetNotFound(f"no dataset named {dataset!r} is served here (cachefs status)")

    def _new_job(self, dataset: str, selection: Selection) -> PreloadJob:
        now = time.time()
        job = PreloadJob(
            id=f"{dataset}-{int(now * 1000):013d}-{secrets.token_hex(2)}",  # as a coordinator's
            dataset=dataset,
            copy=LOCAL_COPY,
            selection=selection,
            created_at=now,
        )
        job.advance(now)  # running at once, or scheduled for its --at
        self._jobs[job.id] = job
        self._prune(dataset)
        log.info("preload %s of %r: %s", job.id, dataset, selection.describe())
        return job

    def _prune(self, dataset: str) -> None:
        """Forget the dataset's finished jobs but the latest (what `preload status` shows)."""
        jobs = sorted(
            (job for job in self._jobs.values() if job.dataset == dataset),
            key=lambda job: job.created_at,
        )
        for job in jobs[:-1]:
            if job.state not in ACTIVE:
                del self._jobs[job.id]

    def _latest(self, dataset: str) -> PreloadJob:
        jobs = [job for job in self._jobs.values() if job.dataset == dataset]
        if not jobs:
            self._require_served(dataset)
            raise PreloadNotFound(f"dataset {dataset!r} has no preload job")
        return max(jobs, key=lambda job: job.created_at)

    def _fold(self) -> bool:
        """Take the Preloader's per-shard reports into the running jobs and move every job
        along (start a scheduled one, finish one whose shards are all done). True if a job
        changed state."""
        now = time.time()
        reports = self._preloader.reports()
        changed = False
        for job in self._jobs.values():
            if job.state not in ACTIVE:
                continue
            if self._target.preload_source(job.dataset) is None:  # the dataset was removed
                job.state, job.finished_at = "cancelled", now
                changed = True
                continue
            if job.state == "running":
                for shard, report in reports.get(job.id, {}).items():
                    job.record(int(shard), self._node, report)
            if job.advance(now, self._owners):
                changed = True
                if job.state not in ACTIVE:
                    log.info("preload %s %s", job.id, job.state)
        return changed

    async def _commit(self) -> None:
        """After a job was added or changed state: hand the running ones to the Preloader
        (a job no longer running is stopped there) and keep them on disk."""
        self._assign()
        text = json.dumps([job.to_json() for job in self._jobs.values()])
        try:
            await trio.to_thread.run_sync(self._write, text, limiter=self._save_limiter)
        except OSError as exc:  # a full disk must not stop the worker: the jobs still run
            log.error("preload jobs not saved to %s (a restart forgets them): %s",
                      self._state_file, exc)  # fmt: skip

    def _assign(self) -> None:
        if self._assigned is None:  # the Preloader is not running yet: run() assigns
            return
        running = [job for job in self._jobs.values() if job.state == "running"]
        ids = frozenset(job.id for job in running)
        if ids == self._assigned:
            return
        live_nodes = {job.dataset: {LOCAL_COPY: [self._node]} for job in running}
        self._preloader.assign([job.assignment() for job in running], live_nodes)
        self._assigned = ids

    def _write(self, text: str) -> None:
        partial = f"{self._state_file}.tmp"
        with open(partial, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self._state_file)

    def _doc(self, job: PreloadJob) -> dict[str, Any]:
        """The coordinator's status document of the job, plus ``unmatched_paths``: the path
        prefixes that name nothing in the dataset's current snapshot (a mistyped ``--paths``)."""
        doc = job.progress(self._owners, time.time())
        doc["unmatched_paths"] = self._unmatched_paths(job)
        doc["concurrency"] = self.concurrency.report()
        return doc

    def _unmatched_paths(self, job: PreloadJob) -> list[str]:
        source = self._target.preload_source(job.dataset)
        if source is None:
            return []
        snapshot = source[0]
        return [
            path
            for path in job.selection.paths
            if path.strip("/") and snapshot.resolve(path.strip("/")) is None
        ]
