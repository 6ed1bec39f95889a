"""PeerLinks (cachefs/fs/serving_process.py): a serving process's connections to owners, opened
and routed from its table thread, read and closed by a task on its loop. The binding is
replaced by FakeBinding below the ``_patched`` seam (sending a READ needs a FUSE request); the
real one is tested with real serving processes and misbehaving owners in
tests/e2e/cluster/test_native_peer_reads.py. What matters here is the bookkeeping around the
binding reusing a closed slot for the next connection, which no end-to-end run can time."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from cachefs.fs import serving_process
from cachefs.fs.serving_process import PeerLinks
from cachefs.fs.serving_wire import PEER_ENDED_IDLE, PEER_TIMED_OUT
from tests.waiting import wait_until

WRONG_CHECKSUM = 6  # CFR_PEER_BAD_ANSWER
ENDED = 2  # CFR_PEER_ENDED


class FakeBinding:
    """The binding's peer slots: the lowest free slot for each connection; a slot listed in
    ``faults`` fails at its next receive (closed by "C", as cfr_peer_receive does)."""

    def __init__(self) -> None:
        self.open_slots: dict[int, int] = {}  # slot -> fd
        self.routes: list[tuple[int, int]] = []  # (ino, slot)
        self.closed: list[int] = []  # slots closed by fast_peer_close
        self.faults: dict[int, int] = {}  # slot -> the fault its next receive reports
        self.pending: dict[int, float] = {}  # slot -> age of its oldest pending READ
        self.on_receive = None  # a stand-in for the next receive, if set

    def fast_peer_open(self, sock_fd: int, max_length: int) -> int:
        slot = min(set(range(64)) - set(self.open_slots))
        self.open_slots[slot] = sock_fd
        return slot

    def fast_peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool:
        if slot not in self.open_slots:
            return False
        self.routes.append((ino, slot))
        return True

    def fast_peer_receive(self, slot: int):
        if self.on_receive is not None:
            on_receive, self.on_receive = self.on_receive, None
            return on_receive(slot)
        if slot not in self.open_slots:
            return 1, [], 0, 0.0  # CFR_PEER_CLOSED
        if slot in self.faults:
            del self.open_slots[slot]
            return self.faults.pop(slot), [], 0, 0.0
        age = self.pending.get(slot)
        return 0, [], (1 if age is not None else 0), (age or 0.0)

    def fast_peer_close(self, slot: int, fail: bool):
        self.closed.append(slot)
        self.open_slots.pop(slot, None)
        return []


class RecordingWorker:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def call(self, op: str, *args) -> None:
        self.calls.append((op, *args))


@pytest.fixture
def binding(monkeypatch):
    fake = FakeBinding()
    monkeypatch.setattr(serving_process, "_patched", fake)
    return fake


def connection() -> tuple[socket.socket, int]:
    """An owner's end and a descriptor of the other end (what the worker passes over)."""
    owner, ours = socket.socketpair()
    fd = os.dup(ours.fileno())
    ours.close()
    return owner, fd


async def test_a_slot_reused_after_a_fault_serves_only_the_link_that_took_it(binding):
    worker = RecordingWorker()
    links = PeerLinks(worker)  # type: ignore[arg-type]
    owner_a, fd_a = connection()
    owner_b, fd_b = connection()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(links.run)
            await trio.to_thread.run_sync(links.open, 1, 1 << 20, 2.0, fd_a)
            await trio.to_thread.run_sync(links.route, 10, 1, b"frame", 9)
            assert binding.routes == [(10, 0)]
            binding.faults[0] = WRONG_CHECKSUM
            owner_a.send(b"x")  # wakes link 1's task: its receive fails, C closes slot 0
            await wait_until(lambda: ("peer_closed", 1, WRONG_CHECKSUM) in worker.calls)
            # The next connection gets slot 0 again; link 1's routes never land on it, and
            # link 1's task closed nothing (C had).
            await trio.to_thread.run_sync(links.open, 2, 1 << 20, 2.0, fd_b)
            assert binding.open_slots == {0: fd_b}
            await trio.to_thread.run_sync(links.route, 11, 1, b"frame", 9)
            await trio.to_thread.run_sync(links.route, 12, 2, b"frame", 9)
            assert binding.routes == [(10, 0), (12, 0)]
            assert binding.closed == []
            # The worker closes link 2: its task closes slot 0, and reports nothing.
            await trio.to_thread.run_sync(links.close, 2)
            await wait_until(lambda: binding.closed == [0])
            assert [call for call in worker.calls if call[1] == 2] == []
            nursery.cancel_scope.cancel()
    finally:
        owner_a.close()
        owner_b.close()


@pytest.mark.parametrize(
    ("fault", "age", "reported"),
    [(ENDED, None, PEER_ENDED_IDLE), (None, 5.0, PEER_TIMED_OUT)],
    ids=["owner-closed-idle", "no-answer-in-time"],
)
async def test_a_link_closed_here_is_reported_with_why(binding, fault, age, reported):
    worker = RecordingWorker()
    links = PeerLinks(worker)  # type: ignore[arg-type]
    owner, fd = connection()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(links.run)
            if fault is not None:
                binding.faults[0] = fault
            if age is not None:
                binding.pending[0] = age  # an answer older than the 2 s timeout
            await trio.to_thread.run_sync(links.open, 7, 1 << 20, 2.0, fd)
            await wait_until(lambda: ("peer_closed", 7, reported) in worker.calls)
            # Closed by C (a fault) or here (the timeout), once.
            assert binding.closed == ([] if fault is not None else [0])
            assert binding.open_slots == {}
            nursery.cancel_scope.cancel()
    finally:
        owner.close()


async def test_reads_handed_back_as_the_worker_closes_the_link_are_still_served(binding):
    """The worker's close cancels the link's task. When that lands just as the task's receive
    hands READs back (the owner's connection failed: the worker saw it first and closed the
    link everywhere), those READs must still go to the worker. Before, the task's own
    cancellation read as the process ending, and they were dropped unanswered."""
    worker = RecordingWorker()
    links = PeerLinks(worker)  # type: ignore[arg-type]
    owner, fd = connection()
    served: list[int] = []

    async def read(ino: int) -> None:  # what a handed-back READ's handler does: forward
        served.append(ino)

    def failed_as_the_close_lands(slot: int):
        links._cancel(9)  # the worker's close, run on the loop just before this receive
        del binding.open_slots[slot]  # C closed the slot with the fault
        return ENDED, [read(1), read(2)], 0, 0.0

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(links.run)
            binding.on_receive = failed_as_the_close_lands
            await trio.to_thread.run_sync(links.open, 9, 1 << 20, 2.0, fd)
            await wait_until(lambda: sorted(served) == [1, 2])
            nursery.cancel_scope.cancel()
    finally:
        owner.close()
