"""The peer block protocol over real sockets: PeerServer serving, PeerClient reading.

Failure cases use real misbehaving peers: a closed port, a listener that accepts and never
answers, a hand-written server that speaks the protocol but answers wrongly (lengths, checksums,
framing, version), owners whose block bytes no longer match the checksums recorded when they
admitted it (a real TieredBlockCache whose block file was changed on disk), and owner processes
killed or stopped mid-transfer.
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import CHUNK_SIZE, BlockKey, CheckedBlock, OpenBlock, chunk_checksums
from cachefs.errors import CachefsError, ObjectNotFound
from cachefs.peer import wire
from cachefs.peer.base import (
    BlockRequest,
    NativeAnswers,
    NotCached,
    PeerError,
    PeerRefused,
    PeerUnavailable,
)
from cachefs.peer.client import PeerClient, open_peer_client
from cachefs.peer.server import PeerServer
from cachefs.peer.stream import (
    ConnectionEnded,
    FrameReader,
    sendfile_without_waiting,
    write_without_waiting,
)
from tests.damage import flip_byte
from tests.waiting import wait_until

TOKEN = "s3cret-token"
MIB = 1 << 20


class FakeOwner:
    """``serve_block`` over in-memory objects, recording every request it is asked."""

    def __init__(self, objects: dict[str, bytes] | None = None):
        self.objects = objects or {}
        self.requests: list[BlockRequest] = []

    async def serve_block(self, req: BlockRequest) -> CheckedBlock:
        self.requests.append(req)
        data = self.objects[req.key]  # KeyError (a LookupError) → not this node's file
        start = req.index * req.block_size
        return CheckedBlock.of(data[start : start + req.block_size])


def request_for(key: str, data: bytes, index: int = 0, block_size: int = MIB) -> BlockRequest:
    return BlockRequest("ds", key, '"etag-1"', len(data), index, block_size)


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    return sock


@asynccontextmanager
async def served(serve_block, host: str = "127.0.0.1", **kwargs) -> AsyncIterator[str]:
    """A real PeerServer on ``host``; yields its "host:port"."""
    server = PeerServer(serve_block, TOKEN, **kwargs)
    sock = listening_socket(host)
    address = f"{host}:{sock.getsockname()[1]}"
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, sock)
        served.server = server
        yield address
        nursery.cancel_scope.cancel()


class Hangup(bytes):
    """An answer after which the misbehaving server closes the connection."""


Answer = Callable[[int, BlockRequest], Awaitable[bytes]]


@asynccontextmanager
async def misbehaving(answer: Answer, *, welcome: bytes | None = None) -> AsyncIterator[str]:
    """A server that shakes hands (with ``welcome``, if given, instead of the right one) and
    answers each request with whatever ``answer(request_id, request)`` returns."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def handle(stream: trio.SocketStream) -> None:
        reader = FrameReader(stream.socket)
        _, _, token_len = wire.HELLO.unpack(await reader.exactly(wire.HELLO.size))
        await reader.exactly(token_len)
        await stream.send_all(welcome or wire.WELCOME.pack(wire.MAGIC, wire.VERSION, 0))
        try:
            while True:
                head = await reader.exactly(wire.REQUEST.size)
                names = await reader.exactly(wire.request_names_length(head))
                request_id, request = wire.decode_request(head, names)
                reply = await answer(request_id, request)
                await stream.send_all(reply)
                if isinstance(reply, Hangup):
                    await stream.aclose()
                    return
        except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionEnded):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        yield f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


def good_answer(request_id: int, data: bytes, *, sums: bytes | None = None) -> bytes:
    sums = chunk_checksums(data) if sums is None else sums
    return wire.encode_answer(request_id, wire.OK, CHUNK_SIZE, sums, len(data)) + data


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
async def test_round_trip_full_and_last_short_block(host):
    data = random.randbytes(2 * MIB + 12345)
    owner = FakeOwner({"obj": data})
    async with served(owner.serve_block, host) as address, open_peer_client(TOKEN) as client:
        assert await client.get_block(address, request_for("obj", data, 0)) == data[:MIB]
        last = await client.get_block(address, request_for("obj", data, 2))
        assert client.open_connections == 1
    assert last == data[2 * MIB :]
    assert len(last) == 12345


@pytest.mark.parametrize(
    "key",
    [
        b"raw\xff\xfe\x80bytes".decode("utf-8", "surrogateescape"),
        "a b?c#d%e\n",
        "日本/ñandú/🙂.jpg",
        "%2F/../+&=;",
        "",
    ],
)
@pytest.mark.parametrize("etag", ['"e t&ag"', ""])
async def test_hostile_keys_arrive_unchanged(key, etag):
    data = random.randbytes(5000)
    owner = FakeOwner({key: data})
    req = BlockRequest("ds name&?", key, etag, len(data), 0, 4096)
    async with served(owner.serve_block) as address, open_peer_client(TOKEN) as client:
        assert await client.get_block(address, req) == data[:4096]
    assert owner.requests == [req]


async def test_many_requests_in_flight_share_one_connection_and_answer_out_of_order():
    """Sixteen concurrent requests, the first one held until all others were answered: every
    reader gets its own block, byte for byte, over a single connection."""
    blocks = {f"k{i}": random.randbytes(4096 + i) for i in range(16)}
    first_may_answer = trio.Event()
    answered = 0

    async def serve(req: BlockRequest) -> CheckedBlock:
        nonlocal answered
        if req.key == "k0":
            await first_may_answer.wait()
        answered += 1
        if answered == 15:
            first_may_answer.set()
        return CheckedBlock.of(blocks[req.key][: req.length])

    results: dict[str, bytes] = {}
    async with served(serve) as address, open_peer_client(TOKEN) as client:

        async def read(key: str) -> None:
            req = BlockRequest("ds", key, "e", len(blocks[key]), 0, 64 * 1024)
            results[key] = await client.get_block(address, req)

        async with trio.open_nursery() as nursery:
            for key in blocks:
                nursery.start_soon(read, key)
        assert client.open_connections == 1
        assert served.server.connections == 1
    assert results == blocks


async def test_requests_sent_while_the_socket_is_full_arrive_whole_and_each_is_answered():
    """A request is written at once when nothing else is being sent; what a full socket does
    not take is sent under the connection's lock, after which later requests queue. Here the
    owner reads nothing after the first request until the client's socket is full and
    requests queue behind the lock (64 KiB keys); more requests are asked while those are
    sent. Every frame reaches the owner whole and in one piece, and every reader gets its own
    block, byte for byte."""
    keys = [f"{i:03d}-" + "k" * (60_000 + i) for i in range(48)]
    blocks = {key: random.randbytes(4096 + i) for i, key in enumerate(keys)}
    may_read = trio.Event()
    seen: list[str] = []

    async def respond(request_id: int, request: BlockRequest) -> bytes:
        await may_read.wait()  # holding the first request: nothing more is read till then
        seen.append(request.key)
        return good_answer(request_id, blocks[request.key])

    results: dict[str, bytes] = {}
    async with misbehaving(respond) as address, open_peer_client(TOKEN, timeout_s=60) as client:

        async def read(key: str) -> None:
            req = BlockRequest("ds", key, "e", len(blocks[key]), 0, 64 * 1024)
            results[key] = await client.get_block(address, req)

        async with trio.open_nursery() as readers:
            for key in keys[:32]:
                readers.start_soon(read, key)
            await wait_until(
                lambda: (
                    address in client._connections
                    and client._connections[address]._send_lock.statistics().tasks_waiting > 0
                ),
                "requests queued behind a partly written one",
                timeout=60,
            )
            may_read.set()
            for key in keys[32:]:  # asked while the queued ones are still being sent
                readers.start_soon(read, key)
                await trio.lowlevel.checkpoint()
    assert results == blocks
    assert sorted(seen) == sorted(keys)


class FileAnswerer:
    """``answer_natively`` as the owner's native table does it (cachefs_fast_read.c, "peer
    answers"), in Python over real block files: each whole frame at the front answered with a
    head and ``sendfile`` while the socket takes it, the last one handed back as ``partial``
    when it did not take it whole, a frame the socket takes nothing of left unconsumed. The C
    side itself is tested in tests/unit/fs/test_native_peer_answers.py and, through a cluster,
    in tests/e2e/cluster/test_distributed.py; this stands in for it below the server's seam.
    The socket's send buffer is made 256 KiB, so that a 1 MiB answer does not go out whole
    (much smaller buffers make loopback TCP stall for seconds)."""

    def __init__(self, files: dict[str, str]):
        self.files = files  # key -> block file
        self.answered = 0
        self.partials = 0
        self.offers = 0

    def __call__(self, sock_fd: int, frames: memoryview, max_answers: int) -> NativeAnswers:
        sock = socket.socket(fileno=os.dup(sock_fd))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 * 1024)
        sock.close()
        self.offers += 1
        consumed = answered = 0
        while answered < max_answers and len(frames) - consumed >= wire.REQUEST.size:
            head = bytes(frames[consumed : consumed + wire.REQUEST.size])
            end = consumed + wire.REQUEST.size + wire.request_names_length(head)
            if end > len(frames):
                break
            request_id, req = wire.decode_request(head, bytes(frames[consumed + len(head) : end]))
            fd = os.open(self.files[req.key], os.O_RDONLY)
            data = os.pread(fd, os.fstat(fd).st_size, 0)
            answer = wire.encode_answer(request_id, wire.OK, CHUNK_SIZE, chunk_checksums(data),
                                        len(data))  # fmt: skip
            try:
                sent = write_without_waiting(sock_fd, answer)
                if 0 < sent == len(answer):
                    sent += sendfile_without_waiting(sock_fd, fd, 0, len(data))
            except BaseException:
                os.close(fd)
                raise
            if sent == 0:
                os.close(fd)
                break  # a full socket: this frame is the server's again
            consumed, answered = end, answered + 1
            self.answered += 1
            if sent < len(answer) + len(data):
                self.partials += 1
                return NativeAnswers(consumed, answered, (answer, fd, len(data), sent))
            os.close(fd)
        return NativeAnswers(consumed, answered, None)


async def test_requests_that_come_while_a_native_answer_is_still_sent_are_answered_natively(
    tmp_path,
):
    """While an answer the native table began is still going out (the socket was full), the
    requests that arrive meanwhile wait for the wire and are then offered to the native table:
    they go through ``serve_block`` (the Python path) only where the socket had no room left
    for the next answer's head, where before every request that came while an answer was being
    finished took it."""
    blocks = {f"k{i}": random.randbytes(MIB + 1000 * i) for i in range(24)}
    files = {}
    for key, data in blocks.items():
        files[key] = str(tmp_path / key)
        with open(files[key], "wb") as f:
            f.write(data)
    owner = FakeOwner(blocks)
    answerer = FileAnswerer(files)
    results: dict[str, bytes] = {}
    async with (
        served(owner.serve_block, answer_natively=answerer) as address,
        open_peer_client(TOKEN, timeout_s=60) as client,
    ):

        async def read(key: str) -> None:
            req = BlockRequest("ds", key, "e", len(blocks[key]), 0, 4 * MIB)
            results[key] = await client.get_block(address, req)

        async with trio.open_nursery() as readers:
            for key in blocks:
                readers.start_soon(read, key)
    assert results == blocks
    assert answerer.partials > 0  # the case this is about happened
    assert answerer.answered + len(owner.requests) == len(blocks)
    assert len(owner.requests) <= 2


async def test_a_batch_is_one_write_and_each_request_gets_its_own_outcome():
    data = random.randbytes(3 * 4096)
    owner = FakeOwner({"obj": data})
    batch = [request_for("obj", data, i, 4096) for i in range(3)]
    batch.append(request_for("missing", data, 0, 4096))
    async with served(owner.serve_block) as address, open_peer_client(TOKEN) as client:
        results = await client.get_blocks(address, batch)
    assert results[:3] == [data[:4096], data[4096:8192], data[8192:]]
    assert isinstance(results[3], PeerRefused) and results[3].status == 404
    assert not client.is_cooling(address)


async def test_wrong_token_and_other_versions_are_refused_with_a_clear_line(caplog):
    owner = FakeOwner({"obj": b"x" * 5000})
    req = request_for("obj", b"x" * 5000, block_size=4096)
    async with served(owner.serve_block) as address:
        async with open_peer_client("not-the-token") as client:
            with pytest.raises(PeerError, match="refused our token"):
                await client.get_block(address, req)
        # a client of another protocol version, by hand
        host, port = address.split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(wire.HELLO.pack(wire.MAGIC, wire.VERSION + 1, len(TOKEN)))
            await stream.send_all(TOKEN.encode())
            reply = await FrameReader(stream.socket).exactly(wire.WELCOME.size)
        assert wire.WELCOME.unpack(reply) == (wire.MAGIC, wire.VERSION, wire.HELLO_BAD_VERSION)
        # an HTTP client (or anything else) is dropped
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(b"GET /v1/blocks HTTP/1.1\r\nhost: x\r\n\r\n")
            assert await stream.receive_some() == b""
    assert owner.requests == []
    assert f"speaks block protocol version {wire.VERSION + 1}, this node speaks" in caplog.text
    # and the reader's side of a server of another version
    welcome = wire.WELCOME.pack(wire.MAGIC, wire.VERSION + 1, wire.HELLO_BAD_VERSION)

    async def never(request_id, request):
        raise AssertionError("no request may be sent")

    async with misbehaving(never, welcome=welcome) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerError, match=f"protocol version {wire.VERSION + 1}, not"):
            await client.get_block(address, req)
        assert client.is_cooling(address)
    assert re.search(
        rf"peer {address} speaks block protocol version {wire.VERSION + 1}", caplog.text
    )


async def test_a_client_that_never_finishes_its_handshake_is_dropped():
    owner = FakeOwner({"obj": b"x" * 5000})
    async with served(owner.serve_block, handshake_timeout_s=0.2) as address:
        host, port = address.split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            await stream.send_all(wire.HELLO.pack(wire.MAGIC, wire.VERSION, len(TOKEN)))
            assert await stream.receive_some() == b""  # closed, without a verdict
        await wait_until(lambda: served.server.connections == 0, "the connection to go")


async def test_an_impossible_request_is_refused_and_the_connection_lives_on():
    """The server answers a request whose fields make no block (here: past the object's end)
    and goes on serving the connection."""
    data = random.randbytes(5000)
    owner = FakeOwner({"obj": data})
    async with served(owner.serve_block) as address:
        host, port = address.split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        async with stream:
            reader = FrameReader(stream.socket)
            await stream.send_all(wire.hello(TOKEN))
            await reader.exactly(wire.WELCOME.size)
            bad = bytearray(wire.encode_request(7, request_for("obj", data, 0, 4096)))
            bad[22:30] = (5).to_bytes(8, "big")  # the block index: past the end
            await stream.send_all(
                bytes(bad) + wire.encode_request(8, request_for("obj", data, 1, 4096))
            )
            answers = {}
            for _ in range(2):
                request_id, status, _, sums_len, body_len = wire.ANSWER.unpack(
                    await reader.exactly(wire.ANSWER.size)
                )
                await reader.exactly(sums_len)
                answers[request_id] = status, await reader.exactly(body_len)
    assert answers[7][0] == wire.BAD_REQUEST and b"past the end" in answers[7][1]
    assert answers[8] == (wire.OK, data[4096:])


async def test_cached_only_reaches_the_owner_and_not_cached_is_refused():
    asked: list[bool] = []

    async def serve(req: BlockRequest) -> CheckedBlock:
        asked.append(req.cached_only)
        if req.cached_only:
            raise NotCached(req.key)
        return CheckedBlock.of(b"z" * req.length)

    req = request_for("obj", b"x" * 5000, block_size=4096)
    cached_only = BlockRequest(req.dataset, req.key, req.etag, req.size, 0, 4096, True)
    async with served(serve) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerRefused, match="404: not cached") as info:
            await client.get_block(address, cached_only)
        assert info.value.status == 404
        assert await client.get_block(address, req) == b"z" * 4096
        assert not client.is_cooling(address)
    assert asked == [True, False]


async def test_lookup_error_is_refused_without_cooldown():
    async with served(FakeOwner().serve_block) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerRefused, match="not this node's file") as info:
            await client.get_block(address, request_for("absent", b"x" * 10))
        assert info.value.status == 404
        assert not client.is_cooling(address)


async def test_cachefs_error_is_refused_with_its_message():
    async def failing(req: BlockRequest) -> CheckedBlock:
        raise ObjectNotFound("gone from the store", key=req.key)

    async with served(failing) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerRefused, match="gone from the store") as info:
            await client.get_block(address, request_for("obj", b"x" * 10))
        assert info.value.status == 503
        assert not client.is_cooling(address)


@pytest.mark.parametrize("result", ["short", "crash", "checksums-missing"])
async def test_owner_bug_is_an_error_and_no_bytes(result):
    async def buggy(req: BlockRequest) -> CheckedBlock:
        if result == "crash":
            raise RuntimeError("bug")
        if result == "short":
            return CheckedBlock.of(b"y" * (req.length - 1))
        return CheckedBlock(b"y" * req.length, b"")

    async with served(buggy) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerError, match="internal error") as info:
            await client.get_block(address, request_for("obj", b"x" * 10))
        assert not isinstance(info.value, PeerRefused)


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (lambda rid, d: good_answer(rid, d, sums=bytes(8)), "chunk 0"),
        (lambda rid, d: good_answer(rid, d, sums=b""), "0 chunk checksums, expected 1"),
        (
            lambda rid, d: wire.encode_answer(rid, wire.OK, 12, chunk_checksums(d), len(d)) + d,
            "chunk size 12 outside",
        ),
        (lambda rid, d: good_answer(rid, d + b"!"), "an answer of 4097 bytes for a 4096-byte"),
        (lambda rid, d: Hangup(good_answer(rid, d)[:-1]), "connection closed with 4095 of 4096"),
        (
            lambda rid, d: good_answer(rid, flipped(d, 1000), sums=chunk_checksums(d)),
            "checksum mismatch in chunk 0",
        ),
        (lambda rid, d: b"\xff" * wire.ANSWER.size, "garbage on the connection"),
        (lambda rid, d: wire.ANSWER.pack(rid, 99, 0, 0, 0), "unknown answer status 99"),
        (
            lambda rid, d: wire.ANSWER.pack(rid, wire.OK, CHUNK_SIZE, 8, 1 << 40),
            "larger than any block",
        ),
    ],
    ids=[
        "wrong-checksum",
        "no-checksums",
        "bad-chunk-size",
        "long-body",
        "short-body-then-close",
        "flipped-byte",
        "garbage",
        "unknown-status",
        "huge-length",
    ],
)
async def test_a_misbehaving_peer_is_an_error_then_cooldown_then_retry(answer, reason):
    data = random.randbytes(4096)
    asked = 0

    async def respond(request_id: int, request: BlockRequest) -> bytes | Hangup:
        nonlocal asked
        asked += 1
        return answer(request_id, data)

    req = request_for("obj", data, block_size=4096)
    async with (
        misbehaving(respond) as address,
        open_peer_client(TOKEN, cooldown_s=0.3, timeout_s=30) as client,
    ):
        with pytest.raises(PeerError, match=re.escape(reason)) as info:
            await client.get_block(address, req)
        assert not isinstance(info.value, PeerRefused | PeerUnavailable)
        assert client.is_cooling(address)
        with pytest.raises(PeerUnavailable, match=re.escape(address)):
            await client.get_block(address, req)
        assert asked == 1  # the cooled-down call never reached the peer
        await wait_until(lambda: not client.is_cooling(address), timeout=30)
        with pytest.raises(PeerError):
            await client.get_block(address, req)
        assert asked == 2


async def test_the_owner_sends_the_checksums_it_was_given_not_ones_of_what_it_read():
    """An owner whose bytes no longer match what it admitted (here: handed over with the
    checksums of the admitted bytes, as a cache's index gives them) is caught by the reader:
    the server computes nothing over what it sends."""
    admitted = random.randbytes(2 * CHUNK_SIZE)
    damaged = admitted[:CHUNK_SIZE] + b"\0" + admitted[CHUNK_SIZE + 1 :]

    async def damaged_owner(req: BlockRequest) -> CheckedBlock:
        return CheckedBlock(damaged, chunk_checksums(admitted))

    req = request_for("obj", admitted, block_size=4 * CHUNK_SIZE)
    async with served(damaged_owner) as address, open_peer_client(TOKEN) as client:
        with pytest.raises(PeerError, match="checksum mismatch in chunk 1 "):
            await client.get_block(address, req)
        assert client.is_cooling(address)


async def test_an_owner_serving_from_a_real_cache_sends_the_file_with_its_admitted_checksums(
    tmp_path,
):
    """The owner's side as the worker runs it: a RAM-tier block of a TieredBlockCache handed
    over as an open file (sent with sendfile) with the chunk checksums its index stored at
    admission. A block file changed on the owner's disk is caught there (dropped, counted
    corrupt) and never sent; no descriptor is left open."""
    data = random.randbytes(3 * CHUNK_SIZE + 1)
    key = BlockKey.make(1, "obj", '"etag-1"', 0)
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 8 << 20)]
    )
    handed: list[OpenBlock | CheckedBlock] = []

    async def owner(req: BlockRequest) -> OpenBlock | CheckedBlock:
        block = cache.open_verified(key, tier="ram")
        if block is None:
            raise NotCached(req.key)
        handed.append(block)
        return block

    fds_before = len(os.listdir("/proc/self/fd"))
    try:
        cache.put(key, data)
        req = request_for("obj", data, block_size=4 * CHUNK_SIZE)
        async with served(owner) as address, open_peer_client(TOKEN) as client:
            assert await client.get_block(address, req) == data
            flip_byte(cache.block_path(key), 2 * CHUNK_SIZE + 3)  # changed in place
            with pytest.raises(PeerRefused, match="not cached"):
                await client.get_block(address, req)
        assert isinstance(handed[0], OpenBlock)
        assert handed[0].chunk_checksums == chunk_checksums(data)
        assert len(handed) == 1
        assert cache.counters().corrupt == 1
        assert not cache.contains(key)
    finally:
        cache.close()
    with pytest.raises(OSError):
        os.fstat(handed[0].fd)  # the server closed the descriptor it was handed
    assert len(os.listdir("/proc/self/fd")) <= fds_before


async def test_the_largest_block_and_another_chunk_size_round_trip():
    """A 64 MiB block carries 512 chunk checksums; a peer whose chunks have another size
    (another version) is checked with the size it announces."""
    data = bytes(64 << 20)
    owner = FakeOwner({"big": data})
    req = request_for("big", data, block_size=64 << 20)
    async with (
        served(owner.serve_block) as address,
        open_peer_client(TOKEN, timeout_s=60) as client,
    ):
        assert await client.get_block(address, req) == data
    small = random.randbytes(3 * CHUNK_SIZE)

    async def other_chunks(request_id, request):
        sums = chunk_checksums(small, 65536)
        return wire.encode_answer(request_id, wire.OK, 65536, sums, len(small)) + small

    async with misbehaving(other_chunks) as address, open_peer_client(TOKEN) as client:
        req = request_for("small", small, block_size=4 * CHUNK_SIZE)
        assert await client.get_block(address, req) == small


async def test_mark_down_starts_cooldown():
    async with open_peer_client(TOKEN, cooldown_s=60) as client:
        client.mark_down("127.0.0.1:1")
        assert client.is_cooling("127.0.0.1:1")
        assert not client.is_cooling("127.0.0.1:2")
        with pytest.raises(PeerUnavailable):
            await client.get_block("127.0.0.1:1", request_for("obj", b"x" * 10))


async def test_dead_port_fails_fast():
    with socket.socket() as sock:  # a port nobody listens on: bound, then released
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    async with open_peer_client(TOKEN, timeout_s=30) as client:
        with pytest.raises(PeerError, match=r"Connection refused|OSError"):
            await client.get_block(address, request_for("obj", b"x" * 10))
        assert client.is_cooling(address)


async def test_a_client_that_is_not_running_fails_as_a_peer_error():
    client = PeerClient(TOKEN)
    with pytest.raises(PeerError, match="not running"):
        await client.get_block("127.0.0.1:1", request_for("obj", b"x" * 10))


async def test_stalled_peer_costs_at_most_the_timeout_once():
    """A peer that accepts the connection and never answers (e.g. SIGSTOPped): the requests in
    flight to it fail together after the timeout, later ones at once (cooling), and a healthy
    peer is not affected."""
    timeout_s = 0.5
    data = random.randbytes(5000)
    async with (
        served(FakeOwner({"obj": data}).serve_block) as healthy_address,
        trio.open_nursery() as nursery,
    ):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        accepted: list[trio.SocketStream] = []

        async def hold_forever(stream: trio.SocketStream) -> None:
            accepted.append(stream)
            await trio.sleep_forever()

        nursery.start_soon(trio.serve_listeners, hold_forever, listeners)
        address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        failures: list[PeerError] = []
        async with open_peer_client(TOKEN, timeout_s=timeout_s) as client:

            async def read() -> None:
                with pytest.raises(PeerError) as info:
                    await client.get_block(address, request_for("obj", b"x" * 10))
                failures.append(info.value)

            start = time.monotonic()
            async with trio.open_nursery() as readers:
                for _ in range(8):
                    readers.start_soon(read)
            elapsed = time.monotonic() - start
            assert client.is_cooling(address)
            req = request_for("obj", data, block_size=4096)
            assert await client.get_block(healthy_address, req) == data[:4096]
        nursery.cancel_scope.cancel()
    assert len(failures) == 8
    assert elapsed >= timeout_s - 0.05  # they did wait for the timeout, once, together
    assert len(accepted) == 1


async def test_max_inflight_answers_overloaded_at_once():
    release = trio.Event()
    started = 0

    async def slow(req: BlockRequest) -> CheckedBlock:
        nonlocal started
        started += 1
        await release.wait()
        return CheckedBlock.of(b"y" * req.length)

    req = request_for("obj", b"x" * 10000, block_size=4096)
    results: list[bytes] = []
    async with (
        served(slow, max_inflight=2) as address,
        open_peer_client(TOKEN) as client,
        trio.open_nursery() as nursery,
    ):

        async def fetch() -> None:
            results.append(await client.get_block(address, req))

        nursery.start_soon(fetch)
        nursery.start_soon(fetch)
        await wait_until(lambda: started == 2, timeout=30)
        with pytest.raises(PeerRefused, match=r"503: too many") as info:
            await client.get_block(address, req)
        assert info.value.status == 503
        assert not client.is_cooling(address)
        release.set()
    assert results == [b"y" * 4096] * 2
    assert started == 2


async def test_no_descriptor_or_connection_leaks_after_ten_thousand_transfers():
    """10,000 blocks over one client, with a server restart (every connection dropped) in the
    middle: the process's descriptors and connections come back to what they were."""
    blocks = [random.randbytes(1000 + i) for i in range(50)]
    owner = FakeOwner({f"k{i}": b for i, b in enumerate(blocks)})
    fds_before = len(os.listdir("/proc/self/fd"))
    async with open_peer_client(TOKEN, cooldown_s=0.0) as client:
        for _round in range(2):
            async with served(owner.serve_block) as address:
                async with trio.open_nursery() as nursery:

                    async def read(worker: int) -> None:
                        for n in range(worker, 5000, 16):
                            i = n % len(blocks)
                            req = BlockRequest("ds", f"k{i}", "e", len(blocks[i]), 0, 4096)
                            assert await client.get_block(address, req) == blocks[i]

                    for worker in range(16):
                        nursery.start_soon(read, worker)
                assert client.open_connections == 1
                assert served.server.connections == 1
    assert len(owner.requests) == 10_000
    assert len(os.listdir("/proc/self/fd")) == fds_before


class AtHandOwner:
    """``serve_cached_now`` over blocks at hand (each handed over as an open file of its own,
    as the RAM tier hands them) beside a FakeOwner's ``serve_block``, which serves every
    block (as a worker's does: it is the path for whatever is not answered inline)."""

    def __init__(self, tmp_path, at_hand: dict[str, bytes], elsewhere: dict[str, bytes]):
        self.files = {}
        for key, data in at_hand.items():
            path = tmp_path / f"block-{key}"
            path.write_bytes(data)
            self.files[key] = (str(path), chunk_checksums(data))
        self.slow = FakeOwner({**at_hand, **elsewhere})
        self.now: list[str] = []
        self.handed: list[int] = []

    def serve_cached_now(self, req: BlockRequest) -> OpenBlock | None:
        if req.key.startswith("raise"):
            raise RuntimeError("serve_cached_now failed")
        if req.key not in self.files:
            return None
        self.now.append(req.key)
        path, sums = self.files[req.key]
        fd = os.open(path, os.O_RDONLY)
        self.handed.append(fd)
        size = os.fstat(fd).st_size
        if req.key.startswith("short"):  # the owner's bug: a block shorter than asked
            size -= 1
        return OpenBlock(fd, size, sums)


async def test_blocks_at_hand_are_answered_inline_byte_exact_and_the_rest_as_before(
    tmp_path, monkeypatch
):
    """A server given ``serve_cached_now`` answers the blocks it has at hand from the
    connection's reader, inline: a 32 MiB block is written as far as the socket takes it and
    finished by a task. Under 16 concurrent readers every block arrives byte-exact, each request
    answered once, inline or (another answer being sent) through ``serve_block``; blocks not at
    hand, and those whose ``serve_cached_now`` raises, go through ``serve_block``; a block of
    the wrong length is an error, never bytes; every file handed over is closed."""
    from cachefs.peer import server as server_module

    writes: list[tuple[int, int]] = []  # (bytes written inline, bytes in the answer)
    send_without_waiting = server_module._send_without_waiting

    def spy(fd, head, block):  # the real function, its outcome recorded
        sent = send_without_waiting(fd, head, block)
        writes.append((sent, len(head) + block.size))
        return sent

    monkeypatch.setattr(server_module, "_send_without_waiting", spy)
    at_hand = {f"k{i}": random.randbytes(1000 + 997 * i) for i in range(40)}
    at_hand["big"] = random.randbytes(32 << 20)
    at_hand["short"] = random.randbytes(5000)
    elsewhere = {f"s{i}": random.randbytes(2000 + i) for i in range(10)}
    elsewhere["raise-1"] = random.randbytes(3000)
    owner = AtHandOwner(tmp_path, at_hand, elsewhere)
    everything = {**at_hand, **elsewhere}
    wanted = [key for key in everything if key != "short"]
    fds_before = len(os.listdir("/proc/self/fd"))

    def request(key: str) -> BlockRequest:
        return BlockRequest("ds", key, "e", len(everything[key]), 0, 32 << 20)

    async with (
        served(owner.slow.serve_block, serve_cached_now=owner.serve_cached_now) as address,
        open_peer_client(TOKEN, timeout_s=60) as client,
    ):
        assert await client.get_block(address, request("big")) == at_hand["big"]
        assert owner.now == ["big"] and not owner.slow.requests  # inline...
        assert writes[0][0] < writes[0][1]  # ... and finished by a task

        async def read(worker: int) -> None:
            for n in range(worker, 4 * len(wanted), 16):
                key = wanted[n % len(wanted)]
                assert await client.get_block(address, request(key)) == everything[key]

        async with trio.open_nursery() as nursery:
            for worker in range(16):
                nursery.start_soon(read, worker)
        with pytest.raises(PeerError, match="wrong block length") as refused:
            await client.get_block(address, request("short"))
        assert not isinstance(refused.value, PeerRefused)
    # Each request answered once, by one path or the other: inline while no other answer was
    # being sent (the 32 MiB ones hold the connection a while), else through serve_block.
    assert len(owner.now) + len(owner.slow.requests) == 1 + 4 * len(wanted) + 1
    assert len(owner.now) > 2  # inline answers among the concurrent reads too
    slow_keys = {req.key for req in owner.slow.requests}
    assert set(elsewhere) <= slow_keys  # not at hand, or raising: the usual path
    for fd in owner.handed:
        with pytest.raises(OSError):
            os.fstat(fd)  # closed by the server once sent
    assert len(os.listdir("/proc/self/fd")) <= fds_before


OWNER_SCRIPT = """
import socket, sys, trio
from cachefs.cache.base import CheckedBlock
from cachefs.peer.server import PeerServer

data = bytes(range(256)) * (64 << 12)  # 64 MiB: long enough a transfer to interrupt

async def serve(req):
    return CheckedBlock.of(data[: req.length])

async def main():
    sock = socket.socket()
    sock.bind(("127.0.0.3", 0))
    print(sock.getsockname()[1], flush=True)
    await PeerServer(serve, sys.argv[1]).serve(sock)

trio.run(main)
"""


@pytest.mark.parametrize("fault", ["kill", "stop"])
async def test_an_owner_killed_or_stopped_mid_transfer_costs_at_most_the_timeout(fault):
    """A real owner process serving a 64 MiB block is SIGKILLed or SIGSTOPped while the reader
    receives it: the reader gets a PeerError (never bytes) within the timeout, once."""
    timeout_s = 3.0
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, TOKEN], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(owner.stdout.readline())
        address = f"127.0.0.3:{port}"
        req = BlockRequest("ds", "big", "e", 64 << 20, 0, 64 << 20)
        async with open_peer_client(TOKEN, timeout_s=timeout_s, connect_timeout_s=30) as client:
            outcome: list[object] = []

            async def read() -> None:
                try:
                    outcome.append(await client.get_block(address, req))
                except PeerError as err:
                    outcome.append(err)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                # interrupt once the connection is up and the answer is flowing
                await wait_until(lambda: client.open_connections == 1 or outcome, timeout=30)
                await trio.sleep(0.01)
                owner.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                start = time.monotonic()
            waited = time.monotonic() - start
            assert len(outcome) == 1
            if isinstance(outcome[0], bytes):  # the whole block made it before the signal
                assert outcome[0] == bytes(range(256)) * (64 << 12)
            else:
                assert isinstance(outcome[0], PeerError)
                assert client.is_cooling(address)
            assert waited < timeout_s + 5  # generous: bounded by the timeout, not stuck
    finally:
        owner.send_signal(signal.SIGCONT)
        owner.kill()
        owner.wait()


def test_impossible_requests_are_rejected():
    with pytest.raises(ValueError, match="past the end"):
        BlockRequest("ds", "k", "e", 4096, 1, 4096)
    with pytest.raises(ValueError, match="block size"):
        BlockRequest("ds", "k", "e", 4096, 0, 100)
    assert BlockRequest("ds", "k", "e", 4097, 1, 4096).length == 1
    assert isinstance(PeerError("x"), CachefsError)


def test_requests_round_trip_through_their_frames():
    for cached_only in (False, True):
        key = b"raw\xff/\x00 k".decode("utf-8", "surrogateescape")
        req = BlockRequest("d s", key, '"e"', 10 << 20, 3, 1 << 20, cached_only)
        frame = wire.encode_request(42, req)
        head, names = frame[: wire.REQUEST.size], frame[wire.REQUEST.size :]
        assert wire.request_names_length(head) == len(names)
        assert wire.decode_request(head, names) == (42, req)
