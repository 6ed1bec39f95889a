"""ReplicatedTable (cachefs/fs/serving.py): every change made to the worker's native table also
reaches each serving process, in order; forgets return only once applied everywhere; a replica
that does not answer is killed. The local table is a recording fake and each replica a thread on
a real socketpair speaking the real frames; the real serving process (its table applied by
pyfuse3 in C) is tested with real mounts in tests/e2e/fs/test_serving_processes.py."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from typing import Any

import pytest

from cachefs.fs import serving
from cachefs.fs.serving import ReplicatedTable
from cachefs.fs.serving_wire import PEER_ENDED_IDLE, frame, receive_frame
from tests.waiting import WAIT_S


class RecordingTable:
    """The worker's own table, as calls."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self._stats = stats
        self.refuse = False

    def _record(self, name: str, *args: Any) -> bool:
        self.calls.append((name, args))
        return not self.refuse

    def configure(self, *args: Any) -> None:
        self._record("configure", *args)

    def configure_listings(self, *args: Any) -> None:
        self._record("configure_listings", *args)

    def register(self, *args: Any) -> bool:
        return self._record("register", *args)

    def register_dentry(self, parent: int, name: bytes, entry: Any) -> bool:
        return self._record("register_dentry", parent, name, entry)

    def register_listing(self, *args: Any) -> bool:
        return self._record("register_listing", *args)

    def forget_file(self, *args: Any) -> None:
        self._record("forget_file", *args)

    def forget_inodes(self, *args: Any) -> None:
        self._record("forget_inodes", *args)

    def clear(self) -> None:
        self._record("clear")

    def register_peer_name(self, ino: int, identity: bytes) -> bool:
        return self._record("register_peer_name", ino, identity)

    def peer_open(self, sock_fd: int, max_length: int) -> int:
        self._record("peer_open", sock_fd, max_length)
        return 0  # the binding reuses a closed slot: always 0 here

    def peer_route(self, *args: Any) -> bool:
        return self._record("peer_route", *args)

    def peer_close(self, slot: int, fail: bool) -> list[str]:
        self._record("peer_close", slot, fail)
        return ["a READ handed back"]

    def stats(self) -> dict[str, int]:
        return dict(self._stats)


class Entry:
    """Stands for pyfuse3.EntryAttributes: only its state crosses to a replica."""

    def __getstate__(self) -> dict[str, int]:
        return {"st_ino": 42, "st_size": 7}


class Replica:
    """A serving process's table thread: applies (records) each change, answers those that
    want it; its stats are ``stats``."""

    def __init__(self, stats: dict[str, int]) -> None:
        self.worker_end, self._end = socket.socketpair()
        self.applied: list[tuple[str, tuple[Any, ...]]] = []
        self.fds: list[int] = []  # descriptors that came with the changes (SCM_RIGHTS)
        self._stats = stats
        self._thread = threading.Thread(target=self._apply, daemon=True)
        self._thread.start()
        # A real process for the pid (what a killed replica's kill reaches).
        self.process = subprocess.Popen(["sleep", "600"])
        self.pidfd = os.pidfd_open(self.process.pid)

    def _apply(self) -> None:
        try:
            while True:
                fds: list[int] = []
                function, args, wants_answer = receive_frame(self._end, fds)
                self.applied.append((function, args))
                self.fds.extend(fds)
                if wants_answer:
                    value = self._stats if function == "fast_read_stats" else None
                    self._end.sendall(frame((True, value)))
        except (EOFError, OSError):
            pass

    def close(self) -> None:
        self.worker_end.close()
        self._end.close()
        self._thread.join(WAIT_S)
        self.process.kill()
        self.process.wait(WAIT_S)
        os.close(self.pidfd)
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(stats: dict[str, int] | None = None) -> Replica:
        made.append(Replica(stats or {}))
        return made[-1]

    yield make
    for replica in made:
        replica.close()


def test_changes_reach_every_replica_in_the_worker_order_and_forgets_are_applied_first(replicas):
    local = RecordingTable({})
    table = ReplicatedTable(local)
    table.configure(1 << 16, 1000, 1000)
    first, second = replicas(), replicas()
    table.attach(first.worker_end, first.process.pid, first.pidfd)
    table.attach(second.worker_end, second.process.pid, second.pidfd)
    assert table.register(5, 0, 1 << 20, 10, 9, b"/ram/b", 10, b"c" * 8) is True
    assert table.register_dentry(3, b"name \xff", Entry()) is True
    assert table.register_listing(3, b"packed", 1) is True
    table.forget_file(9)  # answered: applied everywhere when it returns
    expected = [
        ("fast_read_configure", (1 << 16, 1000, 1000)),  # replayed on attach
        ("fast_read_register", (5, 0, 1 << 20, 10, 9, b"/ram/b", 10, b"c" * 8)),
        ("fast_lookup_register", (3, b"name \xff", {"st_ino": 42, "st_size": 7})),
        ("fast_listing_register", (3, b"packed", 1)),
        ("fast_read_forget_file", (9,)),
    ]
    assert first.applied == expected
    assert second.applied == expected
    table.forget_inodes(1 << 40, 2 << 40)
    table.clear()
    assert first.applied[-2:] == [("fast_read_forget_inodes", (1 << 40, 2 << 40)),
                                  ("fast_read_clear", ())]  # fmt: skip
    assert [name for name, _ in local.calls] == [
        "configure", "register", "register_dentry", "register_listing", "forget_file",
        "forget_inodes", "clear",
    ]  # fmt: skip


def test_what_the_worker_table_refuses_is_not_sent_and_peer_paths_stay_local(replicas):
    local = RecordingTable({})
    table = ReplicatedTable(local)
    replica = replicas()
    table.attach(replica.worker_end, replica.process.pid, replica.pidfd)
    local.refuse = True
    assert table.register(5, 0, 1, 1, 1, b"/x", 1, b"") is False
    assert table.register_dentry(3, b"n", Entry()) is False
    assert table.register_peer_name(5, b"id") is False  # the worker's alone
    table.forget_file(1)
    assert replica.applied == [("fast_read_forget_file", (1,))]


def test_stats_sum_the_work_of_every_process_and_keep_the_worker_sizes(replicas):
    worker = {"reads": 10, "peer_reads": 4, "blocks": 100, "max_read": 1 << 20}
    table = ReplicatedTable(RecordingTable(worker))
    replica = replicas(
        {"reads": 5, "peer_reads": 2, "blocks": 90, "max_read": 1 << 20, "open_files": 3}
    )
    table.attach(replica.worker_end, replica.process.pid, replica.pidfd)
    stats = table.stats()
    assert stats == {
        "reads": 15,
        "peer_reads": 6,
        "blocks": 100,  # a copy of the worker's table, not more blocks
        "max_read": 1 << 20,
        "open_files": 3,
        "serving_processes": 2,
        "serving_reads": 5,
        "serving_peer_reads": 2,
    }


def test_a_replica_that_does_not_answer_a_forget_is_killed_and_the_forget_returns(
    replicas, monkeypatch
):
    monkeypatch.setattr(serving, "TABLE_ANSWER_TIMEOUT_S", 0.5)
    table = ReplicatedTable(RecordingTable({"reads": 1}))
    answering = replicas()
    table.attach(answering.worker_end, answering.process.pid, answering.pidfd)
    silent_end, _never_read = socket.socketpair()  # nobody applies or answers
    silent = subprocess.Popen(["sleep", "600"])
    silent_pidfd = os.pidfd_open(silent.pid)
    try:
        table.attach(silent_end, silent.pid, silent_pidfd)
        table.forget_file(4)
        assert silent.wait(WAIT_S) == -9  # killed: its table can no longer serve
        assert ("fast_read_forget_file", (4,)) in answering.applied
        assert table.stats()["serving_processes"] == 2  # the worker and the one that answers
    finally:
        silent.kill()
        silent.wait(WAIT_S)
        os.close(silent_pidfd)
        silent_end.close()
        _never_read.close()


def test_a_replica_whose_answer_is_not_one_is_killed(replicas):
    """A frame that is not an answer (a bug) leaves the stream out of step: the replica is
    killed rather than trusted with later changes."""
    table = ReplicatedTable(RecordingTable({}))
    worker_end, replica_end = socket.socketpair()
    process = subprocess.Popen(["sleep", "600"])
    pidfd = os.pidfd_open(process.pid)

    def answer_garbage() -> None:
        try:
            receive_frame(replica_end)
            replica_end.sendall(frame("not an answer"))
        except (EOFError, OSError):
            pass

    answering = threading.Thread(target=answer_garbage)
    try:
        table.attach(worker_end, process.pid, pidfd)
        answering.start()
        table.forget_inodes(1, 2)
        assert process.wait(WAIT_S) == -9
        assert table.stats()["serving_processes"] == 1
    finally:
        answering.join(WAIT_S)
        process.kill()
        process.wait(WAIT_S)
        os.close(pidfd)
        worker_end.close()
        replica_end.close()


def test_each_replica_gets_a_connection_of_its_own_and_the_routes_made_on_it(replicas):
    """The worker's peer connections (NativePeerReads over ReplicatedTable): a connection
    handed to each replica (its descriptor over SCM_RIGHTS), routes only to replicas that hold
    the link, closes everywhere; a slot the binding reuses is a new link; a replica's report
    of a failed link reaches the fault handler with the owner's address."""
    table = ReplicatedTable(RecordingTable({}))
    first, second = replicas(), replicas()
    first_replica = table.attach(first.worker_end, first.process.pid, first.pidfd)
    table.attach(second.worker_end, second.process.pid, second.pidfd)
    faults: list[tuple[str, int]] = []
    table.handle_link_faults(lambda address, fault: faults.append((address, fault)))
    owner_end, worker_end = socket.socketpair()  # stands for a handshaken connection
    try:
        assert table.peer_open(worker_end.fileno(), 1 << 20) == 0
        link = table.link_of(0)
        assert link > 0 and table.connections_wanted(link)
        assert table.share_connection(link, "127.0.0.3:7000", worker_end.fileno(), 2.0)
        assert table.connections_wanted(link)  # the second has none yet
        assert table.peer_route(5, 0, b"frame", 100) is True  # reaches the first only
        assert table.share_connection(link, "127.0.0.3:7000", worker_end.fileno(), 2.0)
        assert not table.connections_wanted(link)
        assert not table.share_connection(link, "127.0.0.3:7000", worker_end.fileno(), 2.0)
        assert table.shared_connections() == 2
        assert table.peer_route(6, 0, b"frame", 100) is True
        table.forget_inodes(5, 5)  # answered: both have applied everything before it
        assert first.applied == [
            ("peer_open", (link, 1 << 20, 2.0)),
            ("peer_route", (5, link, b"frame", 100)),
            ("peer_route", (6, link, b"frame", 100)),
            ("fast_read_forget_inodes", (5, 5)),
        ]
        assert second.applied == [
            ("peer_open", (link, 1 << 20, 2.0)),
            ("peer_route", (6, link, b"frame", 100)),
            ("fast_read_forget_inodes", (5, 5)),
        ]
        # The descriptor each got is the connection itself.
        assert len(first.fds) == 1 and len(second.fds) == 1
        os.write(first.fds[0], b"from the replica")
        assert owner_end.recv(100) == b"from the replica"
        # The first closed its connection (a wrong checksum): the owner is to cool down, and
        # the first may be given another.
        table.link_closed(first_replica, link, 6)
        assert faults == [("127.0.0.3:7000", 6)]
        assert table.connections_wanted(link)
        assert table.peer_close(0, False) == ["a READ handed back"]
        table.forget_file(1)
        assert first.applied[-1] == ("fast_read_forget_file", (1,))  # it had none to close
        assert second.applied[-2:] == [("peer_close", (link,)), ("fast_read_forget_file", (1,))]
        assert not table.connections_wanted(link)
        table.link_closed(first_replica, link, 6)  # a late report of a closed link: nothing
        assert len(faults) == 1
        # An idle connection the owner closed: the replica wants another, no cool-down.
        assert table.peer_open(worker_end.fileno(), 1 << 20) == 0
        idle_link = table.link_of(0)
        assert table.share_connection(idle_link, "127.0.0.3:7000", worker_end.fileno(), 2.0)
        table.link_closed(first_replica, idle_link, PEER_ENDED_IDLE)
        assert len(faults) == 1 and table.connections_wanted(idle_link)
        table.peer_close(0, False)
        assert table.shared_connections() == 0
        # The binding reuses slot 0: a new link, which no replica holds yet.
        assert table.peer_open(worker_end.fileno(), 1 << 20) == 0
        assert table.link_of(0) not in (link, idle_link)
        assert table.connections_wanted(table.link_of(0))
    finally:
        owner_end.close()
        worker_end.close()
