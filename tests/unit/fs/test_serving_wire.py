"""The frames between the worker and its serving processes (cachefs/fs/serving_wire.py)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from cachefs.fs.serving_wire import (
    MAX_FRAME,
    FrameError,
    FrameReader,
    frame,
    receive_frame,
    send_frame_with_fd,
)

MESSAGES = [
    (0, "lookup", (1 << 40, b"caf\xc3\xa9 \n/..\x00x")),
    (1, True, {"st_ino": 7, "st_size": 1 << 33}),
    ("fast_read_register", (5, 0, 1 << 20, 12, 9, b"/dev/shm/x", 12, b"\x01" * 8), False),
    (2, False, 5),
    b"",
]


def test_a_stream_split_anywhere_gives_back_every_message_in_order():
    stream = b"".join(frame(message) for message in MESSAGES)
    for piece in (1, 2, 3, 7, 64, len(stream)):
        reader = FrameReader()
        got = []
        for at in range(0, len(stream), piece):
            got.extend(reader.feed(stream[at : at + piece]))
        assert got == MESSAGES


def test_a_frame_longer_than_the_limit_is_refused_before_it_is_buffered():
    reader = FrameReader()
    with pytest.raises(FrameError, match="most"):
        reader.feed(struct.pack("<I", MAX_FRAME + 1) + b"x")


def test_a_blocking_socket_receives_frames_then_eof_when_closed():
    ours, theirs = socket.socketpair()
    big = (3, True, b"r" * (3 << 20))  # more than one receive takes

    def send() -> None:
        for message in (*MESSAGES, big):
            theirs.sendall(frame(message))
        theirs.close()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert [receive_frame(ours) for _ in range(len(MESSAGES) + 1)] == [*MESSAGES, big]
        with pytest.raises(EOFError):
            receive_frame(ours)
    finally:
        sender.join()
        ours.close()


def test_a_length_past_the_limit_on_a_socket_raises():
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(struct.pack("<I", MAX_FRAME + 1))
        with pytest.raises(FrameError):
            receive_frame(ours)


def test_a_descriptor_passed_with_a_frame_arrives_with_that_frame_only():
    """peer_open's connection (SCM_RIGHTS) comes with its own frame, between others."""
    ours, theirs = socket.socketpair()
    owner, connection = socket.socketpair()  # stands for a connection to an owner
    try:
        ours.sendall(frame(("peer_route", (1, 1, b"f", 9), False)))
        send_frame_with_fd(ours, ("peer_open", (3, 1 << 20, 2.0), False), connection.fileno())
        ours.sendall(frame(("peer_close", (3,), False)))
        got = []
        for _ in range(3):
            fds: list[int] = []
            got.append((receive_frame(theirs, fds)[0], fds))
        assert [(name, len(fds)) for name, fds in got] == [
            ("peer_route", 0), ("peer_open", 1), ("peer_close", 0)]  # fmt: skip
        received = socket.socket(fileno=got[1][1][0])
        with received:  # a duplicate of the same connection
            received.sendall(b"ping")
            assert owner.recv(4) == b"ping"
    finally:
        for sock in (ours, theirs, owner, connection):
            sock.close()
