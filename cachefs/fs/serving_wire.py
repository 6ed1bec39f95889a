"""The frames between the worker and its serving processes (cachefs/fs/serving.py): a 4-byte
length, then a pickled tuple. Both ends are this code, started by the worker for itself over a
socketpair, so pickle is safe here and never crosses a machine.

Two channels per serving process, each a socketpair:

* **calls** (the serving process asks, the worker answers): ``(call_id, op, args)``, answered
  ``(call_id, True, value)`` or ``(call_id, False, errno)``. Many calls are in flight at once;
  answers come in any order.
* **table** (the worker tells, the serving process applies to its native table):
  ``(function, args, wants_answer)``, a pyfuse3 ``fast_*`` function and its arguments, answered
  ``(True, value)`` or ``(False, message)`` when ``wants_answer``; the others are not answered,
  and the stream keeps their order. Three changes are not ``fast_*`` functions but the peer
  connections the serving process reads other workers' blocks on, each named by a *link* id
  (the worker's, never reused): ``peer_open (link, max_length, timeout_s)`` comes with the
  connection's socket (SCM_RIGHTS, :func:`send_frame_with_fd`), ``peer_route (ino, link, frame,
  length)`` and ``peer_close (link,)``. The serving process says on the calls channel when it
  closed a link itself: ``peer_closed (link, why)``, ``why`` the binding's CFR_PEER_* fault,
  :data:`PEER_TIMED_OUT` or :data:`PEER_ENDED_IDLE`.

Kept free of pyfuse3 and trio: the serving process imports it before anything heavy.
"""

from __future__ import annotations

import array
import pickle
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("<I")
#: The largest frame either side accepts (a READ's reply is at most 1 MiB, a listing page less).
MAX_FRAME = 64 << 20
#: ``peer_closed``'s reason for a link closed because an answer was not back within the
#: timeout (the binding's CFR_PEER_* faults are all above 0).
PEER_TIMED_OUT = 0
#: ``peer_closed``'s reason for a connection the owner closed while nothing was pending on it:
#: not a failure (the serving process is given another).
PEER_ENDED_IDLE = -1
#: Descriptors one receive takes at most (one frame carries one).
_MAX_FDS = 4


class FrameError(Exception):
    """A frame that cannot be right (too long): the channel is closed."""


def frame(message: Any) -> bytes:
    """``message`` as one frame."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


class FrameReader:
    """Splits received bytes into messages (sans-IO: feed it what a receive returned)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buffer = self._buffer
        buffer += data
        messages = []
        at = 0
        while len(buffer) - at >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(buffer, at)
            if length > MAX_FRAME:
                raise FrameError(f"frame of {length} bytes (most {MAX_FRAME})")
            end = at + _LENGTH.size + length
            if len(buffer) < end:
                break
            messages.append(pickle.loads(memoryview(buffer)[at + _LENGTH.size : end]))
            at = end
        del buffer[:at]
        return messages


def send_frame_with_fd(sock: socket.socket, message: Any, fd: int) -> None:
    """``message`` as one frame on a blocking AF_UNIX socket, with a duplicate of descriptor
    ``fd`` attached to its first byte (the receiver gets it with that frame)."""
    data = frame(message)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
    sent = sock.sendmsg([data], rights)
    if sent < len(data):
        sock.sendall(data[sent:])


def receive_frame(sock: socket.socket, fds: list[int] | None = None) -> Any:
    """The next message on a blocking socket; EOFError when the other side closed it. With
    ``fds``, the descriptors that came with the frame are appended to it (the caller's to
    close); without, none is accepted."""
    head = _receive_exactly(sock, _LENGTH.size, fds)
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes (most {MAX_FRAME})")
    return pickle.loads(_receive_exactly(sock, length, fds))


def _receive_exactly(sock: socket.socket, size: int, fds: list[int] | None) -> bytes:
    view = memoryview(bytearray(size))
    got = 0
    room = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize) if fds is not None else 0
    while got < size:
        if fds is None:
            n = sock.recv_into(view[got:])
        else:
            n, ancillary, _, _ = sock.recvmsg_into([view[got:]], room)
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    received = array.array("i")
                    received.frombytes(data[: len(data) - len(data) % received.itemsize])
                    fds.extend(received)
        if n == 0:
            raise EOFError("the other side closed the channel")
        got += n
    return view.tobytes()
