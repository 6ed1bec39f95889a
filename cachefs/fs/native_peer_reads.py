"""Peer reads sent from C: READs of small files whose block another worker owns.

In a cluster most of a node's reads are of other nodes' blocks (a copy on 4 nodes: 3 of 4).
Served in Python, each costs the reader's worker a Python READ, a trio task and a request on
the peer client, ~0.45 ms of CPU: the reader's CPU, not the wire, was the limit. So for the
files a training job reads most, small ones whose one block another worker owns, the patched
binding (third_party/pyfuse3, "peer reads" in ``cachefs_fast_read.c``) sends the READ to the
owner itself, on a connection of its own that this module opens and hands over, and replies
to it from the owner's answer once that passes the checks the Python client makes (status,
length, chunk size, the xxh3 of every chunk). No byte is kept here (passive caching off, as in
cachefs/fs/blocks.py); the kernel's page cache keeps them.

What this module does around that:

* **Routes**: a file gets one (its inode → the owner's connection and the request frame of its
  block) when the FileSystem hands its inode to :meth:`NativePeerReads.route`: at a LOOKUP, when
  its directory's listing is packed for the native table (a job lists, then reads: with dentries
  cached, its first READ is the first request the worker sees of it), at a preload's
  ``prepare_reads`` and after a READ of it that Python served. Only files of one block no larger
  than the largest READ (a larger file would be fetched whole for each of its READs), only for
  an owner that is not cooling down. Routes go with their inodes (a refresh, ``dataset rm``:
  :meth:`NativePeerReads.forget_inodes` for those still waiting for a connection) and with
  their connection.
* **Connections**: one per owner, opened on the first route to it (the routes asked for before
  it is up are registered once it is) with the block protocol's handshake
  (:meth:`PeerClient.open_stream`), so the version check and the bearer token are the Python
  client's.
* **Answers and failures**: a task per connection waits for its socket and has the answers
  handled in C (:func:`pyfuse3.fast_peer_receive`). Whatever C hands back, a refusal or the
  READs pending on a connection that failed, runs as the READ's Python handler would have run
  (the Python client, then the store): a peer problem never becomes a read error. A fault (a
  wrong length or checksum, garbage, the connection ended with READs pending) closes the
  connection and cools the peer down, as the Python client does (an idle connection the owner
  closed is only forgotten); so does an answer not back within the peer timeout
  (a SIGSTOPped owner costs that once); a peer the Python client cooled down has its
  connection closed at the next wake-up (at most a quarter of the timeout later).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import trio

from cachefs.fs.blocks import BlockReader, DataSource, FileVersion
from cachefs.fs.peer_answers import run_handed_back, wait_for_answers
from cachefs.fs.serving_wire import PEER_TIMED_OUT
from cachefs.peer import wire
from cachefs.peer.base import BlockRequest, PeerError
from cachefs.peer.client import PeerClient

log = logging.getLogger(__name__)

#: Routes asked for while their owner's connection is being opened, registered once it is up;
#: past this many (all owners together), the rest go to Python as if they had none.
WAITING_ROUTES_MAX = 1 << 18
#: After the binding had no free connection slot for an owner (it holds 1,024,
#: ``pyfuse3.fast_peer_slots()``: more owners than that), its files are read in Python for this
#: long before a slot is tried again, so that each of their routes does not open, handshake and
#: close a connection of its own.
NO_SLOT_RETRY_S = 10.0
#: Why the C side closed a connection (cachefs_fast_read.h, CFR_PEER_*).
ENDED = 2
FAULTS = {
    1: "closed",
    2: "the owner closed the connection",
    3: "receiving failed",
    4: "sending failed",
    5: "garbage on the connection",
    6: "an answer with a wrong length or checksum",
}


class PeerReadTable(Protocol):
    """The binding's peer-read functions (the pyfuse3 patch's ``fast_peer_*``)."""

    def peer_open(self, sock_fd: int, max_length: int) -> int: ...

    def peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool: ...

    def peer_receive(
        self, slot: int
    ) -> tuple[int, list[Coroutine[Any, Any, None]], int, float]: ...

    def peer_close(self, slot: int, fail: bool) -> list[Coroutine[Any, Any, None]]: ...


class ConnectionSharing(Protocol):
    """The serving processes of the mount (cachefs/fs/serving.py's ReplicatedTable): each
    sends its READs of an owner's files on a connection of its own, which this side opens and
    hands over."""

    def link_of(self, slot: int) -> int: ...

    def connections_wanted(self, link: int) -> bool: ...

    def share_connection(self, link: int, address: str, sock_fd: int, timeout_s: float) -> bool: ...

    def handle_link_faults(self, callback: Callable[[str, int], None]) -> None: ...


class _Owner:
    """The connection to one owner: opening (``slot`` -1, routes waiting) or handed to C."""

    __slots__ = ("address", "link", "sharing", "slot", "waiting")

    def __init__(self, address: str):
        self.address = address
        self.slot = -1
        self.link = 0  # the slot's id for the serving processes (ConnectionSharing.link_of)
        self.waiting: list[tuple[int, bytes, int]] = []  # (ino, frame, length)
        self.sharing = False  # connections for the serving processes being opened


class NativePeerReads:
    """Routes READs of other workers' small files to them from C, and serves what comes back.

    ``largest_read``: called for the largest file a route may have (the largest READ, known once
    INIT is answered; 0 before: no routes yet), until it is known. ``sharing``: the serving
    processes, if the mount has any (``--fuse-processes``), each given a connection of its own
    to every owner before that owner's routes are registered (so that they reach it too), or
    within a quarter of the timeout for a serving process that started later. Start
    :meth:`run` before the first route.
    """

    def __init__(
        self,
        table: PeerReadTable,
        reader: BlockReader,
        peers: PeerClient,
        *,
        timeout_s: float,
        largest_read: Callable[[], int],
        sharing: ConnectionSharing | None = None,
    ) -> None:
        assert reader.route is not None  # a reader with a peer client has its route
        self._table = table
        self._reader = reader
        self._route = reader.route
        self._peers = peers
        self._timeout_s = timeout_s
        self._largest_read = largest_read
        self._max_length = 0  # the largest READ once INIT has set it (it stays as set)
        self._owners: dict[str, _Owner] = {}
        self._no_slot_until: dict[str, float] = {}  # owner -> when a slot is tried again
        self._waiting_routes = 0
        self._nursery: trio.Nursery | None = None
        self._sharing = sharing
        if sharing is not None:
            sharing.handle_link_faults(self._shared_connection_failed)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connections (and the READs handed back) until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def route(self, ino: int, source: DataSource, version: FileVersion) -> None:
        """Send the READs of inode ``ino`` (this version of the file) to its owner from C, if
        another worker owns its one block and it is small enough (see the module docstring)."""
        if not self._max_length:  # asking the binding costs its whole stats: only until known
            self._max_length = self._largest_read()
        if not 0 < version.size <= min(source.block_size, self._max_length):
            return
        key = self._reader.block_key(source, version, 0)
        address = self._route.owner_address(source.dataset, key.shard)
        if address is None or self._nursery is None or self._peers.is_cooling(address):
            return
        if address in self._no_slot_until:
            if trio.current_time() < self._no_slot_until[address]:
                return
            del self._no_slot_until[address]
        request = BlockRequest(
            source.dataset, version.key, version.etag, version.size, 0, source.block_size
        )
        try:
            frame = wire.encode_request(0, request)
        except ValueError:  # a name too long for a frame: the Python path says so
            return
        owner = self._owners.get(address)
        if owner is None:
            owner = self._owners[address] = _Owner(address)
            self._nursery.start_soon(self._serve, owner)
        if owner.slot >= 0:
            self._table.peer_route(ino, owner.slot, frame, version.size)
        elif self._waiting_routes < WAITING_ROUTES_MAX:
            owner.waiting.append((ino, frame, version.size))
            self._waiting_routes += 1

    def forget_inodes(self, lo: int, hi: int) -> None:
        """Drop the routes of inodes in [lo, hi] still waiting for their owner's connection (a
        refresh or a removal: they name versions the new snapshot does not serve; those
        registered already go with the table's own forget_inodes)."""
        for owner in self._owners.values():
            kept = [route for route in owner.waiting if not lo <= route[0] <= hi]
            self._waiting_routes -= len(owner.waiting) - len(kept)
            owner.waiting = kept

    @property
    def connections(self) -> int:
        """Connections handed to C now."""
        return sum(1 for owner in self._owners.values() if owner.slot >= 0)

    async def _serve(self, owner: _Owner) -> None:
        """Open the owner's connection, hand it to C, and serve it until it fails."""
        try:
            stream = await self._peers.open_stream(owner.address)
        except PeerError as exc:
            log.info("native peer reads: %s; its files are read in Python", exc)
            self._forget(owner)
            return
        sock = stream.socket
        slot = -1
        try:
            slot = self._table.peer_open(sock.fileno(), self._max_length)
            if slot < 0:
                level = logging.DEBUG if self._no_slot_until else logging.WARNING
                why = "no free connection slot for %s; its files are read in Python for %.0f s"
                log.log(level, "native peer reads: " + why, owner.address, NO_SLOT_RETRY_S)
                self._no_slot_until[owner.address] = trio.current_time() + NO_SLOT_RETRY_S
                return
            if self._sharing is not None:  # theirs first: the routes below reach them too
                owner.link = self._sharing.link_of(slot)
                await self._share(owner, owner.link)
                if self._peers.is_cooling(owner.address):  # a share failed: none registered
                    return
            owner.slot = slot
            for ino, frame, length in self._take_waiting(owner):
                self._table.peer_route(ino, owner.slot, frame, length)
            await self._receive(owner, sock)
        finally:
            try:
                self._close(owner, slot)
            finally:  # (a serving process that would not die raises: the socket still goes)
                sock.close()

    async def _share(self, owner: _Owner, link: int) -> None:
        """Open a connection to the owner for each serving process that has none for ``link``
        and hand it over (a failure cools the owner down: the next wake-up closes them all).
        Links are never reused: once the connection is closed, none is wanted for it."""
        assert self._sharing is not None
        owner.sharing = True
        try:
            while self._sharing.connections_wanted(link):
                try:
                    stream = await self._peers.open_stream(owner.address)
                except PeerError as exc:
                    log.info("native peer reads: %s; serving processes read its files in "
                             "Python", exc)  # fmt: skip
                    return
                try:
                    self._sharing.share_connection(
                        link, owner.address, stream.socket.fileno(), self._timeout_s
                    )
                finally:
                    stream.socket.close()  # the serving process holds its duplicate
        finally:
            owner.sharing = False

    def _shared_connection_failed(self, address: str, fault: int) -> None:
        """A serving process closed its connection to ``address`` because it failed
        (serving_wire's ``peer_closed``): the owner is cooled down, as for one here."""
        if fault == PEER_TIMED_OUT:
            reason = f"no answer within {self._timeout_s} s"
        else:
            reason = FAULTS.get(fault, f"fault {fault}")
        log.info("a serving process's peer reads from %s stopped: %s", address, reason)
        self._peers.mark_down(address, reason=reason)

    async def _receive(self, owner: _Owner, sock: trio.socket.SocketType) -> None:
        """Have C handle the owner's answers as they come, until the connection is done."""
        while True:
            fault, handed_back, pending, oldest_age_s = self._table.peer_receive(owner.slot)
            run_handed_back(self._nursery, handed_back)
            if fault:
                reason = FAULTS.get(fault, f"fault {fault}")
                if fault == ENDED and not handed_back:  # an idle connection closed: no failure
                    log.debug("native peer reads from %s stopped: %s", owner.address, reason)
                    return
                log.info("native peer reads from %s stopped: %s", owner.address, reason)
                self._peers.mark_down(owner.address, reason=reason)
                return
            if self._peers.is_cooling(owner.address):  # the Python client saw it fail
                return
            sharing = self._sharing
            if sharing is not None and not owner.sharing and sharing.connections_wanted(owner.link):
                assert self._nursery is not None
                owner.sharing = True  # (a serving process started since, or given up one)
                self._nursery.start_soon(self._share, owner, owner.link)
            if not await wait_for_answers(sock.fileno(), pending, oldest_age_s, self._timeout_s):
                reason = f"no answer within {self._timeout_s} s"
                log.info("native peer reads from %s stopped: %s", owner.address, reason)
                self._peers.mark_down(owner.address, reason=reason)
                return

    def _close(self, owner: _Owner, slot: int) -> None:
        """Take the connection from C: its pending READs to Python (or, shutting down, EIO)."""
        if slot >= 0:
            # Cancelled (the worker stopping): a READ handed back could not be served.
            stopping = self._nursery is None or trio.current_effective_deadline() == -math.inf
            run_handed_back(self._nursery, self._table.peer_close(slot, stopping))
        self._forget(owner)

    def _take_waiting(self, owner: _Owner) -> list[tuple[int, bytes, int]]:
        """The routes asked for while the owner's connection was being opened (no longer
        counted as waiting)."""
        waiting, owner.waiting = owner.waiting, []
        self._waiting_routes -= len(waiting)
        return waiting

    def _forget(self, owner: _Owner) -> None:
        self._take_waiting(owner)
        owner.slot = -1
        if self._owners.get(owner.address) is owner:
            del self._owners[owner.address]
