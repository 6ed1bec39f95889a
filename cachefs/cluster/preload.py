"""The worker's preloader: fill the shards this node owns for each running preload job.

Per job: *plan* (one walk of the snapshot in a thread: the files under the job's paths, then per
shard the blocks that make up the selected share of its bytes), then *run* each owned shard:
blocks already cached are verified (a full read checks the checksum) and skipped, the others are
fetched through the :class:`~cachefs.cluster.fetchers.FetcherPool` and admitted — by a
:class:`~cachefs.cluster.pipeline.FetchPipeline` in a thread of its own, with as many GETs in
flight as the node's adaptive limit allows (cachefs/store/concurrency.py). Progress is
cumulative per shard and goes to the coordinator in every heartbeat. A shard is reported
complete once every selected block was dealt with; an object whose blocks could not be fetched
or admitted is listed as failed with the reason, and fetched again by the next job (resume).

When the membership changes, the shards this node newly owns are planned and run; the
coordinator ignores reports for shards it no longer owns. A job for a dataset not served here
yet (the heartbeat that adds a dataset can carry its preload too) waits until the dataset is
served (:class:`~cachefs.cluster.served.ServedDatasets`, woken by the agent), then plans every
shard it owns: a shard counts as started only once it was planned.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import trio

from cachefs.background import BackgroundTasks
from cachefs.cache.base import BlockCache
from cachefs.fs.native_reads import PREPARED_FILES_MAX
from cachefs.meta import Snapshot
from cachefs.store import StoreConfig
from cachefs.store.concurrency import PRELOAD_BOUNDS, ConcurrencyBounds, ThreadedConcurrency

from .fetchers import FetcherPool
from .membership import Membership
from .pipeline import BlockSource, FetchCounters, FetchPipeline, ShardProgress
from .planning import plan
from .served import ServedDatasets

log = logging.getLogger("cachefs.preload")

#: Job runs fetching at once on a node (a thread each); more wait for one to end.
MAX_PIPELINES = 8

#: What the worker gives for a dataset served here: its snapshot, store config, cache source id
#: and block size.
PreloadSource = tuple[Snapshot, StoreConfig, int, int]


class PreloadTarget(Protocol):
    """What the preloader needs from the worker for one dataset."""

    def preload_source(self, dataset: str) -> PreloadSource | None:
        """(snapshot, store config, source id, block size) of a served dataset, or None."""
        ...

    async def prepare_reads(self, dataset: str, keys: Sequence[str]) -> int:
        """Make the first reads of these files of ``dataset``, just preloaded, as cheap as
        later ones (the worker: their LOOKUP replies and blocks into the native READ path's
        table); how many were prepared."""
        ...


class Preloader:
    def __init__(
        self,
        target: PreloadTarget,
        cache: BlockCache,
        membership: Membership,
        pool: FetcherPool,
        *,
        concurrency: int = PRELOAD_BOUNDS.initial,
        max_concurrency: int = PRELOAD_BOUNDS.ceiling,
    ):
        self._target = target
        self._membership = membership
        # GETs in flight over all of the node's jobs: adaptive, from ``concurrency`` up to
        # ``max_concurrency`` while the store keeps up, halved when it answers "slow down".
        self.concurrency = ThreadedConcurrency(
            ConcurrencyBounds(
                initial=concurrency,
                floor=min(PRELOAD_BOUNDS.floor, concurrency),
                ceiling=max(max_concurrency, concurrency),
            ),
            purpose="preload",
        )
        self.counters = FetchCounters()
        self._pipeline = FetchPipeline(cache, pool, self.concurrency, self.counters)
        self._pipeline_threads = trio.CapacityLimiter(MAX_PIPELINES)
        self._jobs: dict[str, _JobRun] = {}
        self._served = ServedDatasets()
        self._tasks = BackgroundTasks()

    @property
    def fetched_blocks(self) -> int:
        return self.counters.blocks

    @property
    def fetched_bytes(self) -> int:
        return self.counters.bytes

    @property
    def fetch_failures(self) -> int:
        return self.counters.failures

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the job tasks; runs until cancelled."""
        await self._tasks.run(task_status=task_status)

    def assign(
        self, jobs: list[dict[str, Any]], live_nodes: dict[str, dict[str, list[str]]]
    ) -> None:
        """Take the running jobs from a heartbeat reply (``live_nodes``: dataset → copy → live
        nodes). New jobs start, jobs no longer running stop, the others re-check ownership."""
        running = {job["id"]: job for job in jobs}
        for job_id in list(self._jobs):
            if job_id not in running:
                self._jobs.pop(job_id).cancel_scope.cancel()
        for job_id, job in running.items():
            nodes = live_nodes.get(job["dataset"], {}).get(job["copy"], [])
            owned = self._membership.owned_shards(job["dataset"], job["copy"], nodes)
            run = self._jobs.get(job_id)
            if run is None:
                if not self._tasks.running:
                    return
                run = self._jobs[job_id] = _JobRun(self, job)
                self._tasks.start_soon(run.run)
            run.set_owned(owned)

    def datasets_changed(self) -> None:
        """The datasets served here changed (the agent calls this): jobs waiting for their
        dataset look again."""
        self._served.changed()

    def reports(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Cumulative progress per job and owned shard, for the heartbeat."""
        return {job_id: run.reports() for job_id, run in self._jobs.items()}


class _JobRun:
    def __init__(self, preloader: Preloader, job: dict[str, Any]):
        self.preloader = preloader
        self.job = job
        self.cancel_scope = trio.CancelScope()
        self.owned: set[int] = set()
        self.progress: dict[int, ShardProgress] = {}
        self._changed = trio.Event()

    def set_owned(self, owned: set[int]) -> None:
        if owned != self.owned:
            self.owned = owned
            self._changed.set()

    def reports(self) -> dict[str, dict[str, Any]]:
        return {
            str(shard): progress.report()
            for shard, progress in self.progress.items()
            if shard in self.owned
        }

    async def run(self) -> None:
        job, preloader = self.job, self.preloader
        with self.cancel_scope:
            planned: set[int] = set()  # shards planned and run (or running): never twice
            while True:
                todo = self.owned - planned
                if not todo:
                    await self._changed.wait()
                    self._changed = trio.Event()
                    continue
                source = await preloader._served.wait_source(
                    preloader._target, job["dataset"], f"preload {job['id']}"
                )
                todo = self.owned - planned  # ownership may have changed while waiting
                if todo:
                    planned |= todo
                    await self._run_shards(todo, source)

    async def _run_shards(self, shards: set[int], source: PreloadSource) -> None:
        job, preloader = self.job, self.preloader
        snapshot, config, source_id, block_size = source
        elsewhere: list[str] = []  # files of other nodes' shards: LOOKUP replies only
        planning = partial(
            plan, snapshot, job["selection"], block_size, shards,
            elsewhere=elsewhere, elsewhere_max=PREPARED_FILES_MAX,
        )  # fmt: skip
        planned = await trio.to_thread.run_sync(planning)
        for shard in shards:
            objects = planned.get(shard, [])
            self.progress[shard] = ShardProgress(
                objects=len(objects), bytes=sum(o.selected_bytes for o in objects)
            )
        log.info("preload %s: %d shards, %d objects here", job["id"], len(shards),
                 sum(len(objects) for objects in planned.values()))  # fmt: skip
        work = [(self.progress[shard], obj) for shard in shards for obj in planned.get(shard, [])]
        stop = threading.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_set_when_cancelled, stop)
            await trio.to_thread.run_sync(
                preloader._pipeline.run,
                work,
                BlockSource(config, source_id, block_size),
                stop,
                limiter=preloader._pipeline_threads,
            )
            nursery.cancel_scope.cancel()
        # Before "complete": a job that waits for the preload then reads this node's files
        # without a LOOKUP or READ in Python (blocks the preload could not fetch are simply
        # not registered), and sends only the READs of other nodes' files there.
        prepared = await preloader._target.prepare_reads(
            job["dataset"], [obj.key for _, obj in work] + elsewhere
        )
        log.debug("preload %s: %d files prepared for native reads", job["id"], prepared)
        for shard in shards:
            self.progress[shard].complete = True


async def _set_when_cancelled(stop: threading.Event) -> None:
    """Sets ``stop`` when cancelled: how a cancelled job reaches its pipeline's thread (which
    trio waits for: it returns within ``STOP_POLL_S``)."""
    try:
        await trio.sleep_forever()
    finally:
        stop.set()
