"""Socket plumbing both ends of a peer connection share: exact reads, and sendfile on trio."""

from __future__ import annotations

import os

import trio

#: Bytes asked of the socket per receive: a 128 KiB block usually arrives in one or two.
RECEIVE_SIZE = 256 << 10


class ConnectionEnded(Exception):
    """The other end closed the connection (mid-frame, or between frames)."""


class FrameReader:
    """Reads exact byte counts from a trio socket, keeping what arrived beyond them.

    A receive that trio cancels returns nothing and loses nothing, so the buffer always holds
    whole, unread bytes: a reader cancelled between two reads leaves the stream consistent.
    """

    def __init__(self, sock: trio.socket.SocketType):
        self._sock = sock
        self._buffer = bytearray()

    async def exactly(self, count: int) -> bytes:
        buffer = self._buffer
        while len(buffer) < count:
            chunk = await self._sock.recv(max(RECEIVE_SIZE, count - len(buffer)))
            if not chunk:
                raise ConnectionEnded(
                    f"connection closed with {len(buffer)} of {count} expected bytes received"
                )
            buffer += chunk
        data = bytes(buffer[:count])
        del buffer[:count]
        return data


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
