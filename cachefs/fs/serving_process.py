"""A serving process: one more reader of the worker's FUSE connection (cachefs/fs/serving.py).

Started by the worker as ``python -m cachefs.fs.serving_process FUSE_FD CALLS_FD TABLE_FD
MAX_TASKS``, with a clone of the mount's /dev/fuse descriptor and two socketpair ends. It
brings its own pyfuse3 session into the mount's initialised state (``pyfuse3.init_clone``, the
mount's FUSE_INIT replayed; "clones" in third_party/pyfuse3/cachefs_fast_read.c) and then reads
requests as the worker does: the kernel hands each request to whichever process reads first.

What it answers itself, in C: READs, LOOKUPs and listings its own native table holds. The
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

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from typing import Any, Protocol, cast

import pyfuse3
import trio

from cachefs.fs.serving_wire import FrameReader, frame, receive_frame

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


_patched = cast(_CachefsPatch, pyfuse3)

_PR_SET_PDEATHSIG = 1
#: The bytes one receive on the calls channel takes.
_RECEIVE_BYTES = 1 << 20


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


def _entry(state: dict[str, Any]) -> pyfuse3.EntryAttributes:
    """pyfuse3's attributes from the state the worker sent (its classes do not pickle)."""
    entry = pyfuse3.EntryAttributes()
    entry.__setstate__(state)
    return entry


def _register_dentry(parent: int, name: bytes, state: dict[str, Any]) -> bool:
    return _patched.fast_lookup_register(parent, name, _entry(state))


#: Table changes that need their arguments rebuilt; the others are pyfuse3 functions by name.
_TABLE_FUNCTIONS = {"fast_lookup_register": _register_dentry}


def apply_table_changes(sock: socket.socket) -> None:
    """The table channel, in a thread: apply each change to this process's native table, answer
    those that want it; at the channel's end (the worker closed it or died) end the process."""
    try:
        while True:
            function, args, wants_answer = receive_frame(sock)
            try:
                apply = _TABLE_FUNCTIONS.get(function) or getattr(pyfuse3, function)
                value: Any = apply(*args)
                answer: tuple[bool, Any] = (True, value)
            except Exception as exc:  # the worker logs it; the table is as C left it
                answer = (False, f"{function}: {exc}")
            if wants_answer:
                sock.sendall(frame(answer))
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
    threading.Thread(target=apply_table_changes, args=(table,), daemon=True).start()

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_until_worker_gone, worker)
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
