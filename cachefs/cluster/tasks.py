"""The worker's cleanup tasks: what the coordinator's CacheManager asks a node to free.

The view lists this node's pending tasks, in order, every beat until they are acknowledged:

- ``free``: evict every non-reserved cached block of the dataset here (a copy freed: ttl, lru);
- ``trim``: evict the non-reserved blocks of the ``shards`` the task lists: shards this node
  handed off whose new owner holds them now (the coordinator checked; :mod:`coordinator.manager`,
  "the hand-off invariant"). A listed shard this node owns under its current membership is
  kept: a later scale gave it back, and this node may be the only one holding it. A trim that
  lists no shards does nothing (the coordinator decides what may go, never the worker alone).

Tasks run one at a time, in order, in a task of their own: freeing a large dataset takes a
while and heartbeats must go on meanwhile. Each id runs at most once per process; its result is
reported (``tasks_done``) while the view lists it. (Results are small and kept for the process's
life: should an id be listed again, its old result is reported again, and it is not re-run.)
The no-eviction reserve is never freed (docs/architecture.md: "Capacity and admission", and
Cleanup under "The CacheManager").
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any, Protocol

import trio

from cachefs.cache.base import BlockCache
from cachefs.errors import CachefsError
from cachefs.metrics import WorkerMetrics
from cachefs.protocol import SHARDS

log = logging.getLogger("cachefs.cleanup")

KINDS = ("free", "trim")
HISTORY = 20  # tasks kept for `cachefs status`


class CleanupTarget(Protocol):
    def served_source_id(self, dataset: str) -> int | None:
        """The cache source id of a dataset served here, or None if it is not served."""
        ...


class OwnedShards(Protocol):
    def own_copy_shards(self, dataset: str) -> set[int]: ...


def trim_shards(task: dict[str, Any], owned: set[int]) -> tuple[set[int], str | None]:
    """The shards a trim task may free here: those it lists, less those this node owns now.
    Returns (shards, error); an invalid list frees nothing."""
    listed = task.get("shards")
    if not isinstance(listed, list) or not all(
        type(shard) is int and 0 <= shard < SHARDS for shard in listed
    ):
        return set(), "a trim must list its shards (integers in [0, 1024)): nothing done"
    return set(listed) - owned, None


class TaskRunner:
    def __init__(
        self,
        target: CleanupTarget,
        cache: BlockCache,
        membership: OwnedShards,
        metrics: WorkerMetrics,
    ):
        self._target = target
        self._cache = cache
        self._membership = membership
        self._metrics = metrics
        self._pending: list[dict[str, Any]] = []  # in the view's order, not yet run
        self._seen: set[str] = set()  # ids queued or run in this process: none runs twice
        self._results: dict[str, dict[str, Any]] = {}  # id -> result of every task run
        self._listed: set[str] = set()  # the ids of the last view
        self._wanted = trio.Event()
        # One at a time, and off the trio loop: index writes and file unlinks.
        self._limiter = trio.CapacityLimiter(1)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Runs the assigned tasks in order until cancelled."""
        task_status.started()
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            while self._pending:
                task = self._pending.pop(0)
                self._results[task["id"]] = await self._execute(task)

    def assign(self, tasks: list[dict[str, Any]]) -> None:
        """Take the tasks of a heartbeat reply (applied to the membership first). New ids are
        queued; queued tasks the view no longer lists are dropped, not run."""
        # Only string ids are ever queued, run or reported: another id is listed for nothing.
        self._listed = listed = {task["id"] for task in tasks if isinstance(task.get("id"), str)}
        for task in self._pending:
            if task["id"] not in listed:
                self._seen.discard(task["id"])  # never run: free to run if listed again
        self._pending = [task for task in self._pending if task["id"] in listed]
        for task in tasks:
            task_id = task.get("id")
            if not isinstance(task_id, str) or task_id in self._seen:
                continue
            self._seen.add(task_id)
            self._pending.append(task)
            self._wanted.set()

    def reports(self) -> dict[str, dict[str, Any]]:
        """Results of the tasks done and still listed (the heartbeat's ``tasks_done``)."""
        results = self._results
        return {task_id: results[task_id] for task_id in self._listed if task_id in results}

    async def _execute(self, task: dict[str, Any]) -> dict[str, Any]:
        kind, dataset = task.get("kind"), task.get("dataset")
        freed, error = 0, None
        if kind not in KINDS:
            error = f"unknown task kind {kind!r}: nothing done"
        elif not isinstance(dataset, str):
            error = "the task names no dataset: nothing done"
        else:
            source_id = self._target.served_source_id(dataset)
            shards = None
            if kind == "trim":
                shards, error = trim_shards(task, self._membership.own_copy_shards(dataset))
            if source_id is not None and error is None:
                try:
                    freed = await trio.to_thread.run_sync(
                        partial(self._cache.free_blocks, source_id, shards),
                        limiter=self._limiter,
                    )
                except CachefsError as exc:
                    error = str(exc)
            self._metrics.cache_freed(dataset, kind, freed)
        log.info("task %s (%s of %r: %s): freed %d bytes%s", task["id"], kind, dataset,
                 task.get("reason"), freed, f", error: {error}" if error else "")  # fmt: skip
        self.history.append(
            {
                "id": task["id"],
                "kind": kind,
                "dataset": dataset,
                "reason": task.get("reason"),
                "freed_bytes": freed,
                "error": error,
                "at": time.time(),
            }
        )
        return {"freed_bytes": freed, "error": error}
