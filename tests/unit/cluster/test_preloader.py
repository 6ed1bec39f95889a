"""The worker's :class:`Preloader` over real parts: a local store, a snapshot built from it, a
TieredBlockCache and a Membership fed a coordinator view; the fetcher pool fetches in the
calling thread (``FetcherPool(0)``, the pool's own tests run its processes).

The job arrives before its dataset is served here, as it does when ``cachefs preload`` follows
``cachefs dataset add`` at once (the same heartbeat reply carries both): it must wait for the
dataset, then plan and load every shard this node owns.
"""

from __future__ import annotations

import random

import trio
import trio.testing

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey, shard_of
from cachefs.cluster.fetchers import FetcherPool
from cachefs.cluster.membership import Membership
from cachefs.cluster.preload import Preloader
from cachefs.meta import Snapshot, build_snapshot
from cachefs.protocol import owner_table
from cachefs.store import StoreConfig, open_store
from tests.waiting import WAIT_S

BLOCK = 16 * 1024
SOURCE_ID = 5


class Worker:
    """What the preloader asks of the worker: a dataset's source once it is served."""

    def __init__(self, snapshot: Snapshot, config: StoreConfig):
        self.snapshot, self.config = snapshot, config
        self.served: set[str] = set()
        self.prepared: list[tuple[str, list[str]]] = []  # prepare_reads calls
        self.preloader: Preloader | None = None
        self.reports_when_prepared: list[dict] = []

    def preload_source(self, dataset: str):
        if dataset not in self.served:
            return None
        return self.snapshot, self.config, SOURCE_ID, BLOCK

    async def prepare_reads(self, dataset: str, keys) -> int:
        self.prepared.append((dataset, list(keys)))
        if self.preloader is not None:  # what the job reported then
            self.reports_when_prepared.append(self.preloader.reports())
        return len(keys)


def view(nodes: list[str]) -> dict:
    return {
        "cluster_id": "c0ffee",
        "heartbeat_interval_s": 1.0,
        "nodes": {n: {"address": f"127.0.0.{i + 2}:1", "up": True} for i, n in enumerate(nodes)},
        "datasets": [{"spec": {"name": "b"}, "refresh_epoch": 0, "copies": {"A": nodes}}],
        "preloads": [{"id": "b-1", "dataset": "b", "copy": "A", "selection": {}}],
        "tasks": [],
    }


async def test_a_job_for_a_dataset_not_served_yet_runs_once_it_is(tmp_path) -> None:
    rng = random.Random(3)
    files = {f"train/{i:03d}.bin": rng.randbytes(rng.randint(1, 3 * BLOCK)) for i in range(40)}
    source = tmp_path / "source"
    for key, data in files.items():
        (source / key).parent.mkdir(parents=True, exist_ok=True)
        (source / key).write_bytes(data)
    config = StoreConfig(uri=f"file://{source}")
    store = open_store(config)
    build_snapshot(store.list(), tmp_path / "snapshot")
    snapshot = Snapshot.open(tmp_path / "snapshot")
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 64 << 20)]
    )
    try:
        worker = Worker(snapshot, config)
        membership = Membership("n1")
        the_view = view(["n1", "n2"])
        membership.update(the_view)
        preloader = worker.preloader = Preloader(
            worker, cache, membership, FetcherPool(0), concurrency=4
        )
        owners = owner_table("b", ["n1", "n2"])
        mine = {key for key in files if owners[shard_of(key)] == "n1"}
        owned_shards = {shard for shard, owner in enumerate(owners) if owner == "n1"}
        async with trio.open_nursery() as nursery:
            await nursery.start(preloader.run)
            preloader.assign(the_view["preloads"], {"b": {"A": ["n1", "n2"]}})
            await trio.testing.wait_all_tasks_blocked()
            assert preloader.reports() == {"b-1": {}}  # waiting: nothing planned yet
            assert worker.prepared == []

            worker.served.add("b")  # the dataset is opened; the agent tells the preloader
            preloader.datasets_changed()
            with trio.fail_after(WAIT_S):
                while True:
                    shards = preloader.reports()["b-1"]
                    if len(shards) == len(owned_shards) and all(
                        r["complete"] for r in shards.values()
                    ):
                        break
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
        assert {int(s) for s in shards} == owned_shards
        assert sum(r["done_objects"] for r in shards.values()) == len(mine)
        assert sum(r["failed_count"] for r in shards.values()) == 0
        for key in mine:  # every block of this node's shards, byte for byte
            etag = snapshot.resolve(key).etag
            data = files[key]
            for index in range(-(-len(data) // BLOCK)):
                block = cache.read(BlockKey.make(SOURCE_ID, key, etag, index))
                assert block == data[index * BLOCK : (index + 1) * BLOCK], (key, index)
        assert preloader.fetched_blocks == sum(-(-len(files[k]) // BLOCK) for k in mine)
        # Before its shards were reported complete, the files were prepared for native reads,
        # once each: this node's files first, then the other node's (LOOKUP replies only).
        assert [dataset for dataset, _ in worker.prepared] == ["b"]
        prepared = worker.prepared[0][1]
        assert sorted(prepared) == sorted(files) and set(prepared[: len(mine)]) == mine
        (then,) = worker.reports_when_prepared
        assert then["b-1"] and not any(r["complete"] for r in then["b-1"].values())
    finally:
        cache.close()
        snapshot.close()
        store.close()
