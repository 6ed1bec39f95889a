"""The peer protocol's socket plumbing on real sockets: exact reads across every way the bytes
can arrive, a cancelled read, a connection closed mid-frame, a frame larger than the buffer, a
reader that is never made to wait, and a block sent from its file."""

from __future__ import annotations

import os
import random
import socket

import pytest
import trio

from cachefs.peer import stream
from cachefs.peer.stream import ConnectionEnded, FrameReader, send_file


async def test_frames_are_exact_however_the_bytes_arrive():
    """Frames inside one received part, equal to one, spanning several, and of zero bytes,
    with the sender's writes cut at random places: every frame is its own bytes."""
    rng = random.Random(5)
    frames = [rng.randbytes(rng.choice([0, 1, 7, 300, 70_000, 300_000])) for _ in range(120)]
    stream = b"".join(frames)
    reader_sock, writer_sock = trio.socket.socketpair()
    received: list[bytes] = []

    async def write() -> None:
        view = memoryview(stream)
        while view:
            cut = rng.randint(1, 200_000)
            await writer_sock.send(view[:cut])
            view = view[cut:]
            await trio.sleep(0)

    async def read() -> None:
        reader = FrameReader(reader_sock)
        for frame in frames:
            received.append(await reader.exactly(len(frame)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        nursery.start_soon(read)
    assert [len(got) for got in received] == [len(frame) for frame in frames]
    assert received == frames
    assert all(type(got) is bytes for got in received)
    reader_sock.close()
    writer_sock.close()


async def test_a_cancelled_read_loses_nothing():
    """A read cancelled while it waits for the rest of a frame keeps what arrived: the next
    read gets the whole frame."""
    reader_sock, writer_sock = trio.socket.socketpair()
    reader = FrameReader(reader_sock)
    await writer_sock.send(b"abc")
    with trio.move_on_after(0.05):
        await reader.exactly(6)
    await writer_sock.send(b"def" + b"gh")
    assert await reader.exactly(6) == b"abcdef"
    assert await reader.exactly(2) == b"gh"
    reader_sock.close()
    writer_sock.close()


async def test_a_frame_larger_than_the_buffer_arrives_whole_and_the_buffer_is_given_back():
    """A 6 MiB frame (the buffer grows for it) between two small ones, all exact; once it has
    been read the reader no longer holds a buffer of its size."""
    rng = random.Random(9)
    frames = [b"head", rng.randbytes(6 << 20), b"tail"]
    reader_sock, writer_sock = trio.socket.socketpair()
    reader = FrameReader(reader_sock)
    received = []

    async def write() -> None:
        for frame in frames:
            view = memoryview(frame)
            while view:
                view = view[await writer_sock.send(view) :]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        for frame in frames:
            received.append(await reader.exactly(len(frame)))
    assert received == frames
    assert reader.buffer_size <= stream.KEPT_BUFFER_SIZE
    reader_sock.close()
    writer_sock.close()


async def test_a_reader_never_made_to_wait_still_lets_other_tasks_run(monkeypatch):
    """Bytes that trickle in one at a time, each already there when asked for (the socket
    never says "would block"): the reader still yields to the other tasks every
    READS_BETWEEN_CHECKPOINTS reads, so a busy connection cannot starve the node."""
    real_readv = os.readv
    monkeypatch.setattr(stream.os, "readv", lambda fd, buffers: real_readv(fd, [buffers[0][:1]]))
    reader_sock, writer_sock = trio.socket.socketpair()
    payload = bytes(range(200))
    await writer_sock.send(payload)
    reader = FrameReader(reader_sock)
    other_task_ran = 0

    async def other_task() -> None:
        nonlocal other_task_ran
        while True:
            other_task_ran += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.lowlevel.checkpoint()  # let it start
        started = other_task_ran
        assert await reader.exactly(len(payload)) == payload
        ran_meanwhile = other_task_ran - started
        nursery.cancel_scope.cancel()
    assert ran_meanwhile >= len(payload) // stream.READS_BETWEEN_CHECKPOINTS - 1
    reader_sock.close()
    writer_sock.close()


async def test_a_closed_socket_is_an_error_never_the_bytes_of_the_file_that_took_its_number():
    """A connection closed under its reader (a peer marked down) makes the next read fail,
    even once the process has given the socket's descriptor number to another socket with
    bytes waiting: the reader never reads a descriptor it no longer owns."""
    reader_sock, writer_sock = trio.socket.socketpair()
    reader = FrameReader(reader_sock)
    number = reader_sock.fileno()
    reader_sock.close()
    other, other_writer = socket.socketpair()  # the lowest free numbers: the closed one first
    try:
        assert number in (other.fileno(), other_writer.fileno())
        other_writer.send(b"other")
        other.send(b"other")
        with pytest.raises(OSError):
            await reader.exactly(5)
    finally:
        other.close()
        other_writer.close()
        writer_sock.close()


async def test_a_closed_connection_mid_frame_says_how_much_arrived():
    reader_sock, writer_sock = trio.socket.socketpair()
    reader = FrameReader(reader_sock)
    await writer_sock.send(b"12345")
    writer_sock.close()
    try:
        await reader.exactly(10)
    except ConnectionEnded as err:
        assert "5 of 10" in str(err)
    else:
        raise AssertionError("a frame cut short was returned")
    reader_sock.close()


async def test_a_block_sent_from_its_file_follows_its_head_whole(tmp_path):
    """An answer's head, then its block with send_file (os.sendfile over TCP on loopback): the
    reader gets both, in order and whole."""
    block = random.Random(3).randbytes(300_000)
    path = tmp_path / "block"
    path.write_bytes(block)
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    client = trio.socket.socket()
    await client.connect(listener.getsockname())
    server, _ = await listener.accept()
    fd = os.open(path, os.O_RDONLY)
    try:
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await server.send(b"HEAD")
                await send_file(server, fd, len(block))

            nursery.start_soon(send)
            reader = FrameReader(client)
            assert await reader.exactly(4) == b"HEAD"
            assert await reader.exactly(len(block)) == block
    finally:
        os.close(fd)
        for sock in (client, server, listener):
            sock.close()
