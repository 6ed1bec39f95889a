"""The worker's preloader: fill the shards this node owns for each running preload job.

Per job: *plan* (one walk of the snapshot in a thread: the files under the job's paths, then per
shard the blocks that make up the selected share of its bytes), then *run* each owned shard:
blocks already cached are verified (a full read checks the checksum) and skipped, the others are
fetched through the :class:`~cachefs.cluster.fetchers.FetcherPool` and admitted. Progress is
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
import time
from collections import defaultdict
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from cachefs.background import BackgroundTasks
from cachefs.cache.base import BlockCache, BlockKey, key_hash_of
from cachefs.errors import CachefsError
from cachefs.meta import Entry, Snapshot
from cachefs.protocol import SHARDS
from cachefs.store import StoreConfig
from cachefs.store.concurrency import PRELOAD_BOUNDS, AdaptiveConcurrency, ConcurrencyBounds

from .fetchers import FetcherPool, FetchFailed
from .membership import Membership
from .served import ServedDatasets

log = logging.getLogger("cachefs.preload")

MAX_FAILURES_LISTED = 20  # per shard; the count is exact

#: What the worker gives for a dataset served here: its snapshot, store config, cache source id
#: and block size.
PreloadSource = tuple[Snapshot, StoreConfig, int, int]


@dataclass(frozen=True, slots=True)
class PlannedObject:
    key: str
    etag: str
    size: int
    blocks: tuple[int, ...]  # selected block indices
    selected_bytes: int


def path_matches(key: str, prefixes: tuple[str, ...]) -> bool:
    """Path-prefix match by whole components: "train" selects "train/x", not "training/x"."""
    if not prefixes:
        return True
    return any(key == p or key.startswith(p + "/") for p in prefixes)


def plan(
    snapshot: Snapshot,
    selection: dict[str, Any],
    block_size: int,
    shards: AbstractSet[int] | None = None,
) -> dict[int, list[PlannedObject]]:
    """The blocks a job selects, per shard (only ``shards`` if given).

    Within a shard, objects are taken in the order of their key hash (deterministic on every
    node, and spread over the namespace) and blocks in file order. With a ``fraction`` f, each
    shard takes the prefix of its blocks whose size is nearest to f × its bytes plus the error
    carried from the shards before it (error diffusion in shard order): every shard is within
    one block of its share, and the whole selection within half a block of f × the bytes, even
    when shards hold only a few files each. Every node walks the whole snapshot and computes
    the carry the same way, so nodes agree without talking. A byte budget b is the fraction
    b / (bytes under the paths).
    """
    prefixes = tuple(p.strip("/") for p in selection.get("paths") or () if p.strip("/"))
    # Per shard, every selected file as one int, hash << 48 | size: sorting orders by hash;
    # the carry needs only the sizes. Entries are kept for the shards to plan.
    sizes: list[list[int]] = [[] for _ in range(SHARDS)]
    entries: dict[int, list[tuple[int, Entry]]] = defaultdict(list)
    total = 0
    for entry in snapshot.iter_files():
        if not path_matches(entry.key, prefixes):
            continue
        key_hash = key_hash_of(entry.key)
        shard = key_hash % SHARDS
        total += entry.size
        sizes[shard].append(key_hash << 48 | entry.size)
        if shards is None or shard in shards:
            entries[shard].append((key_hash, entry))
    fraction = selection.get("fraction")
    if selection.get("bytes") is not None:
        fraction = min(1.0, selection["bytes"] / total) if total else 1.0

    planned: dict[int, list[PlannedObject]] = {}
    carry = 0.0
    size_mask = (1 << 48) - 1
    for shard in range(SHARDS):
        budget = None
        if fraction is not None:
            shard_sizes = [packed & size_mask for packed in sorted(sizes[shard])]
            budget = _ShardBudget(fraction * sum(shard_sizes) + carry)
            for size in shard_sizes:
                if not budget.take_file(size, block_size):
                    break
            carry = budget.target - budget.taken
        if shard not in entries:
            continue
        objects = []
        budget = None if budget is None else _ShardBudget(budget.target)
        for _, entry in sorted(entries[shard], key=lambda pair: (pair[0], pair[1].size)):
            blocks = _blocks_of(entry.size, block_size)
            if budget is not None:
                blocks = blocks[: budget.blocks_taken(entry.size, block_size)]
            if not blocks:
                break
            selected = sum(min(block_size, entry.size - i * block_size) for i in blocks)
            objects.append(
                PlannedObject(entry.key, entry.etag, entry.size, tuple(blocks), selected)
            )
            if budget is not None and len(blocks) < len(_blocks_of(entry.size, block_size)):
                break
        planned[shard] = objects
    return planned


def _blocks_of(size: int, block_size: int) -> list[int]:
    return list(range(max(1, -(-size // block_size))))


class _ShardBudget:
    """Takes blocks in order while that brings the bytes taken nearer to the target."""

    def __init__(self, target: float):
        self.target = target
        self.taken = 0
        self.stopped = False

    def blocks_taken(self, size: int, block_size: int) -> int:
        """How many leading blocks of a ``size``-byte file to take (stops for good once a
        block is refused: a shard's selection is a prefix)."""
        count = 0
        for index in _blocks_of(size, block_size):
            length = min(block_size, size - index * block_size)
            if self.stopped or self.taken + length / 2 > self.target:
                self.stopped = True
                return count
            self.taken += length
            count += 1
        return count

    def take_file(self, size: int, block_size: int) -> bool:
        """Take what fits of one file; False once the shard's share is reached."""
        blocks = len(_blocks_of(size, block_size))
        return self.blocks_taken(size, block_size) == blocks and not self.stopped


@dataclass
class ShardProgress:
    objects: int = 0
    bytes: int = 0
    done_objects: int = 0
    done_bytes: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    failed_count: int = 0
    complete: bool = False

    def fail(self, key: str, reason: str) -> None:
        self.failed_count += 1
        if len(self.failed) < MAX_FAILURES_LISTED:
            self.failed[key] = reason

    def report(self) -> dict[str, Any]:
        return {
            "objects": self.objects,
            "bytes": self.bytes,
            "done_objects": self.done_objects,
            "done_bytes": self.done_bytes,
            "failed": dict(self.failed),
            "failed_count": self.failed_count,
            "complete": self.complete,
        }


class PreloadTarget(Protocol):
    """What the preloader needs from the worker for one dataset."""

    def preload_source(self, dataset: str) -> PreloadSource | None:
        """(snapshot, store config, source id, block size) of a served dataset, or None."""
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
        self._cache = cache
        self._membership = membership
        self._pool = pool
        # Objects being loaded at once: adaptive, from ``concurrency`` up to ``max_concurrency``
        # while the store keeps up, down when it answers "slow down". The spawning task
        # borrows a slot on behalf of the object, the object's task gives it back.
        self.concurrency = AdaptiveConcurrency(
            ConcurrencyBounds(
                initial=concurrency,
                floor=min(PRELOAD_BOUNDS.floor, concurrency),
                ceiling=max(max_concurrency, concurrency),
            ),
            purpose="preload",
        )
        self._fetch_slots = self.concurrency.limiter
        self._admit_limiter = trio.CapacityLimiter(4)
        self._jobs: dict[str, _JobRun] = {}
        self._served = ServedDatasets()
        self._tasks = BackgroundTasks()
        self.fetched_bytes = 0
        self.fetched_blocks = 0
        self.fetch_failures = 0

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

    def _fetch_and_admit(
        self, config: StoreConfig, key: BlockKey, obj: PlannedObject, index: int, block_size: int
    ) -> tuple[str | None, bool]:
        """Blocking (in a thread): one block from the store into the cache. Returns (an error
        message or None on success, whether the store answered "slow down" on the way)."""
        start = index * block_size
        length = min(block_size, obj.size - start)
        fetched = self._pool.fetch(config, obj.key, start, length, obj.etag)
        if self._cache.put(key, fetched.data) is None:
            return "not admitted: the cache is full (avoid-eviction)", fetched.throttled
        self.fetched_bytes += length
        self.fetched_blocks += 1
        return None, fetched.throttled


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
        job = self.job
        snapshot, config, source_id, block_size = source
        planned = await trio.to_thread.run_sync(
            plan, snapshot, job["selection"], block_size, shards
        )
        for shard in shards:
            objects = planned.get(shard, [])
            self.progress[shard] = ShardProgress(
                objects=len(objects), bytes=sum(o.selected_bytes for o in objects)
            )
        log.info("preload %s: %d shards, %d objects here", job["id"], len(shards),
                 sum(len(objects) for objects in planned.values()))  # fmt: skip
        async with trio.open_nursery() as nursery:
            for shard in shards:
                for obj in planned.get(shard, []):
                    slot = object()  # borrowed here, given back by the object's task
                    await self.preloader._fetch_slots.acquire_on_behalf_of(slot)
                    nursery.start_soon(
                        self._load_object, shard, obj, config, source_id, block_size, slot
                    )
        for shard in shards:
            self.progress[shard].complete = True

    async def _load_object(
        self,
        shard: int,
        obj: PlannedObject,
        config: StoreConfig,
        source_id: int,
        block_size: int,
        slot: object,
    ) -> None:
        preloader = self.preloader
        progress = self.progress[shard]
        try:
            for index in obj.blocks if obj.size else ():  # an empty file has nothing to fetch
                key = BlockKey.make(source_id, obj.key, obj.etag, index)
                if preloader._cache.locate(key) is not None:
                    # Verify what is there: a full read checks the checksum and drops a bad block.
                    length = min(block_size, obj.size - index * block_size)
                    data = await trio.to_thread.run_sync(
                        preloader._cache.read, key, 0, length, limiter=preloader._admit_limiter
                    )
                    if data is not None:
                        continue
                throttled = False
                began = time.perf_counter()
                try:
                    error, throttled = await trio.to_thread.run_sync(
                        preloader._fetch_and_admit, config, key, obj, index, block_size
                    )
                except FetchFailed as exc:
                    error, throttled = str(exc), exc.throttled
                except CachefsError as exc:
                    error = str(exc)
                # The latency too: past the store's own, requests queue here (threads, CPU),
                # and the limit comes down (cachefs/store/concurrency.py).
                preloader.concurrency.record(
                    throttled=throttled, seconds=time.perf_counter() - began
                )
                if error is not None:
                    preloader.fetch_failures += 1
                    progress.fail(obj.key, error)
                    return
            progress.done_objects += 1
            progress.done_bytes += obj.selected_bytes
        finally:
            preloader._fetch_slots.release_on_behalf_of(slot)
