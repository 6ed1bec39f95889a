"""More processes serving one FUSE mount (``--fuse-processes N``): the worker and N-1 serving
processes all read the mount's connection, and the kernel hands each request to whichever
reads first.

    kernel FUSE connection (one mount)
      |-- /dev/fuse          worker: pyfuse3 session, native table (C), FuseOperations,
      |                      snapshots, cache, store, peers, admission, metrics, hand-offs
      |-- clone of it  ----  serving process 1: pyfuse3 session, native table replica (C)
      '-- clone of it  ----  serving process 2: ...
                 calls channel: what its table cannot answer, answered by the worker
                 table channel: the worker's table changes, in order; forgets answered

Each serving process (cachefs/fs/serving_process.py) reads a clone of the mount's /dev/fuse
descriptor (FUSE_DEV_IOC_CLONE) with a pyfuse3 session brought into the mount's initialised
state by the mount's own FUSE_INIT, replayed ("clones" in
third_party/pyfuse3/cachefs_fast_read.c). It answers in C what its native table holds (READs
of RAM-tier blocks, repeated LOOKUPs, listings, and READs of other workers' small files, sent
on connections to their owners that the worker opens and hands over: "peer reads" in
:class:`ReplicatedTable`) and sends anything else to the worker, which
answers with its own FuseOperations (``answer_forwarded``): there is one owner of the
snapshots, the cache, misses, admission and hand-offs, and a block is never fetched twice
because two processes missed it (the worker's BlockReader shares fetches as ever).

Coherence (the rules of cachefs/fs/native_reads.py, for every table): :class:`ReplicatedTable`
applies every change to the worker's table and then sends it to every serving process on its
table channel, under one lock, so each replica sees the changes in the worker's order. A
forget (a block's space about to be released, a refresh or removal about to be served) returns
only once every serving process has applied it; one that does not answer within
:data:`TABLE_ANSWER_TIMEOUT_S` is killed, and the forget returns once it has exited (its
pidfd readable: every thread gone, its open block files closed), or raises. A new serving
process starts with an empty table: it answers in C only what is registered after it started.

Supervision: a serving process that dies is replaced at once (a new clone, a new process);
only the requests it had read fail (the kernel ends them with ECONNABORTED: the reader's
read() fails with that error, or EIO for a readahead). Serving processes die with the worker
(PR_SET_PDEATHSIG) and stop when it stops, before it unmounts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol

import trio

from cachefs.fs import fuse_ops
from cachefs.fs.serving_wire import (
    PEER_ENDED_IDLE,
    FrameReader,
    frame,
    receive_frame,
    send_frame_with_fd,
)

log = logging.getLogger("cachefs.serving")

#: How long a serving process may take to apply a table change that is waited for (a forget,
#: the stats) before it is killed. It applies them in a thread of its own: microseconds.
TABLE_ANSWER_TIMEOUT_S = 10.0
#: How long a new serving process may take to start (import, pyfuse3 session, INIT replayed).
START_TIMEOUT_S = 60.0
#: A serving process asked to stop (SIGTERM) is killed after this long.
STOP_TIMEOUT_S = 5.0
#: After this many deaths in a row within START_TIMEOUT_S of their start, the slot waits
#: RESTART_BACKOFF_S before the next start (a process that cannot start is not started in a
#: tight loop); a replacement otherwise starts at once.
QUICK_DEATHS_BEFORE_BACKOFF = 3
RESTART_BACKOFF_S = 5.0
#: Bytes one receive on a calls channel takes.
_RECEIVE_BYTES = 1 << 20
#: Native-table figures that are not counts of work done: the sizes of the table every
#: replica copies (the worker's own say it) and the connection's limits. The others (reads,
#: bytes, open block files, ...) are summed over the processes.
_NOT_SUMMED = frozenset(
    {"blocks", "files", "dentries", "listings", "listing_bytes", "peer_names", "peer_routes",
     "max_read", "passthrough", "backing_files", "kept_backings"}
)  # fmt: skip


class LocalTable(Protocol):
    """The worker's own table (fuse_ops._PyfuseNativeReadTable)."""

    def stats(self) -> dict[str, int]: ...


class _Replica:
    """One serving process's table channel (blocking, owned by :class:`ReplicatedTable`).
    ``pidfd``: the process's (its owner's to close, after :meth:`ReplicatedTable.detach`): a
    pid can be reused once the process is reaped, a pidfd names that one process."""

    def __init__(self, sock: socket.socket, pid: int, pidfd: int) -> None:
        self.sock = sock
        self.pid = pid
        self.pidfd = pidfd
        self.dead = False
        self.links: set[int] = set()  # the peer links it was given a connection for

    def send(self, message: tuple[str, tuple[Any, ...], bool]) -> None:
        self.sock.sendall(frame(message))

    def ask(self, function: str, args: tuple[Any, ...]) -> Any:
        self.send((function, args, True))
        ok, value = receive_frame(self.sock)
        if not ok:
            raise RuntimeError(value)
        return value

    def kill(self) -> None:
        """SIGKILL, and return once the whole process has exited (its pidfd is readable only
        then: every thread gone, every descriptor closed). RuntimeError if it has not within
        STOP_TIMEOUT_S: the caller must not release what it might still read."""
        self.dead = True
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # exited already (perhaps not yet reaped): the poll below says when it is gone
        waiting = select.poll()
        waiting.register(self.pidfd, select.POLLIN)
        if not waiting.poll(STOP_TIMEOUT_S * 1000):
            raise RuntimeError(f"serving process {self.pid} did not exit after SIGKILL")


class _Link:
    """One of the worker's peer connections (its slot in the worker's table), as the serving
    processes know it: by an id never reused, since the binding reuses slots."""

    __slots__ = ("address", "id", "max_length")

    def __init__(self, link_id: int, max_length: int) -> None:
        self.id = link_id
        self.max_length = max_length
        self.address = ""  # the owner's, once a connection to it is shared


class ReplicatedTable:
    """The worker's native table, with every change also made in the serving processes'
    tables (see the module docstring). Duck-types the table it wraps, so NativeReads,
    NativePeerReads and FuseOperations use it unchanged; to NativePeerReads it is also the
    :class:`~cachefs.fs.native_peer_reads.ConnectionSharing` that gives each serving process
    connections of its own to the owners the worker reads from."""

    def __init__(self, local: Any) -> None:
        self._local = local
        self._lock = threading.Lock()
        self._replicas: list[_Replica] = []
        self._configured: list[tuple[str, tuple[Any, ...]]] = []
        self._links: dict[int, _Link] = {}  # the worker's peer slot -> its link
        self._by_id: dict[int, _Link] = {}  # the same, by link id
        self._last_link = 0
        self._on_link_fault: Callable[[str, int], None] | None = None

    # --- replicas ----------------------------------------------------------------------------

    def attach(self, sock: socket.socket, pid: int, pidfd: int) -> _Replica:
        """A started serving process's table channel: configured as the worker's table was,
        then sent every later change."""
        replica = _Replica(sock, pid, pidfd)
        sock.settimeout(TABLE_ANSWER_TIMEOUT_S)
        with self._lock:
            for function, args in self._configured:
                self._send_to([replica], function, args)
            if not replica.dead:
                self._replicas.append(replica)
        return replica

    def detach(self, replica: _Replica) -> None:
        with self._lock:
            replica.dead = True
            if replica in self._replicas:
                self._replicas.remove(replica)

    def _send_to(self, replicas: list[_Replica], function: str, args: tuple[Any, ...]) -> None:
        """Send a change that is not answered to each of ``replicas`` (framed once)."""
        if not replicas:
            return
        try:
            data = frame((function, args, False))
        except Exception:  # a change that cannot be sent: their tables would differ from ours
            log.exception("table change %s could not be sent", function)
            for replica in replicas:
                self._lose(replica, f"{function} not sent")
            return
        for replica in replicas:
            try:
                replica.sock.sendall(data)
            except OSError as exc:  # gone, or its channel full for TABLE_ANSWER_TIMEOUT_S
                self._lose(replica, f"{function}: {exc}")

    def _ask(self, replica: _Replica, function: str, args: tuple[Any, ...]) -> Any:
        """Its answer, or None once it is lost (killed: it did not answer, or not as it must;
        a bad frame leaves the stream out of step)."""
        try:
            return replica.ask(function, args)
        except Exception as exc:
            self._lose(replica, f"{function}: {exc!r}")
            return None

    def _lose(self, replica: _Replica, why: str) -> None:
        if replica in self._replicas:
            self._replicas.remove(replica)
        if replica.dead:  # detached: its owner stopped it
            return
        log.error("serving process %d did not take a table change (%s): killing it",
                  replica.pid, why)  # fmt: skip
        replica.kill()

    def _everywhere(self, function: str, args: tuple[Any, ...]) -> None:
        self._send_to(list(self._replicas), function, args)

    def _applied_everywhere(self, function: str, args: tuple[Any, ...]) -> None:
        """Send and wait for each to have applied it (or to be dead)."""
        for replica in list(self._replicas):
            self._ask(replica, function, args)

    # --- the table ---------------------------------------------------------------------------

    def configure(self, chunk_size: int, max_blocks: int, max_names: int) -> None:
        args = (chunk_size, max_blocks, max_names)
        with self._lock:
            self._local.configure(*args)
            self._configured.append(("fast_read_configure", args))
            self._everywhere("fast_read_configure", args)

    def configure_listings(self, max_bytes: int, entry_timeout: float, attr_timeout: float) -> None:
        args = (max_bytes, entry_timeout, attr_timeout)
        with self._lock:
            self._local.configure_listings(*args)
            self._configured.append(("fast_listing_configure", args))
            self._everywhere("fast_listing_configure", args)

    def register(self, *args: Any) -> bool:
        with self._lock:
            registered = bool(self._local.register(*args))
            if registered:
                self._everywhere("fast_read_register", args)
        return registered

    def register_dentry(self, parent: int, name: bytes, entry: Any) -> bool:
        with self._lock:
            registered = bool(self._local.register_dentry(parent, name, entry))
            if registered:  # the attributes as their state (pyfuse3's classes do not pickle)
                self._everywhere("fast_lookup_register", (parent, name, entry.__getstate__()))
        return registered

    def register_listing(self, dir_ino: int, packed: bytes, count: int) -> bool:
        with self._lock:
            registered = bool(self._local.register_listing(dir_ino, packed, count))
            if registered:
                self._everywhere("fast_listing_register", (dir_ino, packed, count))
        return registered

    def forget_file(self, file_id: int) -> None:
        with self._lock:
            self._local.forget_file(file_id)
            self._applied_everywhere("fast_read_forget_file", (file_id,))

    def forget_inodes(self, lo: int, hi: int) -> None:
        with self._lock:
            self._local.forget_inodes(lo, hi)
            self._applied_everywhere("fast_read_forget_inodes", (lo, hi))

    def clear(self) -> None:
        with self._lock:
            self._local.clear()
            self._applied_everywhere("fast_read_clear", ())

    def stats(self) -> dict[str, int]:
        """The counters of every process's table summed (sizes and limits: the worker's, see
        _NOT_SUMMED), with ``serving_processes`` the processes counted, ``serving_reads`` the
        READs the serving processes answered from the table's blocks and
        ``serving_peer_reads`` those they answered from other workers' (``reads`` and
        ``peer_reads`` count all processes')."""
        with self._lock:
            totals = dict(self._local.stats())
            counted = 1
            serving_reads = serving_peer_reads = 0
            for replica in list(self._replicas):
                theirs = self._ask(replica, "fast_read_stats", ())
                if not isinstance(theirs, dict):
                    continue
                counted += 1
                serving_reads += theirs.get("reads", 0)
                serving_peer_reads += theirs.get("peer_reads", 0)
                for key, value in theirs.items():
                    if key not in _NOT_SUMMED:
                        totals[key] = totals.get(key, 0) + value
        totals["serving_processes"] = counted
        totals["serving_reads"] = serving_reads  # of the reads, those the clones answered
        totals["serving_peer_reads"] = serving_peer_reads  # and of the peer reads, theirs
        return totals

    # --- peer reads (cachefs/fs/native_peer_reads.py) -----------------------------------------
    #
    # A serving process cannot send READs on the worker's connection to an owner (the answers
    # would be read by either process), so it gets connections of its own, opened and
    # handshaken by the worker's peer client (share_connection) and passed over the table
    # channel; a route the worker registers on its slot reaches each serving process as a
    # route on its own connection for the same link.

    def peer_open(self, sock_fd: int, max_length: int) -> int:
        with self._lock:
            slot = int(self._local.peer_open(sock_fd, max_length))
            if slot >= 0:
                self._last_link += 1
                link = _Link(self._last_link, max_length)
                self._links[slot] = self._by_id[link.id] = link
        return slot

    def peer_route(self, ino: int, slot: int, request: bytes, length: int) -> bool:
        with self._lock:
            routed = bool(self._local.peer_route(ino, slot, request, length))
            link = self._links.get(slot)
            if routed and link is not None:
                holding = [r for r in self._replicas if link.id in r.links]
                self._send_to(holding, "peer_route", (ino, link.id, request, length))
        return routed

    def peer_close(self, slot: int, fail: bool) -> Any:
        with self._lock:
            handed_back = self._local.peer_close(slot, fail)
            link = self._links.pop(slot, None)
            if link is not None:
                del self._by_id[link.id]
                holding = [r for r in self._replicas if link.id in r.links]
                for replica in holding:
                    replica.links.discard(link.id)
                self._send_to(holding, "peer_close", (link.id,))
        return handed_back

    def link_of(self, slot: int) -> int:
        """The id of the worker's open connection ``slot`` (0: none open there)."""
        with self._lock:
            link = self._links.get(slot)
            return 0 if link is None else link.id

    def connections_wanted(self, link_id: int) -> bool:
        """Whether a serving process has no connection of its own for ``link_id`` (none is,
        once it is closed)."""
        with self._lock:
            link = self._by_id.get(link_id)
            return link is not None and any(link.id not in r.links for r in self._replicas)

    def share_connection(self, link_id: int, address: str, sock_fd: int, timeout_s: float) -> bool:
        """Give ``sock_fd`` (a handshaken connection to ``address``, the owner at the other
        end of ``link_id``; the caller closes its own descriptor after) to a serving process
        that has none for it; False if none wants one."""
        with self._lock:
            link = self._by_id.get(link_id)
            if link is None:
                return False
            for replica in list(self._replicas):
                if link.id in replica.links:
                    continue
                message = ("peer_open", (link.id, link.max_length, timeout_s), False)
                try:
                    send_frame_with_fd(replica.sock, message, sock_fd)
                except OSError as exc:
                    self._lose(replica, f"peer_open: {exc}")
                    continue
                replica.links.add(link.id)
                link.address = address
                return True
            return False

    def handle_link_faults(self, callback: Callable[[str, int], None]) -> None:
        """Call ``callback(address, fault)`` when a serving process closed a shared connection
        because it failed (serving_wire's ``peer_closed``)."""
        self._on_link_fault = callback

    def link_closed(self, replica: _Replica, link_id: int, why: int) -> None:
        """A serving process closed its connection for ``link_id`` itself: it wants another,
        and unless the owner only closed an idle connection, the owner is cooled down (which
        closes the link everywhere)."""
        with self._lock:
            replica.links.discard(link_id)
            link = self._by_id.get(link_id)
        if link is None or why == PEER_ENDED_IDLE:  # closed here already, or no failure
            return
        if self._on_link_fault is not None:
            self._on_link_fault(link.address, why)

    def shared_connections(self) -> int:
        """The connections the serving processes hold to owners now."""
        with self._lock:
            return sum(len(replica.links) for replica in self._replicas)

    def __getattr__(self, name: str) -> Any:
        # The rest of the peer paths (answer_peers, register_peer_name, peer_receive) are the
        # worker's alone: only it answers other workers and reads its own connections.
        return getattr(self._local, name)


class ServingProcesses:
    """Keeps ``count`` - 1 serving processes reading the mount (the worker is the first)."""

    def __init__(
        self,
        count: int,
        ops: fuse_ops.FuseOperations,
        table: ReplicatedTable | None,
        *,
        max_tasks: int,
    ) -> None:
        self.count = count
        self._ops = ops
        self._table = table
        self._max_tasks = max_tasks
        self._limiter = trio.CapacityLimiter(max_tasks)
        self.pids: dict[int, int] = {}  # slot -> pid of the process serving it now
        self.started = 0  # processes started, replacements included
        self.deaths = 0  # processes that ended while the mount was served
        self.forwarded: dict[str, int] = {}  # requests the serving processes handed over, by op

    async def run(self, cache_listings: bool) -> None:
        """Serve until cancelled (the mount is stopping); each slot's process replaced when it
        dies. Call once the mount has answered INIT."""
        if not fuse_ops.clones_ready():
            log.error("the mount's FUSE_INIT was not kept for serving processes (longer than "
                      "the patched pyfuse3 holds): the worker alone serves the mount")  # fmt: skip
            return
        try:
            async with trio.open_nursery() as nursery:
                for slot in range(1, self.count):
                    nursery.start_soon(self._keep_serving, slot, cache_listings)
        finally:
            self.pids.clear()

    async def _keep_serving(self, slot: int, cache_listings: bool) -> None:
        quick_deaths = 0
        while True:
            began = trio.current_time()
            try:
                await self._serve_once(slot, cache_listings)
            except Exception as exc:  # trio's nurseries wrap errors in groups: any is logged
                log.error("serving process %d failed: %r", slot, exc)
            self.deaths += 1
            quick = trio.current_time() - began < START_TIMEOUT_S
            quick_deaths = quick_deaths + 1 if quick else 0
            if quick_deaths >= QUICK_DEATHS_BEFORE_BACKOFF:
                log.error("serving process %d keeps dying: next start in %.0f s", slot,
                          RESTART_BACKOFF_S)  # fmt: skip
                await trio.sleep(RESTART_BACKOFF_S)

    async def _serve_once(self, slot: int, cache_listings: bool) -> None:
        calls, calls_theirs = socket.socketpair()
        table, table_theirs = socket.socketpair()
        try:
            fuse_fd, init_request = fuse_ops.clone_session()
            try:
                passed = (fuse_fd, calls_theirs.fileno(), table_theirs.fileno())
                # Started from this (the loop's) thread, not from a worker thread as
                # trio.lowlevel.open_process does: the child's PR_SET_PDEATHSIG fires when the
                # thread that forked it ends, and trio retires idle worker threads (every
                # serving process died ~10 s after its start when it was).
                process = subprocess.Popen(
                    [sys.executable, "-m", "cachefs.fs.serving_process", *map(str, passed),
                     str(self._max_tasks)],
                    pass_fds=passed,
                )  # fmt: skip
            finally:
                os.close(fuse_fd)
        except BaseException:
            calls.close()
            table.close()
            raise
        finally:
            calls_theirs.close()
            table_theirs.close()
        # Opened before anything can reap it: this pidfd names this process and no other.
        pidfd = os.pidfd_open(process.pid)
        self.started += 1
        replica = None
        try:
            table.settimeout(START_TIMEOUT_S)
            table.sendall(frame((init_request, cache_listings)))
            # abandon_on_cancel: a stop does not wait for a process that never says it is
            # ready (the finally below shuts the socket down, which ends the receive).
            ready = await trio.to_thread.run_sync(receive_frame, table, abandon_on_cancel=True)
            pid = ready[1]
            if self._table is not None:
                replica = self._table.attach(table, pid, pidfd)
            self.pids[slot] = pid
            log.info("serving process %d (pid %d) serves the mount", slot, pid)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._answer_calls, calls, replica)
                await _wait(process, pidfd)
                nursery.cancel_scope.cancel()
            log.warning("serving process %d (pid %d) ended (%s); replacing it", slot, pid,
                        _how_it_ended(process.returncode))  # fmt: skip
        finally:
            self.pids.pop(slot, None)
            with trio.CancelScope(shield=True):
                await _stop(process, pidfd)
            # Detached only once it has exited: until then forgets still reach it (or kill it).
            if self._table is not None and replica is not None:
                self._table.detach(replica)
            os.close(pidfd)
            calls.close()
            with contextlib.suppress(OSError):
                table.shutdown(socket.SHUT_RDWR)
            table.close()

    async def _answer_calls(self, sock: socket.socket, replica: _Replica | None) -> None:
        """Answer the serving process's forwarded requests, each in a task of its own (at most
        max_tasks at once, as the worker's own loop), until it closes the channel; and take
        what it says of its peer connections (serving_wire's ``peer_closed``)."""
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        send_lock = trio.Lock()
        reader = FrameReader()

        async def answer(call_id: int, op: str, args: tuple[Any, ...]) -> None:
            if op == "peer_closed":
                ok, value = True, None
                if self._table is not None and replica is not None:
                    self._table.link_closed(replica, *args)
            else:
                self.forwarded[op] = self.forwarded.get(op, 0) + 1
                async with self._limiter:
                    ok, value = await self._ops.answer_forwarded(op, args)
            try:
                answer = frame((call_id, ok, value))
            except Exception:  # a bug here must cost one request, not the worker
                log.exception("the answer to a forwarded %s could not be sent", op)
                answer = frame((call_id, False, errno.EIO))
            try:
                async with send_lock:
                    await stream.send_all(answer)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # it died: the kernel ended the request with it

        async with trio.open_nursery() as nursery:
            while True:
                try:
                    data = await stream.receive_some(_RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    break
                # A frame that is not a call (a bug) raises here: the process is stopped and
                # replaced (the stream cannot be trusted past it).
                for call_id, op, args in reader.feed(data):
                    nursery.start_soon(answer, call_id, op, args)

    def stats(self) -> dict[str, Any]:
        """What `cachefs status` shows of them: ``processes`` the mount's (the worker
        included), ``pids`` of the serving processes serving now, ``started`` and ``deaths``
        since the mount (replacements included), ``forwarded`` the requests they handed to the
        worker, by operation, ``peer_connections`` the connections to other workers they send
        READs on."""
        return {
            "processes": self.count,
            "pids": sorted(self.pids.values()),
            "started": self.started,
            "deaths": self.deaths,
            "forwarded": dict(self.forwarded),
            "peer_connections": 0 if self._table is None else self._table.shared_connections(),
        }


async def _wait(process: subprocess.Popen[bytes], pidfd: int) -> None:
    """Until ``process`` has ended (its pidfd readable), then reap it."""
    await trio.lowlevel.wait_readable(pidfd)
    process.wait()


async def _stop(process: subprocess.Popen[bytes], pidfd: int) -> None:
    """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; returns once it is reaped."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):  # exited, not reaped yet
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
    with trio.move_on_after(STOP_TIMEOUT_S):
        await _wait(process, pidfd)
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        await _wait(process, pidfd)


def _how_it_ended(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"
