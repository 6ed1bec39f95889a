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
  and the stream keeps their order.

Kept free of pyfuse3 and trio: the serving process imports it before anything heavy.
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

_LENGTH = struct.Struct("<I")
#: The largest frame either side accepts (a READ's reply is at most 1 MiB, a listing page less).
MAX_FRAME = 64 << 20


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


def receive_frame(sock: socket.socket) -> Any:
    """The next message on a blocking socket; EOFError when the other side closed it."""
    head = _receive_exactly(sock, _LENGTH.size)
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes (most {MAX_FRAME})")
    return pickle.loads(_receive_exactly(sock, length))


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    view = memoryview(bytearray(size))
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the other side closed the channel")
        got += n
    return view.tobytes()
