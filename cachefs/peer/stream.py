"""Socket plumbing both ends of a peer connection share: exact reads, and sendfile on trio."""

from __future__ import annotations

import os

import trio

#: The receive buffer's size: one read takes up to this much, so several small frames (or a
#: 128 KiB block and the heads after it) arrive in one syscall.
RECEIVE_SIZE = 256 << 10
#: The buffer's unread bytes move to its front when less room than this is left after them.
MIN_READ_SIZE = 16 << 10
#: A buffer grown for a larger frame is given back once it is empty and larger than this.
KEPT_BUFFER_SIZE = 4 << 20
#: Socket reads in a row that found bytes waiting before :meth:`FrameReader.exactly` lets
#: other tasks run: a reader fed without pause must not starve the rest of the node.
READS_BETWEEN_CHECKPOINTS = 16


class ConnectionEnded(Exception):
    """The other end closed the connection (mid-frame, or between frames)."""


class FrameReader:
    """Reads exact byte counts from a trio socket, keeping what arrived beyond them.

    Why not ``await sock.recv()``: each trio socket call is two trips through the scheduler,
    even when the bytes are already there, and returns a new ``bytes`` that must then be
    joined and sliced. A profile of a peer reader put a third of its CPU per block there. So
    the bytes are read without waiting (``os.readv`` on the non-blocking socket) into one
    reusable buffer, as much as has arrived; the task waits (``wait_readable``) only when
    nothing has; and a frame is copied out once. A block thus crosses memory twice (kernel to
    buffer, buffer to its ``bytes``) where it crossed four times.

    A read that trio cancels (only ever while waiting) keeps every byte already received, so
    the buffer always holds whole, unread bytes: a reader cancelled between two reads leaves
    the stream consistent.
    """

    def __init__(self, sock: trio.socket.SocketType):
        self._sock = sock
        self._new_buffer(RECEIVE_SIZE)
        self._reads_without_yield = 0

    def _new_buffer(self, size: int, keep: bytes | memoryview = b"") -> None:
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._view[: len(keep)] = keep
        self._start, self._end = 0, len(keep)  # unread bytes: _buffer[_start:_end]

    @property
    def buffer_size(self) -> int:
        """The bytes of memory this reader's buffer holds now."""
        return len(self._buffer)

    async def exactly(self, count: int) -> bytes:
        if self._end - self._start < count:
            await self._receive(count)
        start = self._start
        self._start += count
        return bytes(self._view[start : self._start])

    async def wait_for(self, count: int) -> None:
        """Wait until ``count`` unread bytes are buffered, taking none of them."""
        if self._end - self._start < count:
            await self._receive(count)

    def unread(self) -> memoryview:
        """The bytes received and not yet taken (valid until the next read or skip)."""
        return self._view[self._start : self._end]

    def skip(self, count: int) -> None:
        """Take ``count`` unread bytes that were handled in place (see :meth:`unread`)."""
        assert count <= self._end - self._start
        self._start += count

    async def _receive(self, count: int) -> None:
        """Read until ``count`` unread bytes are buffered."""
        self._make_room(count)
        while self._end - self._start < count:
            try:
                # fileno() each time: -1 (EBADF, an OSError) once the socket is closed, never a
                # number the process has since given to another file
                received = os.readv(self._sock.fileno(), [self._view[self._end :]])
            except BlockingIOError:
                self._reads_without_yield = 0
                await trio.lowlevel.wait_readable(self._sock)
                continue
            if not received:
                raise ConnectionEnded(
                    f"connection closed with {self._end - self._start} of {count} expected "
                    "bytes received"
                )
            self._end += received
            self._reads_without_yield += 1
            if self._reads_without_yield >= READS_BETWEEN_CHECKPOINTS:
                self._reads_without_yield = 0
                await trio.lowlevel.checkpoint()

    def _make_room(self, count: int) -> None:
        """Make the buffer able to hold ``count`` unread bytes from its start, with room for
        a read of some size after them."""
        unread = self._view[self._start : self._end]
        if count > len(self._buffer) or (not unread and len(self._buffer) > KEPT_BUFFER_SIZE):
            self._new_buffer(max(count, RECEIVE_SIZE), keep=unread)
        elif (
            not unread
            or self._start + count > len(self._buffer)
            or len(self._buffer) - self._end < MIN_READ_SIZE
        ):
            self._view[: len(unread)] = unread  # to the front: usually a few bytes, or none
            self._start, self._end = 0, len(unread)


def write_without_waiting(sock_fd: int, data: bytes | memoryview) -> int:
    """Write ``data`` to the non-blocking socket ``sock_fd`` until it would block: the bytes
    written. Raises ``trio.BrokenResourceError`` if the connection broke."""
    view = memoryview(data)
    written = 0
    try:
        while written < len(view):
            written += os.write(sock_fd, view[written:])
    except BlockingIOError:
        pass
    except OSError as err:
        raise trio.BrokenResourceError(f"send: {err}") from err
    return written


def sendfile_without_waiting(sock_fd: int, fd: int, offset: int, count: int) -> int:
    """Send the file ``fd`` from ``offset`` towards ``count`` with ``os.sendfile`` until the
    non-blocking socket ``sock_fd`` would block: the offset reached. Raises
    ``trio.BrokenResourceError`` if the connection broke or the file ended first (it was
    truncated under us): the answer's head already announced ``count`` bytes, so the
    connection must be closed."""
    while offset < count:
        try:
            sent = os.sendfile(sock_fd, fd, offset, count - offset)
        except BlockingIOError:
            return offset
        except OSError as err:
            raise trio.BrokenResourceError(f"sendfile: {err}") from err
        if sent == 0:
            raise trio.BrokenResourceError(f"the block file ended after {offset} of {count} bytes")
        offset += sent
    return offset


async def send_file(sock: trio.socket.SocketType, fd: int, count: int, offset: int = 0) -> None:
    """Send the file ``fd`` from ``offset`` to ``count`` with ``os.sendfile``: the kernel
    moves them from the page cache to the socket, never through a Python object. Raises
    ``trio.BrokenResourceError`` as :func:`sendfile_without_waiting` does."""
    while (offset := sendfile_without_waiting(sock.fileno(), fd, offset, count)) < count:
        await trio.lowlevel.wait_writable(sock)
    await trio.lowlevel.checkpoint()
