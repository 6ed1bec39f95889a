"""The peer protocol's socket plumbing on real sockets: exact reads across every way the bytes
can arrive, a cancelled read, a connection closed mid-frame, and a block sent from its file."""

from __future__ import annotations

import os
import random

import trio

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
