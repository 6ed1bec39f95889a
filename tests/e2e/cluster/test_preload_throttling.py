"""Preload against a store that throttles: a real S3 endpoint (moto) behind the fault proxy,
which answers 503 SlowDown to 20 % of the GETs, fetched by the Preloader through real fetcher
processes (``FetcherPool(2)``), with each of their S3 clients: the lean bulk-GET client (the
default) and boto3 (S3Store, its fallback). Every object must arrive byte for byte (the
throttled tries retried), every GET must have come from the client asked for, and the adaptive
concurrency must have come down from its peak."""

from __future__ import annotations

import random

import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey
from cachefs.cluster.fetchers import FetcherPool
from cachefs.cluster.membership import Membership
from cachefs.cluster.preload import Preloader
from cachefs.meta import Snapshot, build_snapshot
from cachefs.store import StoreConfig, open_store
from cachefs.store.base import RetryPolicy
from cachefs.store.s3_bulk import USER_AGENT
from tests.waiting import WAIT_S

BLOCK = 16 * 1024
SOURCE_ID = 7


class Worker:
    """What the preloader asks of the worker: the dataset's source."""

    def __init__(self, snapshot: Snapshot, config: StoreConfig):
        self.snapshot, self.config = snapshot, config

    def preload_source(self, dataset: str):
        return self.snapshot, self.config, SOURCE_ID, BLOCK

    async def prepare_reads(self, dataset: str, keys) -> int:
        return 0  # no mount here: nothing to prepare


@pytest.mark.parametrize("lean_s3", [True, False], ids=["lean-client", "boto3"])
async def test_preload_from_a_throttling_store_retries_and_lowers_its_concurrency(
    tmp_path, moto_s3, fault_proxy, lean_s3
) -> None:
    rng = random.Random(17)
    files = {f"train/{i:03d}.bin": rng.randbytes(rng.randint(1, 2 * BLOCK)) for i in range(150)}
    bucket = moto_s3.make_bucket()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    config = StoreConfig(
        f"s3://{bucket}/ds",
        endpoint=fault_proxy.url,
        # Short backoffs keep the test quick; 10 tries make a block failing every one of them
        # (0.2 ** 10) practically impossible.
        retry=RetryPolicy(attempts=10, base_delay_s=0.01, max_delay_s=0.1),
    )
    store = open_store(config)
    build_snapshot(store.list(), tmp_path / "snapshot")
    snapshot = Snapshot.open(tmp_path / "snapshot")
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 64 << 20)]
    )
    pool = FetcherPool(2, lean_s3=lean_s3)
    try:
        membership = Membership("n1")
        membership.update(
            {
                "cluster_id": "c0ffee",
                "heartbeat_interval_s": 1.0,
                "nodes": {"n1": {"address": "127.0.0.2:1", "up": True}},
                "datasets": [{"spec": {"name": "ds"}, "refresh_epoch": 0, "copies": {"A": ["n1"]}}],
                "tasks": [],
            }
        )
        preloader = Preloader(
            Worker(snapshot, config), cache, membership, pool, concurrency=8, max_concurrency=32
        )
        fault_proxy.fail_fraction(0.2, status=503, path_contains="/ds/train/")
        async with trio.open_nursery() as nursery:
            await nursery.start(preloader.run)
            job = {"id": "ds-1", "dataset": "ds", "copy": "A", "selection": {}}
            preloader.assign([job], {"ds": {"A": ["n1"]}})
            with trio.fail_after(WAIT_S):
                while True:
                    shards = preloader.reports()["ds-1"]
                    if shards and all(r["complete"] for r in shards.values()):
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert sum(r["failed_count"] for r in shards.values()) == 0, shards
        assert sum(r["done_objects"] for r in shards.values()) == len(files)
        for key, data in files.items():  # every block, byte for byte
            etag = snapshot.resolve(key).etag
            for index in range(-(-len(data) // BLOCK)):
                block = cache.read(BlockKey.make(SOURCE_ID, key, etag, index))
                assert block == data[index * BLOCK : (index + 1) * BLOCK], (key, index)
        blocks = sum(-(-len(data) // BLOCK) for data in files.values())
        gets = fault_proxy.count("GET", path_contains="/ds/train/")
        assert gets > blocks  # the throttled tries were retried
        agents = fault_proxy.user_agents("GET", path_contains="/ds/train/")
        if lean_s3:
            assert agents == {USER_AGENT}
        else:
            assert len(agents) == 1 and next(iter(agents)).startswith("Botocore/"), agents
        report = preloader.concurrency.report()
        assert report["throttled"] > 0 and report["decreases"] > 0, report
        assert report["limit"] < report["peak"], report
    finally:
        pool.close()
        cache.close()
        snapshot.close()
        store.close()
