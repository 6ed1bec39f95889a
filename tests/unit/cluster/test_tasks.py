"""Cleanup tasks on a worker: :class:`TaskRunner` over a real TieredBlockCache and a real
:class:`Membership` (the view's ``tasks`` and ``copies``), as the heartbeat agent drives it."""

from __future__ import annotations

import pytest
import trio
from prometheus_client import generate_latest

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey
from cachefs.cluster.membership import Membership
from cachefs.cluster.tasks import TaskRunner
from cachefs.metrics import WorkerMetrics, make_registry
from cachefs.protocol import owner_table

BLOCK = 4096  # one page: the footprint of a block (what a tier counts) is its size
SOURCES = {"ds": 1, "other": 2}


class Target:
    def __init__(self, served: dict[str, int]):
        self.served = served

    def served_source_id(self, dataset: str) -> int | None:
        return self.served.get(dataset)


def view(copies: dict[str, list[str]], tasks: list[dict]) -> dict:
    nodes = sorted({n for members in copies.values() for n in members})
    return {
        "cluster_id": "c0ffee",
        "heartbeat_interval_s": 1.0,
        "nodes": {n: {"address": f"{n}:1", "up": True} for n in nodes},
        "datasets": [{"spec": {"name": "ds"}, "refresh_epoch": 0, "copies": copies, "fills": {}}],
        "preloads": [],
        "tasks": tasks,
    }


def block_key(i: int, source_id: int) -> BlockKey:
    return BlockKey.make(source_id, f"train/f{i:04d}", "etag", 0)


@pytest.fixture
def cache(tmp_path):
    """200 blocks of "ds" (the first 10 admitted are the reserve) and 20 of "other"."""
    opened = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 400 * BLOCK, 10 * BLOCK)]
    )
    for i in range(200):
        assert opened.put(block_key(i, 1), bytes([i % 251]) * BLOCK)
    for i in range(20):
        assert opened.put(block_key(i, 2), bytes([7]) * BLOCK)
    yield opened
    opened.close()


def held(cache: TieredBlockCache, source_id: int, count: int) -> set[int]:
    return {i for i in range(count) if cache.contains(block_key(i, source_id))}


async def run_tasks(runner: TaskRunner, membership: Membership, the_view: dict) -> dict:
    """Apply one heartbeat reply the way the agent does; wait for its tasks' results."""
    membership.update(the_view)
    runner.assign(the_view["tasks"])
    wanted = {task["id"] for task in the_view["tasks"]}
    with trio.fail_after(10):
        while not wanted <= runner.reports().keys():
            await trio.sleep(0.01)
    return runner.reports()


async def test_trim_free_unknown_and_unserved_tasks(cache):
    membership = Membership("n1")
    metrics = WorkerMetrics()
    runner = TaskRunner(Target(SOURCES), cache, membership, metrics)
    table = owner_table("ds", ["n1", "n2"])
    owned = {i for i in range(200) if table[block_key(i, 1).shard] == "n1"}
    reserved = set(range(10))
    handed_off = sorted({block_key(i, 1).shard for i in range(200)} - {
        block_key(i, 1).shard for i in owned
    })  # fmt: skip
    tasks = [
        {
            "id": "t-1",
            "kind": "trim",
            "dataset": "ds",
            "reason": "hand-off of copy A done",
            "shards": handed_off,
        },
        {"id": "t-2", "kind": "shred", "dataset": "ds", "reason": "?"},
        {"id": "t-3", "kind": "free", "dataset": "not-here", "reason": "ttl"},
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        first = view({"A": ["n1", "n2"]}, tasks)
        results = await run_tasks(runner, membership, first)

        trimmed = set(range(200)) - owned - reserved
        assert 0 < len(trimmed) < 190
        assert results == {
            "t-1": {"freed_bytes": len(trimmed) * BLOCK, "error": None},
            "t-2": {"freed_bytes": 0, "error": "unknown task kind 'shred': nothing done"},
            "t-3": {"freed_bytes": 0, "error": None},
        }
        assert held(cache, 1, 200) == owned | reserved
        assert held(cache, 2, 20) == set(range(20))  # another dataset is left alone

        # Re-sent until acknowledged: reported again, never run again.
        membership.update(first)
        runner.assign(tasks)
        await trio.sleep(0.05)
        assert runner.reports() == results
        assert len(runner.history) == 3
        # Acknowledged (no longer listed): no longer reported.
        runner.assign(tasks[1:])
        assert runner.reports().keys() == {"t-2", "t-3"}

        # A free: everything of the dataset but the reserve.
        free = [{"id": "t-4", "kind": "free", "dataset": "ds", "reason": "ttl: copy A idle"}]
        results = await run_tasks(runner, membership, view({"A": ["n1", "n2"]}, free))
        assert results == {"t-4": {"freed_bytes": len(owned - reserved) * BLOCK, "error": None}}
        assert held(cache, 1, 200) == reserved

        # Listed again after it was acknowledged: its old result, not a second run.
        runner.assign(tasks)
        await trio.sleep(0.05)
        assert runner.reports()["t-1"] == {"freed_bytes": len(trimmed) * BLOCK, "error": None}
        assert [entry["id"] for entry in runner.history] == ["t-1", "t-2", "t-3", "t-4"]
        nursery.cancel_scope.cancel()

    assert metrics.freed_bytes == {
        ("ds", "trim"): len(trimmed) * BLOCK,
        ("ds", "free"): len(owned - reserved) * BLOCK,
        ("not-here", "free"): 0,
    }
    text = generate_latest(make_registry(metrics)).decode()
    assert (
        f'cachefs_cache_freed_bytes_total{{dataset="ds",kind="trim"}} {len(trimmed) * BLOCK}.0'
        in text
    )
    entry = runner.history[0]
    assert {k: entry[k] for k in ("id", "kind", "dataset", "reason", "freed_bytes", "error")} == {
        "id": "t-1",
        "kind": "trim",
        "dataset": "ds",
        "reason": "hand-off of copy A done",
        "freed_bytes": len(trimmed) * BLOCK,
        "error": None,
    }
    assert entry["at"] > 0


async def test_trim_on_a_node_in_no_copy_frees_the_listed_shards_but_the_reserve(cache):
    membership = Membership("n9")
    runner = TaskRunner(Target(SOURCES), cache, membership, WorkerMetrics())
    every = sorted({block_key(i, 1).shard for i in range(200)})
    trim = [
        {"id": "t-1", "kind": "trim", "dataset": "ds", "reason": "left", "shards": every[::2]},
        {"id": "t-2", "kind": "trim", "dataset": "ds", "reason": "left", "shards": every[1::2]},
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        results = await run_tasks(runner, membership, view({"A": ["n1", "n2"]}, trim[:1]))
        halfway = held(cache, 1, 200)
        results |= await run_tasks(runner, membership, view({"A": ["n1", "n2"]}, trim))
        nursery.cancel_scope.cancel()
    kept_first = {i for i in range(10, 200) if block_key(i, 1).shard in set(every[1::2])}
    assert halfway == set(range(10)) | kept_first
    assert results == {
        "t-1": {"freed_bytes": (190 - len(kept_first)) * BLOCK, "error": None},
        "t-2": {"freed_bytes": len(kept_first) * BLOCK, "error": None},
    }
    assert held(cache, 1, 200) == set(range(10))


async def test_a_trim_never_drops_a_shard_the_node_owns_now_nor_guesses(cache):
    """A trim decided at the end of one hand-off can reach a node after the next scale gave
    it the shards back: those stay. A trim listing no shards (or not a list of shards) frees
    nothing: the worker never decides alone what it may drop."""
    membership = Membership("n1")
    runner = TaskRunner(Target(SOURCES), cache, membership, WorkerMetrics())
    every = sorted({block_key(i, 1).shard for i in range(200)})
    tasks = [
        {"id": "t-1", "kind": "trim", "dataset": "ds", "reason": "hand-off", "shards": every},
        {"id": "t-2", "kind": "trim", "dataset": "ds", "reason": "old coordinator"},
        {"id": "t-3", "kind": "trim", "dataset": "ds", "reason": "?", "shards": [1, 2048]},
        {"id": "t-4", "kind": "trim", "dataset": "ds", "reason": "?", "shards": [True]},
    ]
    table = owner_table("ds", ["n1", "n2"])  # n1 owns these shards now
    owned = {i for i in range(200) if table[block_key(i, 1).shard] == "n1"}
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        results = await run_tasks(runner, membership, view({"A": ["n1", "n2"]}, tasks))
        nursery.cancel_scope.cancel()
    assert held(cache, 1, 200) == owned | set(range(10))
    assert results["t-1"] == {"freed_bytes": (190 - len(owned - set(range(10)))) * BLOCK,
                              "error": None}  # fmt: skip
    for task_id in ("t-2", "t-3", "t-4"):
        assert results[task_id]["freed_bytes"] == 0
        assert "a trim must list its shards" in results[task_id]["error"]


async def test_a_task_dropped_before_it_ran_is_not_run(cache):
    membership = Membership("n1")
    runner = TaskRunner(Target(SOURCES), cache, membership, WorkerMetrics())
    free = {"id": "t-1", "kind": "free", "dataset": "ds", "reason": "ttl"}
    membership.update(view({"A": ["n1"]}, [free]))
    runner.assign([free])  # queued, but the runner is not running yet
    runner.assign([])  # the view drops it before it ran
    async with trio.open_nursery() as nursery:
        await nursery.start(runner.run)
        await trio.sleep(0.05)
        assert runner.reports() == {}
        assert len(held(cache, 1, 200)) == 200
        # Listed again later: it never ran, so it runs now (once).
        results = await run_tasks(runner, membership, view({"A": ["n1"]}, [free]))
        nursery.cancel_scope.cancel()
    assert results["t-1"]["freed_bytes"] == 190 * BLOCK
