"""Peer requests answered by the native table (cachefs_fast_read.c, "peer answers"), without a
mount or a worker: over a real socket pair, with block files on a real tmpfs (/dev/shm, where
the RAM tier lives). What it answers is byte for byte what the Python server answers; what it
must not answer (another version of the file, a forgotten or corrupt block, a frame not all
received, a full socket) it leaves to the server. The server's use of it is tested end to end
by the cluster tests (tests/e2e/cluster/test_distributed.py)."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import pytest

from cachefs.cache.base import CHUNK_SIZE, chunk_checksums
from cachefs.fs.fuse_ops import FAST_READ_SUPPORTED
from cachefs.peer import wire
from cachefs.peer.base import BlockRequest

pytestmark = pytest.mark.skipif(
    not FAST_READ_SUPPORTED, reason="stock pyfuse3: run scripts/setup.sh to build the patched one"
)

INO = (3 << 48) | 17
BLOCK_SIZE = 1 << 20


@pytest.fixture
def tier():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as root:
        yield root


@pytest.fixture
def pair():
    """A loopback TCP connection, as between two workers: (owner's end, asker's end)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        asker = socket.create_connection(listener.getsockname())
        owner, _ = listener.accept()
    owner.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)  # two answers fit
    owner.setblocking(False)  # as trio's sockets are
    yield owner, asker
    owner.close()
    asker.close()


def put_block(table, tier: str, data: bytes, *, file_id: int = 1, etag: str = "e1") -> str:
    """A one-block file of ``data`` registered as cachefs registers a RAM-tier block."""
    path = os.path.join(tier, f"block-{file_id}")
    with open(path, "wb") as f:
        f.write(data)
    st = os.stat(path)
    assert table.register(
        INO, 0, BLOCK_SIZE, len(data), file_id, path.encode(), len(data), chunk_checksums(data),
        st.st_ino, st.st_ctime_ns,
    )  # fmt: skip
    assert table.register_peer_name(
        INO, wire.file_identity("imagenet", etag, "train/n01/a.JPEG", len(data), BLOCK_SIZE)
    )
    return path


def request(request_id: int, size: int, *, etag: str = "e1", cached_only: bool = False) -> bytes:
    req = BlockRequest("imagenet", "train/n01/a.JPEG", etag, size, 0, BLOCK_SIZE, cached_only)
    return wire.encode_request(request_id, req)


def receive_exactly(sock: socket.socket, count: int) -> bytes:
    parts, got = [], 0
    while got < count:
        part = sock.recv(count - got)
        assert part, "the connection ended early"
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def receive_answer(sock: socket.socket) -> tuple[int, int, bytes, bytes]:
    request_id, status, chunk_size, sums_len, body_len = wire.ANSWER.unpack(
        receive_exactly(sock, wire.ANSWER.size)
    )
    assert chunk_size in (0, CHUNK_SIZE)
    return request_id, status, receive_exactly(sock, sums_len), receive_exactly(sock, body_len)


def test_requests_for_registered_blocks_are_answered_in_order_byte_for_byte(table, tier, pair):
    owner, asker = pair
    data = os.urandom(140_000)  # two chunks, the last one short
    put_block(table, tier, data)
    served = table.stats()["peer_answers"]
    plain, cached_only = request(7, len(data)), request(8, len(data), cached_only=True)
    unknown = request(9, len(data), etag="e2")  # another version of the file: not ours
    frames = plain + cached_only + unknown + plain[:10]
    consumed, answered, plain_inos, partial = table.answer_peers(
        owner.fileno(), memoryview(frames), 64
    )
    assert (consumed, answered, plain_inos, partial) == (len(plain) * 2, 2, [INO], None)
    for request_id in (7, 8):
        assert receive_answer(asker) == (request_id, wire.OK, chunk_checksums(data), data)
    assert table.stats()["peer_answers"] - served == 2
    # The server takes the unknown frame itself, then offers the rest again: still incomplete.
    assert table.answer_peers(owner.fileno(), memoryview(plain[:10]), 64)[:2] == (0, 0)
    assert table.answer_peers(owner.fileno(), memoryview(b""), 64)[:2] == (0, 0)


def test_a_corrupt_or_forgotten_block_is_left_to_the_server(table, tier, pair):
    owner, _ = pair
    data = os.urandom(200_000)
    path = put_block(table, tier, data)
    corrupt = table.stats()["corrupt"]
    with open(path, "r+b") as f:  # a write moves the ctime: the chunks are checked again
        f.seek(150_000)
        f.write(b"\xff" if data[150_000] != 0xFF else b"\0")
    assert table.answer_peers(owner.fileno(), memoryview(request(1, len(data))), 64)[:2] == (0, 0)
    assert table.stats()["corrupt"] - corrupt == 1
    assert table.stats()["blocks"] == 0 and table.stats()["peer_names"] == 0

    put_block(table, tier, data, file_id=2)
    table.forget_file(2)  # what the cache calls before it removes the block file
    assert table.answer_peers(owner.fileno(), memoryview(request(1, len(data))), 64)[:2] == (0, 0)
    assert table.stats()["peer_names"] == 0


def test_an_answer_the_socket_does_not_take_whole_is_handed_back(table, tier, pair):
    owner, asker = pair
    owner.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    data = os.urandom(BLOCK_SIZE)
    put_block(table, tier, data)
    consumed, answered, _, partial = table.answer_peers(
        owner.fileno(), memoryview(request(5, len(data)) * 2), 64
    )
    assert (consumed, answered) == (len(request(5, len(data))), 1)  # not the second one
    head, fd, length, sent = partial
    try:
        assert length == len(data) and 0 < sent < len(head) + length
        expected_head = wire.encode_answer(5, wire.OK, CHUNK_SIZE, chunk_checksums(data), len(data))
        assert head == expected_head

        def send_the_rest() -> None:  # as the server's task does once the socket drains
            owner.setblocking(True)
            owner.sendall(head[sent:])
            at = max(0, sent - len(head))
            while at < length:
                at += os.sendfile(owner.fileno(), fd, at, length - at)

        sender = threading.Thread(target=send_the_rest)
        sender.start()
        answer = receive_exactly(asker, len(head) + length)
        sender.join(timeout=60)
        assert not sender.is_alive()
    finally:
        os.close(fd)
    assert answer == expected_head + data


def test_a_full_socket_takes_no_frame(table, tier, pair):
    owner, _ = pair
    data = os.urandom(4096)
    put_block(table, tier, data)
    try:
        while True:
            owner.send(b"x" * 65536)
    except BlockingIOError:
        pass
    assert table.answer_peers(owner.fileno(), memoryview(request(1, len(data))), 64) == (
        0, 0, [], None
    )  # fmt: skip
