"""NativePeerReads, the Python side of peer READs sent from C: which files get a route, the
connection it opens (the real block protocol handshake, against a real PeerServer) and hands
over, and what it does with what the C side reports.

The C side is replaced by ScriptedTable, below the PeerReadTable seam: sending a READ needs a
FUSE request, so the real side (cachefs_fast_read.c, "peer reads") is tested through real
mounts in tests/e2e/cluster/test_distributed.py (byte-exact reads answered in C) and
tests/e2e/cluster/test_native_peer_reads.py (owners that misbehave, stop or hang up)."""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import trio
import trio.testing

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.fs import native_peer_reads as native_peer_reads_module
from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.native_peer_reads import NativePeerReads
from cachefs.metrics import WorkerMetrics
from cachefs.peer import wire
from cachefs.peer.client import open_peer_client
from tests.e2e.peer.test_peer import TOKEN, FakeOwner, served
from tests.waiting import wait_until

BLOCK = 64 << 10
LARGEST_READ = 128 << 10


class ScriptedTable:
    """Records what NativePeerReads hands the C side; ``peer_receive`` answers from
    ``script`` (then "fine, nothing pending")."""

    def __init__(self) -> None:
        self.opened: list[int] = []
        self.routes: list[tuple[int, int, bytes, int]] = []
        self.closed: list[tuple[int, bool]] = []
        self.script: list[tuple[int, list, int, float]] = []
        self.handed_back_on_close: list = []

    def peer_open(self, sock_fd: int, max_length: int) -> int:
        assert max_length == LARGEST_READ
        self.opened.append(sock_fd)
        return len(self.opened) - 1

    def peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool:
        self.routes.append((ino, slot, frame, length))
        return True

    def peer_receive(self, slot: int):
        return self.script.pop(0) if self.script else (0, [], 0, 0.0)

    def peer_close(self, slot: int, fail: bool):
        self.closed.append((slot, fail))
        handed, self.handed_back_on_close = self.handed_back_on_close, []
        return handed


class OwnerIs:
    def __init__(self, address: str | None):
        self.address = address

    def owner_address(self, dataset: str, shard: int) -> str | None:
        return self.address

    def fill_address(self, dataset: str, shard: int) -> str | None:
        return None


@pytest.fixture
def cache(tmp_path):
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 1 << 20)]
    )
    yield cache
    cache.close()


def source() -> DataSource:
    return DataSource("ds", None, 1, BLOCK)  # type: ignore[arg-type]  # never read here


def version(size: int, key: str = "dir/file.jpg") -> FileVersion:
    return FileVersion(key, '"etag"', size)


@contextlib.asynccontextmanager
async def native_peer_reads(cache, table, sharing=None):
    """A real owner (the block protocol's FakeOwner) that owns every file, a real peer client,
    and NativePeerReads over ``table``: ``(address, peers, native)``, not yet running."""
    async with served(FakeOwner().serve_block) as address, open_peer_client(TOKEN) as peers:
        reader = BlockReader(cache, WorkerMetrics(), peers=peers, route=OwnerIs(address))
        native = NativePeerReads(
            table, reader, peers, timeout_s=2.0, largest_read=lambda: LARGEST_READ,
            sharing=sharing,
        )  # fmt: skip
        yield address, peers, native


async def test_small_files_of_another_owner_get_a_route_on_one_handshaken_connection(cache):
    table = ScriptedTable()
    async with (
        native_peer_reads(cache, table) as (_address, _peers, native),
        trio.open_nursery() as nursery,
    ):
        await nursery.start(native.run)
        native.route(10, source(), version(1000))  # asked before the connection is up
        native.route(11, source(), version(BLOCK))
        native.route(12, source(), version(0))  # nothing to read
        native.route(13, source(), version(BLOCK + 1))  # two blocks
        await wait_until(lambda: native.connections == 1)
        native.route(14, source(), version(5, key="k\udcff"))  # once it is up
        assert len(table.opened) == 1  # one connection for all of them
        assert [(r[0], r[3]) for r in table.routes] == [(10, 1000), (11, BLOCK), (14, 5)]
        for _, slot, frame, length in table.routes:
            head = frame[: wire.REQUEST.size]
            _, request = wire.decode_request(head, frame[wire.REQUEST.size :])
            assert (slot, request.index, request.length, length) == (0, 0, length, length)
            assert not request.cached_only
        assert request.key == "k\udcff"  # any key round-trips byte for byte
        nursery.cancel_scope.cancel()
    assert table.closed == [(0, True)]  # stopping: pending READs answered EIO, not run


@pytest.mark.parametrize("case", ["this-node", "cooling", "before-init"])
async def test_no_route_to_this_node_a_cooling_peer_or_before_init(cache, case):
    table = ScriptedTable()
    owner = None if case == "this-node" else "127.0.0.1:9"
    largest = 0 if case == "before-init" else LARGEST_READ
    async with open_peer_client(TOKEN) as peers:
        reader = BlockReader(cache, WorkerMetrics(), peers=peers, route=OwnerIs(owner))
        native = NativePeerReads(table, reader, peers, timeout_s=2.0, largest_read=lambda: largest)
        if case == "cooling":
            peers.mark_down("127.0.0.1:9")
        async with trio.open_nursery() as nursery:
            await nursery.start(native.run)
            native.route(1, source(), version(10))
            await trio.testing.wait_all_tasks_blocked()
            assert native.connections == 0
            nursery.cancel_scope.cancel()
    assert table.opened == [] and table.routes == []


@pytest.mark.parametrize(
    ("report", "cooled_down"),
    [
        ((6, "handed", 0, 0.0), True),  # a wrong checksum: every pending READ back
        ((5, "handed", 0, 0.0), True),  # garbage
        ((2, "handed", 0, 0.0), True),  # the owner hung up with READs pending
        ((2, "none", 0, 0.0), False),  # ... with nothing pending: an idle close
        ((0, "none", 3, 2.5), True),  # no answer within the timeout
    ],
    ids=["bad-answer", "garbage", "ended-pending", "ended-idle", "timeout"],
)
async def test_what_c_reports_closes_the_connection_and_cools_the_owner(cache, report, cooled_down):
    table = ScriptedTable()
    served_in_python = []

    async def handler() -> None:  # what a READ handed back runs (fuse_read_async)
        served_in_python.append(1)

    async with native_peer_reads(cache, table) as (address, peers, native):
        fault, handed, pending, age = report
        if fault:
            table.script = [(0, [], 0, 0.0), (fault, [handler()] if handed == "handed" else [],
                                              0, 0.0)]  # fmt: skip
        else:  # still pending past the timeout: C hands them back when closed
            table.script = [(0, [], pending, age)]
            table.handed_back_on_close = [handler()]
        async with trio.open_nursery() as nursery:
            await nursery.start(native.run)
            native.route(7, source(), version(100))
            await wait_until(lambda: table.opened and not native.connections)
            await wait_until(lambda: served_in_python or report[1] == "none")
            assert peers.is_cooling(address) == cooled_down
            nursery.cancel_scope.cancel()
    assert table.closed == [(0, False)]  # closed while serving: its READs went to Python
    assert served_in_python == ([] if report[1] == "none" and fault else [1])


class RecordingSharing:
    """The serving processes (ConnectionSharing; the real one, ReplicatedTable, is tested in
    tests/unit/fs/test_serving.py and with real serving processes in
    tests/e2e/cluster/test_native_peer_reads.py): ``wanted`` connections per link, each
    handed over recorded with the routes the worker had registered by then."""

    def __init__(self, table: ScriptedTable, wanted: int) -> None:
        self._table = table
        self.wanted = wanted
        self.shared: list[tuple[int, str, int, int]] = []  # (link, address, routes then, peer)
        self.fault_handler = None

    def link_of(self, slot: int) -> int:
        return 100 + slot

    def connections_wanted(self, link: int) -> bool:
        return self.wanted > 0

    def share_connection(self, link: int, address: str, sock_fd: int, timeout_s: float) -> bool:
        with socket.socket(fileno=os.dup(sock_fd)) as conn:
            peer = conn.getpeername()[1]  # a live connection
        self.shared.append((link, address, len(self._table.routes), peer))
        self.wanted -= 1
        return True

    def handle_link_faults(self, callback) -> None:
        self.fault_handler = callback


async def test_serving_processes_get_connections_of_their_own_before_the_routes(cache):
    table = ScriptedTable()
    sharing = RecordingSharing(table, wanted=2)
    async with (
        native_peer_reads(cache, table, sharing) as (address, peers, native),
        trio.open_nursery() as nursery,
    ):
        await nursery.start(native.run)
        native.route(10, source(), version(1000))
        await wait_until(lambda: native.connections == 1)
        # Two more handshaken connections, each handed over before any route was made.
        assert [(link, at, routes) for link, at, routes, _ in sharing.shared] == [
            (100, address, 0), (100, address, 0)]  # fmt: skip
        assert sharing.shared[0][3] == int(address.rpartition(":")[2])
        assert [r[0] for r in table.routes] == [10]
        sharing.wanted = 1  # a serving process started later: served at the next wake-up
        await wait_until(lambda: len(sharing.shared) == 3)
        assert not peers.is_cooling(address)
        sharing.fault_handler(address, 6)  # one's connection failed: the owner cools down
        assert peers.is_cooling(address)
        await wait_until(lambda: not native.connections)  # and this one closes too
        nursery.cancel_scope.cancel()
    assert table.closed == [(0, False)]


async def test_routes_waiting_for_their_connection_go_with_a_forget_of_their_inodes(cache):
    """A refresh or removal while the owner's connection is being opened: the routes asked
    for before it name versions no longer served, and are not registered once it is up."""
    table = ScriptedTable()
    async with (
        native_peer_reads(cache, table) as (_address, _peers, native),
        trio.open_nursery() as nursery,
    ):
        await nursery.start(native.run)
        for ino in (10, 11, 12):
            native.route(ino, source(), version(1000))
        native.forget_inodes(11, 12)  # before the connection is up: no checkpoint since
        await wait_until(lambda: native.connections == 1)
        assert [route[0] for route in table.routes] == [10]
        nursery.cancel_scope.cancel()


class NoFreeSlotTable(ScriptedTable):
    """The binding with every connection slot taken (more owners than PEER_CONNS)."""

    def peer_open(self, sock_fd: int, max_length: int) -> int:
        super().peer_open(sock_fd, max_length)
        return -1


async def test_an_owner_that_found_no_free_slot_is_not_tried_again_at_every_route(
    cache, mock_clock
):
    """Without a slot, every route of that owner's files (each LOOKUP, each listing) opened,
    handshook and closed a connection of its own. Now its files stay on the Python path for
    NO_SLOT_RETRY_S, then a slot is tried again."""
    mock_clock.rate = 1  # real time, plus the jump below
    table = NoFreeSlotTable()
    async with (
        native_peer_reads(cache, table) as (address, _peers, native),
        trio.open_nursery() as nursery,
    ):
        await nursery.start(native.run)
        native.route(10, source(), version(1000))
        await wait_until(lambda: len(table.opened) == 1)  # opened, no slot, closed
        native.route(11, source(), version(1000))
        native.route(12, source(), version(1000))
        assert address not in native._owners  # no connection being opened for them
        mock_clock.jump(native_peer_reads_module.NO_SLOT_RETRY_S)
        native.route(13, source(), version(1000))
        await wait_until(lambda: len(table.opened) == 2)  # tried again
        assert table.routes == []
        nursery.cancel_scope.cancel()
