"""Filling a copy from the nodes that held it: cached-only peer requests, the read path's fill
source, and the background :class:`Filler`.

Every node is made of the real parts a worker runs (minus FUSE): a TieredBlockCache, a
snapshot built from a local store, a BlockReader with a PeerClient and its Membership, and a
FileSystem whose ``serve_peer_block`` is served by hypercorn on its own 127.0.0.x address. Each
node's store is wrapped (below SEAM A) only to count GETs: a cached-only request must never
reach a store.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import BlockKey, shard_of
from cachefs.cluster.fill import Filler
from cachefs.cluster.membership import Membership
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.core import FileSystem, MountedDataset
from cachefs.meta import Snapshot, build_snapshot
from cachefs.metrics import WorkerMetrics
from cachefs.peer.base import BlockRequest, PeerRefused
from cachefs.peer.client import PeerClient
from cachefs.peer.server import create_peer_app
from cachefs.protocol import owner_table
from cachefs.store import StoreConfig, open_store
from tests.fakes.wrappers import CountingStore, served

BLOCK = 16 * 1024
TOKEN = "fill-token"
DATASET = "ds"
SOURCE_ID = 77


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

    def preload_source(self, dataset: str):
        if dataset != DATASET:
            return None
        return self.snapshot, None, SOURCE_ID, BLOCK

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

    def block_key(self, node: str, key: str, index: int) -> BlockKey:
        version = self.nodes[node].version(key)
        return BlockKey.make(SOURCE_ID, key, version.etag, index)

    def view(self, copies: dict[str, list[str]], fills: dict | None = None) -> dict:
        return {
            "cluster_id": "c0ffee",
            "heartbeat_interval_s": 1.0,
            "nodes": {n: {"address": node.address, "up": True} for n, node in self.nodes.items()},
            "datasets": [
                {
                    "spec": {"name": DATASET},
                    "refresh_epoch": 0,
                    "copies": copies,
                    "fills": fills or {},
                }
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
            peers = PeerClient(TOKEN)
            stack.push_async_callback(peers.aclose)
            metrics = WorkerMetrics()
            membership = Membership(name)
            reader = BlockReader(cache, metrics, peers=peers, route=membership)
            fs = FileSystem(reader)
            source = DataSource(DATASET, store, SOURCE_ID, BLOCK)
            fs.add_dataset(MountedDataset(DATASET, 1, snapshot, source))
            node = Node(
                name, cache, store, snapshot, source, reader, fs, membership, peers, metrics
            )
            app = create_peer_app(fs.serve_peer_block, TOKEN)
            node.address = await stack.enter_async_context(served(app, f"127.0.0.{i + 1}"))
            nodes[name] = node
        yield World(files, nodes)


def seed_copy_a(world: World) -> tuple[set, set]:
    """Copy A = (n1, n2) holds every block in its owner's cache except those of every fourth
    file; n3 already holds block 0 of every fourth file after those. Returns (blocks held by
    A, blocks held by n3)."""
    table = owner_table(DATASET, ["n1", "n2"])
    held, precached = set(), set()
    for key, index in world.blocks():
        file_no = sorted(world.files).index(key)
        data = world.block(key, index)
        if file_no % 4 != 0:
            owner = world.nodes[table[shard_of(key)]]
            assert owner.cache.put(world.block_key(owner.name, key, index), data)
            held.add((key, index))
        if file_no % 4 == 1 and index == 0:
            n3 = world.nodes["n3"]
            assert n3.cache.put(world.block_key("n3", key, index), data)
            precached.add((key, index))
    return held, precached


CLONE = {"A": ["n1", "n2"], "B": ["n3"]}
CLONE_FILL = {"B": {"id": "B-1", "from": ["n1", "n2"]}}


async def wait_done(filler: Filler) -> dict:
    with trio.fail_after(30):
        while not filler.reports().get(DATASET, {}).get("done"):
            await trio.sleep(0.02)
    return filler.reports()[DATASET]


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

        # Gone from the view: forgotten. Listed again: it ran once already in this process.
        filler.assign({})
        assert filler.reports() == {}
        filler.assign(n3.membership.fill_assignments())
        assert filler.reports()[DATASET] == {
            **report,
            "copied_blocks": 0,
            "copied_bytes": 0,
            "absent_blocks": 0,
        }
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

    async with served(create_peer_app(gated, TOKEN), "127.0.0.5") as slow_address:
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
