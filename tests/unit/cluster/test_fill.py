"""Filling a copy from the nodes that held it: cached-only peer requests, the read path's fill
source, and the background :class:`Filler`.

Every node is made of the real parts a worker runs (minus FUSE): a TieredBlockCache, a
snapshot built from a local store, a BlockReader with a PeerClient and its Membership, and a
FileSystem whose ``serve_peer_block`` is served by a PeerServer on its own 127.0.0.x address. Each
node's store is wrapped (below SEAM A) only to count GETs: a cached-only request must never
reach a store.

Every node serves two datasets, "ds" and "other", over the same files (separate caches): fill
ids are numbered per dataset, so both can have a fill "B-1" at once.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey, shard_of
from cachefs.cluster import fill as fill_module
from cachefs.cluster.fill import Filler
from cachefs.cluster.membership import Membership
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.core import FileSystem, MountedDataset
from cachefs.meta import Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.peer.base import BlockRequest, PeerRefused
from cachefs.peer.client import PeerClient, open_peer_client
from cachefs.protocol import owner_table
from cachefs.store import StoreConfig, open_store
from tests.fakes.wrappers import CountingStore, served_peer
from tests.waiting import WAIT_S

BLOCK = 16 * 1024
TOKEN = "fill-token"
DATASET = "ds"
OTHER = "other"
SOURCE_IDS = {DATASET: 77, OTHER: 78}
SOURCE_ID = SOURCE_IDS[DATASET]


@dataclass
class Node:
    name: str
    cache: TieredBlockCache
    store: CountingStore
    snapshot: Snapshot
    source: DataSource
    reader: BlockReader
    fs: FileSystem
    membership: Membership
    peers: PeerClient
    metrics: WorkerMetrics
    address: str = ""
    served: set[str] = field(default_factory=lambda: set(SOURCE_IDS))  # what preload_source sees
    prepared: list[tuple[str, list[str]]] = field(default_factory=list)  # prepare_reads calls

    def preload_source(self, dataset: str):
        if dataset not in self.served:
            return None
        return self.snapshot, None, SOURCE_IDS[dataset], BLOCK

    async def prepare_reads(self, dataset: str, keys) -> int:
        self.prepared.append((dataset, list(keys)))
        return self.fs.prepare_reads(dataset, list(keys), 1 << 20)[0]

    def version(self, key: str) -> FileVersion:
        entry = self.snapshot.resolve(key)
        return FileVersion(entry.key, entry.etag, entry.size)


@dataclass
class World:
    files: dict[str, bytes]
    nodes: dict[str, Node]

    def blocks(self) -> list[tuple[str, int]]:
        """(key, index) of every block of the dataset (empty files have none)."""
        return [(k, i) for k, data in self.files.items() for i in range(-(-len(data) // BLOCK))]

    def block(self, key: str, index: int) -> bytes:
        return self.files[key][index * BLOCK : (index + 1) * BLOCK]

    def block_key(self, node: str, key: str, index: int, dataset: str = DATASET) -> BlockKey:
        version = self.nodes[node].version(key)
        return BlockKey.make(SOURCE_IDS[dataset], key, version.etag, index)

    def view(
        self,
        copies: dict[str, list[str]],
        fills: dict | None = None,
        datasets: tuple[str, ...] = (DATASET,),
    ) -> dict:
        """A heartbeat reply naming ``datasets``, each with these copies and fills."""
        return {
            "cluster_id": "c0ffee",
            "heartbeat_interval_s": 1.0,
            "nodes": {n: {"address": node.address, "up": True} for n, node in self.nodes.items()},
            "datasets": [
                {
                    "spec": {"name": name},
                    "refresh_epoch": 0,
                    "copies": copies,
                    "fills": fills or {},
                }
                for name in datasets
            ],
            "preloads": [],
            "tasks": [],
        }

    def apply(self, view: dict) -> None:
        for node in self.nodes.values():
            node.membership.update(view)


def dataset_files() -> dict[str, bytes]:
    rng = random.Random(11)
    files = {f"train/f{i:03d}.bin": rng.randbytes(rng.randint(1, 4 * BLOCK)) for i in range(60)}
    files["train/exact.bin"] = rng.randbytes(2 * BLOCK)
    files["train/empty"] = b""
    return files


@pytest.fixture
async def world(tmp_path) -> AsyncIterator[World]:
    """Nodes n1..n3 serving dataset "ds" from the same local source, each on 127.0.0.(i+1);
    nothing cached and no view applied yet."""
    files = dataset_files()
    source_dir = tmp_path / "source"
    for key, data in files.items():
        (source_dir / key).parent.mkdir(parents=True, exist_ok=True)
        (source_dir / key).write_bytes(data)
    nodes: dict[str, Node] = {}
    async with AsyncExitStack() as stack:
        for i, name in enumerate(("n1", "n2", "n3"), start=1):
            root = tmp_path / name
            store = CountingStore(open_store(StoreConfig(uri=f"file://{source_dir}")))
            stack.callback(store.close)
            build_snapshot(store.list(), root / "snapshot")
            snapshot = Snapshot.open(root / "snapshot")
            stack.callback(snapshot.close)
            cache = TieredBlockCache(
                str(root / "index"), [TierConfig("ram", str(root / "ram"), 64 << 20)]
            )
            stack.callback(cache.close)
            peers = await stack.enter_async_context(open_peer_client(TOKEN))
            metrics = WorkerMetrics()
            membership = Membership(name)
            reader = BlockReader(cache, metrics, peers=peers, route=membership)
            fs = FileSystem(reader)
            source = DataSource(DATASET, store, SOURCE_ID, BLOCK)
            fs.add_dataset(MountedDataset(DATASET, 1, snapshot, source))
            other = DataSource(OTHER, store, SOURCE_IDS[OTHER], BLOCK)
            fs.add_dataset(MountedDataset(OTHER, 2, snapshot, other))
            node = Node(
                name, cache, store, snapshot, source, reader, fs, membership, peers, metrics
            )
            node.address = await stack.enter_async_context(
                served_peer(fs.serve_peer_block, f"127.0.0.{i + 1}", token=TOKEN)
            )
            nodes[name] = node
        yield World(files, nodes)


def seed_copy_a(world: World, dataset: str = DATASET) -> tuple[set, set]:
    """Copy A = (n1, n2) holds every block of ``dataset`` in its owner's cache except those of
    every fourth file; n3 already holds block 0 of every fourth file after those. Returns
    (blocks held by A, blocks held by n3)."""
    table = owner_table(dataset, ["n1", "n2"])
    held, precached = set(), set()
    for key, index in world.blocks():
        file_no = sorted(world.files).index(key)
        data = world.block(key, index)
        if file_no % 4 != 0:
            owner = world.nodes[table[shard_of(key)]]
            assert owner.cache.put(world.block_key(owner.name, key, index, dataset), data)
            held.add((key, index))
        if file_no % 4 == 1 and index == 0:
            n3 = world.nodes["n3"]
            assert n3.cache.put(world.block_key("n3", key, index, dataset), data)
            precached.add((key, index))
    return held, precached


CLONE = {"A": ["n1", "n2"], "B": ["n3"]}
CLONE_FILL = {"B": {"id": "B-1", "from": ["n1", "n2"]}}


async def wait_done(filler: Filler, dataset: str = DATASET) -> dict:
    with trio.fail_after(WAIT_S):
        while not filler.reports().get(dataset, {}).get("done"):
            await trio.sleep(0.02)
    return filler.reports()[dataset]


def store_gets(world: World) -> dict[str, int]:
    return {name: node.store.gets for name, node in world.nodes.items()}


# --- the peer server's side: cached-only requests ---------------------------------------------


async def test_cached_only_requests_are_served_from_the_cache_or_404_never_the_store(world):
    n1, n3 = world.nodes["n1"], world.nodes["n3"]
    key = "train/exact.bin"
    version = n1.version(key)
    cached_only = BlockRequest(DATASET, key, version.etag, version.size, 1, BLOCK, True)

    with pytest.raises(PeerRefused, match="404: not cached") as info:
        await n3.peers.get_block(n1.address, cached_only)
    assert info.value.status == 404
    assert not n3.peers.is_cooling(n1.address)
    assert n1.store.gets == 0
    assert DATASET not in n1.reader.last_read_at  # a fill's copy is not a read of the dataset

    # A plain request to the owner reads the store once and admits the block...
    plain = BlockRequest(DATASET, key, version.etag, version.size, 1, BLOCK)
    assert await n3.peers.get_block(n1.address, plain) == world.block(key, 1)
    assert n1.store.gets == 1
    assert n1.reader.last_read_at[DATASET] > 0
    # ...after which a cached-only request gets it from the cache.
    assert await n3.peers.get_block(n1.address, cached_only) == world.block(key, 1)
    assert n1.store.gets == 1
    # Another version of the file is not this node's file: 404 as well.
    other = BlockRequest(DATASET, key, '"other-etag"', version.size, 1, BLOCK, True)
    with pytest.raises(PeerRefused, match="not this node's file"):
        await n3.peers.get_block(n1.address, other)


# --- the read path: an owner asks the fill source before the store ----------------------------


async def test_an_owner_reads_from_the_fill_source_before_the_store(world):
    held, precached = seed_copy_a(world)
    world.apply(world.view(CLONE, CLONE_FILL))
    n3 = world.nodes["n3"]
    present = sorted(held - precached)[3]
    absent = next(b for b in world.blocks() if b not in held)
    before = store_gets(world)

    # Several readers of one block: one cached-only request, no store read, admitted here.
    key, index = present
    version = n3.version(key)
    results = []

    async def read(offset: int) -> None:
        results.append(await n3.reader.read(n3.source, version, index * BLOCK + offset, 100))

    async with trio.open_nursery() as nursery:
        for offset in range(0, 1000, 100):
            nursery.start_soon(read, offset)
    block = world.block(key, index)
    assert sorted(results) == sorted(block[o : o + 100] for o in range(0, 1000, 100))
    assert store_gets(world) == before
    assert n3.metrics.peer_requests == {"fill_ok": 1}
    assert n3.cache.read(world.block_key("n3", key, index)) == block
    assert n3.reader.last_read_at[DATASET] > 0

    # A block the fill source lacks: its 404 is no error; the store is read, here only.
    key, index = absent
    data = await n3.reader.read(n3.source, n3.version(key), index * BLOCK, BLOCK)
    assert data == world.block(key, index)
    assert store_gets(world) == {**before, "n3": before["n3"] + 1}
    assert n3.metrics.peer_requests == {"fill_ok": 1, "fill_refused": 1}
    assert n3.cache.contains(world.block_key("n3", key, index))

    # Once the fill is over (no fill in the view), the fill source is not asked any more.
    world.apply(world.view(CLONE))
    key, index = sorted(held - precached)[4]
    assert (
        await n3.reader.read(n3.source, n3.version(key), index * BLOCK, 10)
        == world.block(key, index)[:10]
    )
    assert n3.metrics.peer_requests == {"fill_ok": 1, "fill_refused": 1}
    assert n3.store.gets == before["n3"] + 2


# --- the background filler --------------------------------------------------------------------


async def test_filler_copies_what_the_sources_hold_and_nothing_else(world):
    held, precached = seed_copy_a(world)
    world.apply(world.view(CLONE, CLONE_FILL))
    n3 = world.nodes["n3"]
    filler = Filler(n3, n3.cache, n3.peers, n3.membership, n3.metrics, concurrency=8)
    copied = held - precached
    absent = set(world.blocks()) - held - precached
    assert copied and absent and precached & held

    async with trio.open_nursery() as nursery:
        await nursery.start(filler.run)
        assert filler.reports() == {}
        filler.assign(n3.membership.fill_assignments())
        report = await wait_done(filler)

        assert report == {
            "copy": "B",
            "id": "B-1",
            "done": True,
            "copied_blocks": len(copied),
            "copied_bytes": sum(len(world.block(*b)) for b in copied),
            "absent_blocks": len(absent),
            "failed_blocks": 0,
            "failed_shards": {},
        }
        for key, index in sorted(copied | precached):
            cached = n3.cache.read(world.block_key("n3", key, index))
            assert cached == world.block(key, index), (key, index)
        for key, index in absent:
            assert not n3.cache.contains(world.block_key("n3", key, index))
        assert store_gets(world) == {"n1": 0, "n2": 0, "n3": 0}  # no store read anywhere
        assert n3.metrics.fill_blocks == {
            "copied": len(copied),
            "absent": len(absent),
            "failed": 0,
        }
        assert n3.metrics.fill_bytes == report["copied_bytes"]
        # The source nodes were not "read": a fill keeps no copy looking busy.
        assert all(DATASET not in world.nodes[n].reader.last_read_at for n in ("n1", "n2"))
        # Before "done", the files of the shards it filled were prepared for native reads.
        # n3 alone is copy B: it owns every shard, so every file (the empty ones too).
        assert [(dataset, sorted(keys)) for dataset, keys in n3.prepared] == [
            (DATASET, sorted(world.files))
        ]

        # Gone from the view: forgotten. Listed again: it runs again, and "done" means that it
        # walked its shards again (nothing left to copy: every block is cached here now).
        filler.assign({})
        assert filler.reports() == {}
        filler.assign(n3.membership.fill_assignments())
        assert not filler.reports()[DATASET]["done"]
        again = await wait_done(filler)
        assert again == {**report, "copied_blocks": 0, "copied_bytes": 0}
        assert n3.cache.counters().admitted == len(copied | precached)
        # A new fill id is a new fill: everything the sources hold is cached here already.
        world.apply(world.view(CLONE, {"B": {"id": "B-2", "from": ["n1", "n2"]}}))
        filler.assign(n3.membership.fill_assignments())
        second = await wait_done(filler)
        assert (second["id"], second["copied_blocks"], second["absent_blocks"]) == (
            "B-2",
            0,
            len(absent),
        )
        nursery.cancel_scope.cancel()


async def test_fills_are_keyed_by_dataset_copy_and_id(world):
    """Two datasets each have a fill "B-1" (ids are numbered per dataset). Both run and each
    copies its own blocks: one finishing first never marks the other done. "other" is not
    served on n3 yet: its fill waits (reporting not done) until it is, then runs."""
    held, precached = seed_copy_a(world, DATASET)
    held_other, precached_other = seed_copy_a(world, OTHER)
    n3 = world.nodes["n3"]
    n3.served.discard(OTHER)
    world.apply(world.view(CLONE, CLONE_FILL, datasets=(DATASET, OTHER)))
    filler = Filler(n3, n3.cache, n3.peers, n3.membership, n3.metrics, concurrency=8)
    async with trio.open_nursery() as nursery:
        await nursery.start(filler.run)
        filler.assign(n3.membership.fill_assignments())
        first = await wait_done(filler, DATASET)
        assert (first["copy"], first["id"], first["copied_blocks"]) == (
            "B",
            "B-1",
            len(held - precached),
        )
        waiting = filler.reports()[OTHER]
        assert (waiting["id"], waiting["done"], waiting["copied_blocks"]) == ("B-1", False, 0)
        for key, index in held_other - precached_other:
            assert not n3.cache.contains(world.block_key("n3", key, index, OTHER))

        n3.served.add(OTHER)  # the worker opened it: the agent says so
        filler.datasets_changed()
        second = await wait_done(filler, OTHER)
        assert second["copied_blocks"] == len(held_other - precached_other)
        for key, index in held_other | precached_other:
            cached = n3.cache.read(world.block_key("n3", key, index, OTHER))
            assert cached == world.block(key, index), (key, index)
        assert filler.reports()[DATASET] == first  # untouched by the other's fill

        # The same id for another copy is another fill: the old one is cancelled, the new one
        # runs (a node that moved from one copy to another).
        moved = world.view({"A": ["n1", "n2"], "C": ["n3"]}, {"C": {**CLONE_FILL["B"]}})
        world.apply(moved)
        filler.assign(n3.membership.fill_assignments())
        assert set(filler.reports()) == {DATASET}
        third = await wait_done(filler, DATASET)
        assert (third["copy"], third["id"], third["copied_blocks"]) == ("C", "B-1", 0)
        nursery.cancel_scope.cancel()


async def test_blocks_that_failed_to_copy_are_tried_again(world):
    """The source answers 500 to the first request for each block: the next pass over those
    shards copies them, and the fill reports no failure in the end."""
    held, precached = seed_copy_a(world)
    n1, n2, n3 = world.nodes["n1"], world.nodes["n2"], world.nodes["n3"]
    refused: set[tuple[str, str, int]] = set()

    async def flaky(req: BlockRequest) -> tuple[bytes, bytes]:
        if (req.dataset, req.key, req.index) not in refused:
            refused.add((req.dataset, req.key, req.index))
            raise RuntimeError("injected: the source failed this once")  # a 500
        return await node_of[req.key].fs.serve_peer_block(req)

    table = owner_table(DATASET, ["n1", "n2"])
    node_of = {key: world.nodes[table[shard_of(key)]] for key in world.files}
    async with served_peer(flaky, "127.0.0.6", token=TOKEN) as flaky_address:
        n1.address = n2.address = flaky_address
        world.apply(world.view(CLONE, CLONE_FILL))
        filler = Filler(n3, n3.cache, n3.peers, n3.membership, n3.metrics, concurrency=8)
        async with trio.open_nursery() as nursery:
            await nursery.start(filler.run)
            filler.assign(n3.membership.fill_assignments())
            report = await wait_done(filler)
            nursery.cancel_scope.cancel()
    copied, absent = held - precached, set(world.blocks()) - held - precached
    assert (report["copied_blocks"], report["failed_blocks"]) == (len(copied), 0)
    assert report["absent_blocks"] == len(absent)  # counted once, though asked for twice
    assert n3.metrics.fill_blocks["failed"] >= len(copied)  # every one failed once
    for key, index in copied:
        assert n3.cache.read(world.block_key("n3", key, index)) == world.block(key, index)


async def test_blocks_that_never_copy_are_reported_per_shard(world, monkeypatch):
    """The source always answers 500 for one file: after the last pass its blocks are failed,
    counted under the file's shard (the coordinator keeps such a shard on the node that handed
    it off, coordinator/copies.py split_handed_off)."""
    monkeypatch.setattr(fill_module, "FAILED_SHARD_RETRY_S", (0.01,))
    held, precached = seed_copy_a(world)
    n1, n2, n3 = world.nodes["n1"], world.nodes["n2"], world.nodes["n3"]
    copied = held - precached
    broken = min(key for key, _index in copied)
    table = owner_table(DATASET, ["n1", "n2"])
    node_of = {key: world.nodes[table[shard_of(key)]] for key in world.files}

    async def broken_file(req: BlockRequest) -> tuple[bytes, bytes]:
        if req.key == broken:
            raise RuntimeError("injected: the source fails this file")  # a 500
        return await node_of[req.key].fs.serve_peer_block(req)

    async with served_peer(broken_file, "127.0.0.6", token=TOKEN) as address:
        n1.address = n2.address = address
        world.apply(world.view(CLONE, CLONE_FILL))
        filler = Filler(n3, n3.cache, n3.peers, n3.membership, n3.metrics, concurrency=8)
        async with trio.open_nursery() as nursery:
            await nursery.start(filler.run)
            filler.assign(n3.membership.fill_assignments())
            report = await wait_done(filler)
            nursery.cancel_scope.cancel()
    failed = sum(1 for key, _index in copied if key == broken)
    assert failed and report["failed_blocks"] == failed
    assert report["failed_shards"] == {str(shard_of(broken)): failed}
    assert report["copied_blocks"] == len(copied) - failed


async def test_a_fill_removed_from_the_view_is_cancelled(world):
    seed_copy_a(world)
    n1, n3 = world.nodes["n1"], world.nodes["n3"]
    gate = trio.Event()
    arrived = 0

    async def gated(req: BlockRequest) -> bytes:
        nonlocal arrived
        arrived += 1
        await gate.wait()
        return await n1.fs.serve_peer_block(req)

    async with served_peer(gated, "127.0.0.5", token=TOKEN) as slow_address:
        n1.address = slow_address  # the fill's requests to n1 now wait at the gate
        world.apply(world.view(CLONE, CLONE_FILL))
        filler = Filler(n3, n3.cache, n3.peers, n3.membership, n3.metrics, concurrency=4)
        async with trio.open_nursery() as nursery:
            await nursery.start(filler.run)
            filler.assign(n3.membership.fill_assignments())
            with trio.fail_after(10):
                while arrived < 4:  # every slot waits on n1
                    await trio.sleep(0.01)
            assert not filler.reports()[DATASET]["done"]
            counted = dict(n3.metrics.fill_blocks)
            admitted = n3.cache.counters().admitted
            # The view drops the fill. (The membership still names its sources here, so only
            # the cancellation can stop the copying.)
            filler.assign({})
            assert filler.reports() == {}
            gate.set()
            await trio.sleep(0.5)
            # The requests in flight were abandoned, and no more were sent.
            assert arrived == 4
            assert n3.metrics.fill_blocks == counted
            assert n3.cache.counters().admitted == admitted
            nursery.cancel_scope.cancel()
