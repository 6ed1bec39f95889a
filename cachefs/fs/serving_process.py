"""A serving process: one more reader of the worker's FUSE connection (cachefs/fs/serving.py).

Started by the worker as ``python -m cachefs.fs.serving_process FUSE_FD CALLS_FD TABLE_FD
MAX_TASKS``, with a clone of the mount's /dev/fuse descriptor and two socketpair ends. It
brings its own pyfuse3 session into the mount's initialised state (``pyfuse3.init_clone``, the
mount's FUSE_INIT replayed; "clones" in third_party/pyfuse3/cachefs_fast_read.c) and then reads
requests as the worker does: the kernel hands each request to whichever process reads first.

What it answers itself, in C: READs, LOOKUPs and listings its own native table holds, and
READs of other workers' small files, sent on the connections to their owners that the worker
opened and handed over (:class:`PeerLinks`). The
worker keeps that table a replica of its own: every registration and forget the worker makes
arrives on the table channel, in order, and a forget is answered only once applied (a thread
here applies them, so the answer never waits for this process's trio loop). Everything else
goes to the worker over the calls channel, which runs the worker's own FuseOperations method
and sends back its reply or errno: snapshots, the cache, misses, admission, metrics and
hand-offs stay with the one worker process, and this one holds no state a refresh could leave
stale (only the table, which the worker empties first).

It ends when the worker closes the table channel, when the connection ends (unmount), or with
the worker (PR_SET_PDEATHSIG): a serving process never outlives its worker.

Imports only pyfuse3, trio and the frames (no snapshot, cache or store code): it starts in a
fraction of a second, so that a replacement serves soon after one dies.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol, cast

import pyfuse3
import trio

from cachefs.fs.peer_answers import HandedBack, run_handed_back, wait_for_answers
from cachefs.fs.serving_wire import (
    PEER_ENDED_IDLE,
    PEER_TIMED_OUT,
    FrameReader,
    frame,
    receive_frame,
)

log = logging.getLogger("cachefs.serving")


class _CachefsPatch(Protocol):
    """The patched pyfuse3's functions used here (third_party/pyfuse3; the stock one has none
    of them, and a serving process is only started with the patched one)."""

    def fast_lookup_register(
        self, parent: int, name: bytes, entry: pyfuse3.EntryAttributes
    ) -> bool: ...
    def init_clone(
        self, ops: pyfuse3.Operations, fd: int, request: bytes, options: set[str]
    ) -> None: ...
    def cache_listings(self, on: bool) -> None: ...
    def fast_peer_open(self, sock_fd: int, max_length: int) -> int: ...
    def fast_peer_route(self, ino: int, slot: int, frame: bytes, length: int) -> bool: ...
    def fast_peer_receive(self, slot: int) -> tuple[int, list[HandedBack], int, float]: ...
    def fast_peer_close(self, slot: int, fail: bool) -> list[HandedBack]: ...


_patched = cast(_CachefsPatch, pyfuse3)

_PR_SET_PDEATHSIG = 1
#: The bytes one receive on the calls channel takes.
_RECEIVE_BYTES = 1 << 20
#: The binding's CFR_PEER_ENDED (cachefs_fast_read.h; native_peer_reads.ENDED, not imported
#: here): the owner closed the connection.
_PEER_ENDED = 2


class WorkerCalls:
    """Calls to the worker's FuseOperations over the calls channel, many in flight."""

    def __init__(self, sock: socket.socket) -> None:
        self._stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self._send_lock = trio.Lock()
        self._pending: dict[int, list[Any]] = {}
        self._next_id = 0

    async def call(self, op: str, *args: Any) -> Any:
        """The worker's answer to ``op(*args)``; FUSEError with its errno if it refused."""
        call_id = self._next_id
        self._next_id += 1
        slot: list[Any] = [trio.Event(), None]
        self._pending[call_id] = slot
        try:
            async with self._send_lock:
                await self._stream.send_all(frame((call_id, op, args)))
            await slot[0].wait()
        finally:
            del self._pending[call_id]
        ok, value = slot[1]
        if not ok:
            raise pyfuse3.FUSEError(value)
        return value

    async def receive_answers(self) -> None:
        """Hand each answer to its call, until the worker closes the channel."""
        reader = FrameReader()
        while True:
            data = await self._stream.receive_some(_RECEIVE_BYTES)
            if not data:
                return
            for call_id, ok, value in reader.feed(data):
                slot = self._pending.get(call_id)
                if slot is not None:  # else its task was cancelled (the loop is ending)
                    slot[1] = (ok, value)
                    slot[0].set()


class ForwardingOperations(pyfuse3.Operations):
    """Every request the native table did not answer, answered by the worker (its
    FuseOperations, cachefs/fs/fuse_ops.py, which maps every error to its errno)."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, worker: WorkerCalls) -> None:
        super().__init__()
        self._worker = worker

    async def lookup(self, parent_inode, name, ctx=None):  # type: ignore[no-untyped-def]
        return _entry(await self._worker.call("lookup", parent_inode, name))

    async def getattr(self, inode, ctx=None):  # type: ignore[no-untyped-def]
        return _entry(await self._worker.call("getattr", inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        return  # as FuseOperations.forget: inodes come from the snapshot, nothing to free

    async def opendir(self, inode, ctx):  # type: ignore[no-untyped-def]
        return await self._worker.call("opendir", inode)

    async def readdir(self, fh, start_id, token):  # type: ignore[no-untyped-def]
        # A page of entries: what does not fit this reply the kernel asks for again, from the
        # offset of the last entry that did.
        for name, state, next_id in await self._worker.call("readdir", fh, start_id):
            if not pyfuse3.readdir_reply(token, name, _entry(state), next_id):
                break

    async def releasedir(self, fh):  # type: ignore[no-untyped-def]
        return  # as FuseOperations.releasedir

    async def statfs(self, ctx):  # type: ignore[no-untyped-def]
        stats = pyfuse3.StatvfsData()
        stats.__setstate__(await self._worker.call("statfs"))
        return stats

    async def getxattr(self, inode, name, ctx):  # type: ignore[no-untyped-def]
        return await self._worker.call("getxattr", inode, name)

    async def listxattr(self, inode, ctx):  # type: ignore[no-untyped-def]
        return await self._worker.call("listxattr", inode)

    async def access(self, inode, mode, ctx):  # type: ignore[no-untyped-def]
        return await self._worker.call("access", inode, mode)

    async def open(self, inode, flags, ctx):  # type: ignore[no-untyped-def]
        fh, keep_cache, direct_io = await self._worker.call("open", inode, flags)
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=direct_io)

    async def read(self, fh, off, size):  # type: ignore[no-untyped-def]
        return await self._worker.call("read", fh, off, size)

    async def release(self, fh):  # type: ignore[no-untyped-def]
        return await self._worker.call("release", fh)

    async def readlink(self, inode, ctx):  # type: ignore[no-untyped-def]
        return await self._worker.call("readlink", inode)

    async def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        return await self._worker.call("write")

    setattr = _read_only
    mknod = _read_only
    mkdir = _read_only
    unlink = _read_only
    rmdir = _read_only
    symlink = _read_only
    rename = _read_only
    link = _read_only
    create = _read_only
    write = _read_only
    setxattr = _read_only
    removexattr = _read_only
    fsync = _read_only
    fsyncdir = _read_only


class PeerLinks:
    """The connections to other workers this process sends READs of their files on (the
    worker's NativePeerReads opens and hands them over; serving_wire's ``peer_*``), each
    served as the worker serves its own: a task waits for the socket and has the answers
    handled in C; the READs C hands back (a refusal, a fault) go to the worker like any other.

    Opened and routed from the table thread, in the table channel's order (a route never
    outlives the forget after it); read and closed by the link's task, on the loop's thread.
    The binding reuses a closed slot for the next connection, so ``_slots`` says which link
    holds a slot, and every call that opens, routes on, reads or closes a slot is made under
    ``_lock`` together with the change of ``_slots`` it implies: a route of a closed link never
    lands on the connection that took its slot, and a task never closes another link's
    connection. Each link closed here is reported to the worker (``peer_closed``): a fault or
    no answer within the timeout cools the owner down, which closes everyone's connection to
    it; a connection the owner closed while idle (PEER_ENDED_IDLE) is only replaced."""

    def __init__(self, worker: WorkerCalls) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._slots: dict[int, int] = {}  # link -> the slot its connection holds now
        self._scopes: dict[int, trio.CancelScope] = {}  # link -> its task's (the loop's)
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None  # ending: nothing more is started or handed back

    # --- from the table thread -----------------------------------------------------------

    def open(self, link: int, max_length: int, timeout_s: float, fd: int) -> None:
        with self._lock:
            slot = _patched.fast_peer_open(fd, max_length)
            if slot >= 0:
                self._slots[link] = slot
        if slot < 0:  # not reported: the worker opens no other for it (it would fail again)
            log.warning("no free connection slot for a peer link: its READs go to the worker")
            os.close(fd)
            return
        assert self._token is not None  # the table thread starts once run() has
        try:
            self._token.run_sync_soon(self._start, link, slot, fd, timeout_s)
        except trio.RunFinishedError:  # the process is ending
            self._close_slot(link, slot, ending=True)
            os.close(fd)

    def route(self, ino: int, link: int, request: bytes, length: int) -> None:
        with self._lock:
            slot = self._slots.get(link)
            if slot is not None:  # else closed here already: its READs go to the worker
                _patched.fast_peer_route(ino, slot, request, length)

    def close(self, link: int) -> None:
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # ending: every link is closed
            self._token.run_sync_soon(self._cancel, link)

    # --- on the loop's thread ------------------------------------------------------------

    def _start(self, link: int, slot: int, fd: int, timeout_s: float) -> None:
        if self._nursery is None:  # ending
            run_handed_back(self._nursery, self._close_slot(link, slot, ending=True))
            os.close(fd)
            return
        scope = self._scopes[link] = trio.CancelScope()
        self._nursery.start_soon(self._serve, link, slot, fd, timeout_s, scope)

    def _cancel(self, link: int) -> None:
        scope = self._scopes.get(link)
        if scope is not None:
            scope.cancel()

    async def _serve(
        self, link: int, slot: int, fd: int, timeout_s: float, scope: trio.CancelScope
    ) -> None:
        ended: int | None = None  # why it was closed here (not by the worker), if it was
        try:
            with scope:
                ended = await self._receive(link, slot, fd, timeout_s)
        finally:
            del self._scopes[link]
            # Ending with the process: a READ handed back could not be answered.
            ending = trio.current_effective_deadline() == -math.inf
            run_handed_back(self._nursery, self._close_slot(link, slot, ending))
            os.close(fd)
        if ended is not None and self._nursery is not None:
            self._nursery.start_soon(self._worker.call, "peer_closed", link, ended)

    async def _receive(self, link: int, slot: int, fd: int, timeout_s: float) -> int:
        """Have C handle the answers until the connection is done: why it ended (a CFR_PEER_*
        fault, PEER_TIMED_OUT or PEER_ENDED_IDLE)."""
        while True:
            with self._lock:
                fault, handed_back, pending, oldest_age_s = _patched.fast_peer_receive(slot)
                if fault:  # C closed the slot: it is free for the next connection
                    del self._slots[link]
            run_handed_back(self._nursery, handed_back)  # to the worker, as forwarded READs
            if fault:
                return PEER_ENDED_IDLE if fault == _PEER_ENDED and not handed_back else fault
            if not await wait_for_answers(fd, pending, oldest_age_s, timeout_s):
                return PEER_TIMED_OUT

    def _close_slot(self, link: int, slot: int, ending: bool) -> list[HandedBack]:
        """Close the link's slot if it still holds it: the READs pending on it (none if
        ``ending``: they are answered EIO)."""
        with self._lock:
            if self._slots.pop(link, None) != slot:
                return []  # closed by C already (a fault), perhaps taken by another since
            return _patched.fast_peer_close(slot, ending)


def _entry(state: dict[str, Any]) -> pyfuse3.EntryAttributes:
    """pyfuse3's attributes from the state the worker sent (its classes do not pickle)."""
    entry = pyfuse3.EntryAttributes()
    entry.__setstate__(state)
    return entry


def _register_dentry(parent: int, name: bytes, state: dict[str, Any]) -> bool:
    return _patched.fast_lookup_register(parent, name, _entry(state))


#: Table changes that need their arguments rebuilt; the others are pyfuse3 functions by name.
_TABLE_FUNCTIONS = {"fast_lookup_register": _register_dentry}


def apply_table_changes(sock: socket.socket, links: PeerLinks) -> None:
    """The table channel, in a thread: apply each change to this process's native table (or
    its peer links), answer those that want it; at the channel's end (the worker closed it or
    died) end the process."""
    try:
        while True:
            fds: list[int] = []
            function, args, wants_answer = receive_frame(sock, fds)
            try:
                value: Any = None
                if function == "peer_open":
                    link, max_length, timeout_s = args
                    links.open(link, max_length, timeout_s, fds.pop(0))
                elif function == "peer_route":
                    links.route(*args)
                elif function == "peer_close":
                    links.close(*args)
                else:
                    apply = _TABLE_FUNCTIONS.get(function) or getattr(pyfuse3, function)
                    value = apply(*args)
                answer: tuple[bool, Any] = (True, value)
            except Exception as exc:  # the worker logs it; the table is as C left it
                answer = (False, f"{function}: {exc}")
            finally:
                for fd in fds:  # none but peer_open's is expected
                    os.close(fd)
            if wants_answer:
                sock.sendall(frame(answer))
            elif not answer[0]:
                log.error("table change not applied: %s", answer[1])
    except (EOFError, OSError):
        pass
    finally:
        # Nothing here outlives the channel: a table no forget can reach must not serve.
        os._exit(0)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() == 1:  # the worker died before the call above
        os._exit(0)


def main(argv: Sequence[str]) -> int:
    fuse_fd, calls_fd, table_fd, max_tasks = (int(arg) for arg in argv)
    _die_with_parent()
    # A Ctrl-C at the terminal reaches the whole process group: the worker stops these.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s serving[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    table = socket.socket(fileno=table_fd)
    # The first frame: the mount's FUSE_INIT request and whether the kernel keeps listings.
    init_request, cache_listings = receive_frame(table)
    worker = WorkerCalls(socket.socket(fileno=calls_fd))
    ops = ForwardingOperations(worker)
    try:
        _patched.init_clone(ops, fuse_fd, init_request, set())
    except RuntimeError as exc:
        log.error("cannot serve the mount: %s", exc)
        return 1
    _patched.cache_listings(cache_listings)
    table.sendall(frame((True, os.getpid())))  # ready: the worker may send table changes
    links = PeerLinks(worker)

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_worker_gone, worker)
            await nursery.start(links.run)
            # The changes sent meanwhile wait on the channel, in order.
            threading.Thread(target=apply_table_changes, args=(table, links), daemon=True).start()
            await pyfuse3.main(min_tasks=1, max_tasks=max_tasks)
            nursery.cancel_scope.cancel()

    try:
        trio.run(serve)
    except Exception as exc:  # (in trio's exception group) the loop failed: the worker starts
        log.error("serving ended: %r", exc)  # another if the mount is still served
        return 1
    pyfuse3.close(unmount=False)
    return 0


async def _until_worker_gone(worker: WorkerCalls) -> None:
    await worker.receive_answers()
    pyfuse3.terminate()  # the worker closed the calls channel: nothing could be answered


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
