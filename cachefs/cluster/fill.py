"""The worker's filler: copy the blocks of a copy being filled from the nodes that held them.

When the coordinator clones a copy, or moves shards to new nodes by scaling a copy, the view
names the fill (``fills`` of the dataset: an id and the nodes that held the data before). Each
node of the filled copy then copies every block of the shards it owns there from the shard's
*fill source* (:meth:`Membership.fill_address`) with cached-only peer requests: the source
answers from its cache or 404, never from the store, so a fill moves bytes between caches and
never adds store traffic. Blocks already cached here are skipped; a block the source does not
hold (absent) is left for the read path; a block it could not send (failed) is tried again in
a later pass over its shard, and after the last pass left for the read path, which asks the
fill source again and then the store.

A fill is known by **(dataset, copy, fill id)**, never by its id alone: fill ids are numbered
per dataset, so "A-1" names a fill of every dataset that was scaled once. A fill runs when it
appears in the view and reports ``done`` only once this process walked every shard it was
given (a fill listed again after it left the view runs again; the blocks it copied are cached
and skipped). ``done`` is what lets the coordinator end a hand-off, after which the old owners
drop what the new owners hold (:mod:`coordinator.manager`, "the hand-off invariant").

Progress goes to the coordinator in every heartbeat (``fills``, per dataset, naming the copy and
the id); a fill no longer in the view is cancelled and forgotten. A fill of a dataset not served
here yet waits until it is (:class:`~cachefs.cluster.served.ServedDatasets`). Like the
preloader, the fills run as tasks of one nursery, with a node-wide bound on blocks in flight.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any, Protocol

import trio

from cachefs.background import BackgroundTasks
from cachefs.cache.base import BlockCache, BlockKey
from cachefs.errors import CachefsError
from cachefs.metrics import WorkerMetrics
from cachefs.peer.base import BlockRequest, PeerError, PeerRefused
from cachefs.peer.client import PeerClient

from .membership import FillAssignment
from .planning import PlannedObject, plan
from .preload import PreloadSource
from .served import ServedDatasets

log = logging.getLogger("cachefs.fill")

#: Waits before asking again when the source answers 503 (it sheds load past its in-flight cap,
#: which several filling nodes can reach): an overloaded source is busy, not missing the block.
OVERLOADED_RETRY_S = (0.25, 0.5, 1.0)
#: Skip checks (an index lookup each) between two yields to the trio loop, so that walking a
#: shard whose blocks are all cached does not hold the loop.
CHECKS_PER_YIELD = 256
#: Waits before the passes that try again the shards where copying a block failed (a source
#: busy or briefly unreachable): one more pass per entry, the last one after the peer client's
#: cool-down of an unreachable peer (5 s, cachefs/peer/client.py) is over.
FAILED_SHARD_RETRY_S = (2.0, 6.0)

#: A fill's identity: (dataset, copy, fill id).
FillKey = tuple[str, str, str]


class FillRoute(Protocol):
    def fill_address(self, dataset: str, shard: int) -> str | None: ...


class FillTarget(Protocol):
    """What the filler needs from the worker for one dataset."""

    def preload_source(self, dataset: str) -> PreloadSource | None:
        """(snapshot, store config, source id, block size) of a served dataset, or None."""
        ...

    async def prepare_reads(self, dataset: str, keys: Sequence[str]) -> int:
        """As the preloader's target does (cachefs/cluster/preload.py): first reads of these
        files, just copied here, answered by the native path."""
        ...


class Filler:
    def __init__(
        self,
        target: FillTarget,
        cache: BlockCache,
        peers: PeerClient,
        route: FillRoute,
        metrics: WorkerMetrics,
        *,
        concurrency: int = 8,
    ):
        self._target = target
        self._cache = cache
        self._peers = peers
        self._route = route
        self._metrics = metrics
        # A semaphore, not a CapacityLimiter: the spawning task acquires, the block task releases.
        self._slots = trio.Semaphore(concurrency)
        self._admit_limiter = trio.CapacityLimiter(4)
        self._fills: dict[str, _FillRun] = {}  # dataset -> its fill in the view
        self._served = ServedDatasets()
        self._tasks = BackgroundTasks()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Owns the fill tasks; runs until cancelled."""
        await self._tasks.run(task_status=task_status)

    def assign(self, assignments: dict[str, FillAssignment]) -> None:
        """Take this node's fills from the membership after a heartbeat (dataset → what to
        fill). A fill is (dataset, copy, id): new ones start; those no longer in the view (the
        dataset's fill now has another copy or id, or none) are cancelled and forgotten; the
        others follow changes of the shards this node owns."""
        for dataset, current in list(self._fills.items()):
            wanted = assignments.get(dataset)
            if wanted is None or fill_key(wanted) != current.key:
                current.cancel_scope.cancel()
                del self._fills[dataset]
        if not self._tasks.running:
            return
        for dataset, wanted in assignments.items():
            run = self._fills.get(dataset)
            if run is None:
                run = self._fills[dataset] = _FillRun(self, wanted)
                self._tasks.start_soon(run.run)
            run.set_shards(wanted.shards)

    def datasets_changed(self) -> None:
        """The datasets served here changed (the agent calls this): fills waiting for their
        dataset look again."""
        self._served.changed()

    def reports(self) -> dict[str, dict[str, Any]]:
        """Progress of each fill in the view, per dataset (the heartbeat's ``fills``)."""
        return {dataset: run.report() for dataset, run in self._fills.items()}


def fill_key(assignment: FillAssignment) -> FillKey:
    return (assignment.dataset, assignment.copy, assignment.fill_id)


class _FillRun:
    def __init__(self, filler: Filler, assignment: FillAssignment):
        self.filler = filler
        self.dataset = assignment.dataset
        self.copy = assignment.copy
        self.fill_id = assignment.fill_id
        self.key = fill_key(assignment)
        self.shards: frozenset[int] = frozenset()
        self.cancel_scope = trio.CancelScope()
        self.done = False
        self.copied_blocks = self.copied_bytes = 0
        # shard -> blocks the source did not hold / whose copy failed, in the latest pass over
        # the shard (a later pass tries the failed ones again, and asks for the absent ones too)
        self._absent: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._changed = trio.Event()

    @property
    def absent_blocks(self) -> int:
        return sum(self._absent.values())

    @property
    def failed_blocks(self) -> int:
        """Blocks not copied because of an error, as of the latest pass over their shard."""
        return sum(self._failed.values())

    def set_shards(self, shards: frozenset[int]) -> None:
        if shards != self.shards:
            self.shards = shards
            self._changed.set()

    def report(self) -> dict[str, Any]:
        return {
            "copy": self.copy,
            "id": self.fill_id,
            "done": self.done,
            "copied_blocks": self.copied_blocks,
            "copied_bytes": self.copied_bytes,
            "absent_blocks": self.absent_blocks,
            "failed_blocks": self.failed_blocks,
            # per shard: the coordinator never trims a shard with failed blocks from the node
            # that handed it off on a byte count alone (coordinator/copies.py split_handed_off)
            "failed_shards": {str(s): n for s, n in sorted(self._failed.items()) if n},
        }

    async def run(self) -> None:
        filler = self.filler
        with self.cancel_scope:
            walked: set[int] = set()  # shards every block of which was tried
            while True:
                todo = self.shards - walked
                if todo:
                    self.done = False
                    source = await filler._served.wait_source(
                        filler._target, self.dataset, f"fill {self.fill_id} of copy {self.copy}"
                    )
                    todo = self.shards - walked  # the shards may have changed meanwhile
                    if not todo:
                        continue
                    filled = await self._fill_shards(todo, source)
                    for delay in FAILED_SHARD_RETRY_S:
                        again = {s for s in todo if self._failed.get(s) and s in self.shards}
                        if not again:
                            break
                        await trio.sleep(delay)
                        await self._fill_shards(again, source)
                    # Before "done", as a preload does: the copy's first reads stay in C.
                    await filler._target.prepare_reads(self.dataset, filled)
                    walked |= todo
                    continue
                if not self.done:
                    self.done = True
                    log.info(
                        "fill %s of %r (copy %s) done: %d blocks (%d bytes) copied, %d absent, "
                        "%d failed",
                        self.fill_id, self.dataset, self.copy, self.copied_blocks,
                        self.copied_bytes, self.absent_blocks, self.failed_blocks,
                    )  # fmt: skip
                await self._changed.wait()
                self._changed = trio.Event()

    async def _fill_shards(self, shards: AbstractSet[int], source: PreloadSource) -> list[str]:
        """Try every block of ``shards`` not cached here (one pass); the keys of their files."""
        snapshot, _config, source_id, block_size = source
        for shard in shards:
            self._absent.pop(shard, None)
            self._failed.pop(shard, None)
        planned = await trio.to_thread.run_sync(plan, snapshot, {}, block_size, shards)
        log.info("fill %s of %r: %d shards, %d objects here from the nodes that held them",
                 self.fill_id, self.dataset, len(shards),
                 sum(len(objects) for objects in planned.values()))  # fmt: skip
        filler = self.filler
        checks = 0
        async with trio.open_nursery() as nursery:
            for shard in sorted(planned):
                for obj in planned[shard]:
                    if shard not in self.shards:
                        break  # no longer this node's shard (the membership changed)
                    for index in obj.blocks if obj.size else ():  # empty files have no blocks
                        key = BlockKey.make(source_id, obj.key, obj.etag, index)
                        checks += 1
                        if checks % CHECKS_PER_YIELD == 0:
                            await trio.lowlevel.checkpoint()
                        if filler._cache.locate(key) is not None:
                            continue
                        await filler._slots.acquire()
                        nursery.start_soon(self._copy_block, shard, obj, index, key, block_size)
        return [obj.key for shard in sorted(planned) for obj in planned[shard]]

    async def _copy_block(
        self, shard: int, obj: PlannedObject, index: int, key: BlockKey, block_size: int
    ) -> None:
        filler = self.filler
        try:
            address = filler._route.fill_address(self.dataset, shard)
            if address is None:  # the fill or its source for this shard went away meanwhile
                return
            request = BlockRequest(
                self.dataset, obj.key, obj.etag, obj.size, index, block_size, cached_only=True
            )
            outcome = await self._get_and_admit(address, request, key)
            if outcome == "copied":
                self.copied_blocks += 1
                self.copied_bytes += request.length
                filler._metrics.fill_bytes += request.length
            else:
                counts = self._absent if outcome == "absent" else self._failed
                counts[shard] = counts.get(shard, 0) + 1
            filler._metrics.fill_blocks[outcome] += 1
        finally:
            filler._slots.release()

    async def _get_and_admit(self, address: str, request: BlockRequest, key: BlockKey) -> str:
        """One block from the fill source into the cache: "copied", "absent" or "failed"."""
        filler = self.filler
        for delay in (*OVERLOADED_RETRY_S, None):
            try:
                data = await filler._peers.get_block(address, request)
                break
            except PeerRefused as exc:
                if exc.status == 404:  # not cached there (or not its version of the file)
                    return "absent"
                if exc.status != 503 or delay is None:
                    log.debug("fill %s: %s", self.fill_id, exc)
                    return "failed"
                await trio.sleep(delay)
            except PeerError as exc:  # includes cooling down: no I/O, fails at once
                log.debug("fill %s: %s", self.fill_id, exc)
                return "failed"
        try:
            tier = await trio.to_thread.run_sync(
                filler._cache.put, key, data, limiter=filler._admit_limiter
            )
        except CachefsError as exc:
            log.warning("fill %s: admitting a block failed: %s", self.fill_id, exc)
            return "failed"
        # None: refused (avoid-eviction with full tiers); the read path will read it through.
        return "failed" if tier is None else "copied"
