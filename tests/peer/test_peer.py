"""The peer block transport over real sockets: hypercorn (trio) serving the app, PeerClient reading.

Failure cases use real misbehaving peers: a closed port, a listener that accepts and never
answers, an ASGI wrapper that corrupts what the genuine app sends, and owners whose block bytes
no longer match the checksums recorded when they admitted it (a real TieredBlockCache whose
block file was changed on disk).
"""

from __future__ import annotations

import random
import re
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from cachefs.cache import TierConfig, TieredBlockCache
from cachefs.cache.base import CHUNK_SIZE, BlockKey, CheckedBlock, chunk_checksums
from cachefs.errors import CachefsError, ObjectNotFound
from cachefs.peer.base import BlockRequest, NotCached, PeerError, PeerRefused, PeerUnavailable
from cachefs.peer.client import PeerClient
from cachefs.peer.server import create_peer_app
from tests.fakes.wrappers import served

TOKEN = "s3cret-token"
MIB = 1 << 20


class FakeOwner:
    """``serve_block`` over in-memory objects, recording every request it is asked."""

    def __init__(self, objects: dict[str, bytes] | None = None):
        self.objects = objects or {}
        self.requests: list[BlockRequest] = []

    async def serve_block(self, req: BlockRequest) -> CheckedBlock:
        self.requests.append(req)
        data = self.objects[req.key]  # KeyError (a LookupError) → 404
        start = req.index * req.block_size
        return CheckedBlock.of(data[start : start + req.block_size])


def request_for(key: str, data: bytes, index: int = 0, block_size: int = MIB) -> BlockRequest:
    return BlockRequest("ds", key, '"etag-1"', len(data), index, block_size)


@asynccontextmanager
async def peer_client(**kwargs) -> AsyncIterator[PeerClient]:
    client = PeerClient(TOKEN, **kwargs)
    try:
        yield client
    finally:
        await client.aclose()


def corrupting(
    app, *, headers: dict[bytes, bytes | None] | None = None, truncate: int = 0, flip_at=None
):
    """Wrap ``app``: replace (None: remove) some of its headers, drop the body's last bytes,
    and/or flip the body's byte at ``flip_at``."""

    async def wrapper(scope, receive, send):
        async def altered_send(message):
            if message["type"] == "http.response.start" and message["status"] == 200:
                altered = {**dict(message["headers"]), **(headers or {})}
                kept = [(name, value) for name, value in altered.items() if value is not None]
                message = {**message, "headers": kept}
            elif message["type"] == "http.response.body":
                body = message["body"]
                if flip_at is not None:
                    body = body[:flip_at] + bytes([body[flip_at] ^ 0x01]) + body[flip_at + 1 :]
                if truncate:
                    body = body[:-truncate]
                message = {**message, "body": body}
            await send(message)

        await app(scope, receive, altered_send)

    return wrapper


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2"])
async def test_round_trip_full_and_last_short_block(host):
    data = random.randbytes(2 * MIB + 12345)
    owner = FakeOwner({"obj": data})
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app, host) as address, peer_client() as client:
        assert await client.get_block(address, request_for("obj", data, 0)) == data[:MIB]
        last = await client.get_block(address, request_for("obj", data, 2))
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
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app) as address, peer_client() as client:
        assert await client.get_block(address, req) == data[:4096]
    assert owner.requests == [req]


async def test_auth_health_and_unknown_paths():
    owner = FakeOwner({"obj": b"x" * 5000})
    params = request_for("obj", b"x" * 5000, block_size=4096).to_params()
    wrong = {"authorization": "Bearer not-the-token"}
    right = {"authorization": f"Bearer {TOKEN}"}
    async with served(create_peer_app(owner.serve_block, TOKEN)) as address:
        http = httpx.AsyncClient(base_url=f"http://{address}")
        async with http:
            assert (await http.get("/v1/blocks", params=params)).status_code == 401
            assert (await http.get("/v1/blocks", params=params, headers=wrong)).status_code == 401
            assert (await http.get("/v1/blocks", params=params, headers=right)).status_code == 200
            health = await http.get("/v1/peer/health")
            assert (health.status_code, health.text) == (200, "ok")
            assert (await http.get("/v1/other", headers=right)).status_code == 404
            assert (await http.post("/v1/blocks", params=params, headers=right)).status_code == 404
    assert len(owner.requests) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"k": None},
        {"s": "-5"},
        {"s": "+5000"},
        {"i": "1e3"},
        {"i": "2"},  # past the end of a 5000-byte object in 4 KiB blocks
        {"b": "1024"},
        {"b": str(128 * MIB)},
        {"k": "not base64!"},
        {"c": "2"},
        {"c": ""},
        {"c": "true"},
    ],
)
async def test_malformed_params_are_400(change):
    owner = FakeOwner({"obj": b"x" * 5000})
    params = {**request_for("obj", b"x" * 5000, block_size=4096).to_params(), **change}
    params = {name: value for name, value in params.items() if value is not None}
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app) as address, httpx.AsyncClient() as http:
        resp = await http.get(
            f"http://{address}/v1/blocks",
            params=params,
            headers={"authorization": f"Bearer {TOKEN}"},
        )
    assert resp.status_code == 400, resp.text
    assert owner.requests == []


@pytest.mark.parametrize("cached_only", [False, True])
def test_params_round_trip(cached_only):
    req = BlockRequest("ds", "a/b c", '"e"', 10_000, 2, 4096, cached_only=cached_only)
    params = req.to_params()
    assert ("c" in params) == cached_only  # absent unless set: what older workers send
    assert BlockRequest.from_params(params) == req
    assert BlockRequest.from_params({**params, "c": "0"}).cached_only is False
    assert BlockRequest.from_params({**params, "c": "1"}).cached_only is True
    with pytest.raises(ValueError, match="c must be 0 or 1"):
        BlockRequest.from_params({**params, "c": "yes"})


async def test_cached_only_reaches_the_owner_and_not_cached_is_404():
    data = random.randbytes(10_000)
    cached = {("obj", 0)}
    seen: list[BlockRequest] = []

    async def serve(req: BlockRequest) -> CheckedBlock:
        seen.append(req)
        if req.cached_only and (req.key, req.index) not in cached:
            raise NotCached(req.key)
        return CheckedBlock.of(data[req.index * 4096 : (req.index + 1) * 4096])

    async with served(create_peer_app(serve, TOKEN)) as address, peer_client() as client:
        hit = BlockRequest("ds", "obj", "e", len(data), 0, 4096, cached_only=True)
        assert await client.get_block(address, hit) == data[:4096]
        miss = BlockRequest("ds", "obj", "e", len(data), 1, 4096, cached_only=True)
        with pytest.raises(PeerRefused, match="404: not cached") as info:
            await client.get_block(address, miss)
        assert info.value.status == 404
        assert not client.is_cooling(address)
        plain = BlockRequest("ds", "obj", "e", len(data), 1, 4096)
        assert await client.get_block(address, plain) == data[4096:8192]
    assert [req.cached_only for req in seen] == [True, True, False]


async def test_lookup_error_is_refused_without_cooldown():
    owner = FakeOwner()
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app) as address, peer_client() as client:
        with pytest.raises(PeerRefused, match="404"):
            await client.get_block(address, request_for("missing", b"x" * 10))
        assert not client.is_cooling(address)


async def test_cachefs_error_is_refused_with_its_message():
    async def failing(req: BlockRequest) -> CheckedBlock:
        raise ObjectNotFound("gone from the bucket", dataset=req.dataset, key=req.key)

    async with served(create_peer_app(failing, TOKEN)) as address, peer_client() as client:
        with pytest.raises(PeerRefused, match=r"503.*gone from the bucket") as info:
            await client.get_block(address, request_for("obj", b"x" * 10))
        assert address in str(info.value)
        assert not client.is_cooling(address)


@pytest.mark.parametrize("result", ["short", "crash", "checksums-missing"])
async def test_owner_bug_is_500_and_no_bytes(result):
    async def buggy(req: BlockRequest) -> CheckedBlock:
        if result == "crash":
            raise RuntimeError("bug")
        if result == "checksums-missing":
            return CheckedBlock(b"x" * req.length, b"")
        return CheckedBlock.of(b"x" * (req.length - 1))

    async with served(create_peer_app(buggy, TOKEN)) as address, peer_client() as client:
        with pytest.raises(PeerError, match="500") as info:
            await client.get_block(address, request_for("obj", b"x" * 10000))
    assert not isinstance(info.value, PeerRefused)


CHECKSUMS = b"x-cachefs-chunk-checksums"
CHUNK_SIZE_HEADER = b"x-cachefs-chunk-size"


@pytest.mark.parametrize(
    ("corruption", "reason"),
    [
        ({"headers": {CHECKSUMS: b"0123456789abcdef"}}, "chunk 0"),
        ({"headers": {CHECKSUMS: b""}}, "0 chunk checksums, expected 1"),
        ({"headers": {CHECKSUMS: None}}, "0 chunk checksums, expected 1"),
        ({"headers": {CHECKSUMS: b"not hex at all!!"}}, "not hex"),
        ({"headers": {CHUNK_SIZE_HEADER: None}}, "chunk size header ''"),
        ({"headers": {CHUNK_SIZE_HEADER: b"12"}}, "chunk size 12 outside"),
        ({"truncate": 1}, "expected 4096"),
        ({"flip_at": 1000}, "checksum mismatch in chunk 0"),
    ],
    ids=[
        "wrong-checksum",
        "empty-checksums",
        "no-checksums",
        "not-hex",
        "no-chunk-size",
        "bad-chunk-size",
        "short-body",
        "flipped-byte",
    ],
)
async def test_corrupt_transfer_is_error_then_cooldown_then_retry(corruption, reason):
    data = random.randbytes(10000)
    owner = FakeOwner({"obj": data})
    app = corrupting(create_peer_app(owner.serve_block, TOKEN), **corruption)
    req = request_for("obj", data, block_size=4096)
    async with served(app) as address, peer_client(cooldown_s=0.3) as client:
        with pytest.raises(PeerError, match=re.escape(reason)) as info:
            await client.get_block(address, req)
        assert not isinstance(info.value, PeerRefused | PeerUnavailable)
        assert client.is_cooling(address)
        with pytest.raises(PeerUnavailable, match=re.escape(address)):
            await client.get_block(address, req)
        assert len(owner.requests) == 1  # the cooled-down call never reached the peer
        await trio.sleep(0.35)
        with pytest.raises(PeerError):
            await client.get_block(address, req)
        assert len(owner.requests) == 2


async def test_a_flipped_byte_in_any_chunk_is_rejected_and_names_the_chunk():
    data = random.randbytes(3 * CHUNK_SIZE + 500)
    owner = FakeOwner({"obj": data})
    req = request_for("obj", data, block_size=4 * CHUNK_SIZE)
    for chunk in (0, 2, 3):  # the last chunk is the short one
        app = corrupting(create_peer_app(owner.serve_block, TOKEN), flip_at=chunk * CHUNK_SIZE + 7)
        async with served(app) as address, peer_client() as client:
            with pytest.raises(PeerError, match=f"checksum mismatch in chunk {chunk} "):
                await client.get_block(address, req)
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app) as address, peer_client() as client:
        assert await client.get_block(address, req) == data


async def test_the_owner_sends_the_checksums_it_was_given_not_ones_of_what_it_read():
    """An owner whose bytes no longer match what it admitted (here: handed over with the
    checksums of the admitted bytes, as a cache's index gives them) is caught by the reader:
    the server computes nothing over what it sends."""
    admitted = random.randbytes(2 * CHUNK_SIZE)
    damaged = admitted[:CHUNK_SIZE] + b"\0" + admitted[CHUNK_SIZE + 1 :]

    async def damaged_owner(req: BlockRequest) -> CheckedBlock:
        return CheckedBlock(damaged, chunk_checksums(admitted))

    req = request_for("obj", admitted, block_size=4 * CHUNK_SIZE)
    async with served(create_peer_app(damaged_owner, TOKEN)) as address, peer_client() as client:
        with pytest.raises(PeerError, match="checksum mismatch in chunk 1 "):
            await client.get_block(address, req)
        assert client.is_cooling(address)


async def test_an_owner_serving_from_a_real_cache_sends_its_admitted_checksums(tmp_path):
    """The owner's side as the worker runs it: blocks from a TieredBlockCache with the chunk
    checksums its index stored at admission. A block file changed on the owner's disk is
    caught there (dropped, counted corrupt) and never sent."""
    data = random.randbytes(3 * CHUNK_SIZE + 1)
    key = BlockKey.make(1, "obj", '"etag-1"', 0)
    cache = TieredBlockCache(
        str(tmp_path / "index"), [TierConfig("ram", str(tmp_path / "ram"), 8 << 20)]
    )
    sent_checksums: list[str] = []

    async def owner(req: BlockRequest) -> CheckedBlock:
        block = cache.read_with_checksums(key)
        if block is None:
            raise NotCached(req.key)
        return block

    def record(app):
        async def wrapper(scope, receive, send):
            async def recording_send(message):
                if message["type"] == "http.response.start":
                    sent_checksums.append(dict(message["headers"]).get(CHECKSUMS, b"").decode())
                await send(message)

            await app(scope, receive, recording_send)

        return wrapper

    try:
        cache.put(key, data)
        req = request_for("obj", data, block_size=4 * CHUNK_SIZE)
        app = record(create_peer_app(owner, TOKEN))
        async with served(app) as address, peer_client() as client:
            assert await client.get_block(address, req) == data
            with open(cache.block_path(key), "r+b") as block_file:  # changed in place
                block_file.seek(2 * CHUNK_SIZE + 3)
                block_file.write(bytes([data[2 * CHUNK_SIZE + 3] ^ 0xFF]))
            with pytest.raises(PeerRefused, match="404: not cached"):
                await client.get_block(address, req)
        assert sent_checksums[0] == chunk_checksums(data).hex()
        assert cache.counters().corrupt == 1
        assert not cache.contains(key)
    finally:
        cache.close()


async def test_the_largest_block_and_another_chunk_size_round_trip():
    """A 64 MiB block announces 512 chunk checksums in one header; a peer whose chunks have
    another size (another version) is checked with the size it announces."""
    data = bytes(64 << 20)
    owner = FakeOwner({"big": data, "small": data[: 3 * CHUNK_SIZE]})
    req = request_for("big", data, block_size=64 << 20)
    app = create_peer_app(owner.serve_block, TOKEN)
    async with served(app) as address, peer_client(timeout_s=30) as client:
        assert await client.get_block(address, req) == data
    small = data[: 3 * CHUNK_SIZE]
    other_size = {
        CHUNK_SIZE_HEADER: b"65536",
        CHECKSUMS: chunk_checksums(small, 65536).hex().encode(),
    }
    app = corrupting(create_peer_app(owner.serve_block, TOKEN), headers=other_size)
    async with served(app) as address, peer_client() as client:
        req = request_for("small", small, block_size=4 * CHUNK_SIZE)
        assert await client.get_block(address, req) == small


async def test_mark_down_starts_cooldown():
    async with peer_client(cooldown_s=60) as client:
        client.mark_down("127.0.0.1:1")
        assert client.is_cooling("127.0.0.1:1")
        assert not client.is_cooling("127.0.0.1:2")
        with pytest.raises(PeerUnavailable):
            await client.get_block("127.0.0.1:1", request_for("obj", b"x" * 10))


async def test_dead_port_fails_fast():
    with socket.socket() as sock:  # a port nobody listens on: bound, then released
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    async with peer_client() as client:
        start = time.monotonic()
        with pytest.raises(PeerError, match="ConnectError"):
            await client.get_block(address, request_for("obj", b"x" * 10))
        assert time.monotonic() - start < 1.0
        assert client.is_cooling(address)


async def test_stalled_peer_costs_at_most_the_timeout():
    """A peer that accepts the connection and never answers (e.g. SIGSTOPped); the cancelled
    request must not break the shared pool for healthy peers."""
    timeout_s = 0.5
    data = random.randbytes(5000)
    healthy = create_peer_app(FakeOwner({"obj": data}).serve_block, TOKEN)
    async with served(healthy) as healthy_address, trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        accepted: list[trio.SocketStream] = []

        async def hold_forever(stream: trio.SocketStream) -> None:
            accepted.append(stream)
            await trio.sleep_forever()

        nursery.start_soon(trio.serve_listeners, hold_forever, listeners)
        address = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        async with peer_client(timeout_s=timeout_s) as client:
            start = time.monotonic()
            with pytest.raises(PeerError):
                await client.get_block(address, request_for("obj", b"x" * 10))
            elapsed = time.monotonic() - start
            assert client.is_cooling(address)
            req = request_for("obj", data, block_size=4096)
            assert await client.get_block(healthy_address, req) == data[:4096]
        nursery.cancel_scope.cancel()
    assert timeout_s - 0.05 <= elapsed < timeout_s + 1.0
    assert len(accepted) == 1


async def test_max_inflight_answers_503_at_once():
    release = trio.Event()
    started = 0

    async def slow(req: BlockRequest) -> CheckedBlock:
        nonlocal started
        started += 1
        await release.wait()
        return CheckedBlock.of(b"y" * req.length)

    req = request_for("obj", b"x" * 10000, block_size=4096)
    results: list[bytes] = []
    app = create_peer_app(slow, TOKEN, max_inflight=2)
    async with served(app) as address, peer_client() as client, trio.open_nursery() as nursery:

        async def fetch() -> None:
            results.append(await client.get_block(address, req))

        nursery.start_soon(fetch)
        nursery.start_soon(fetch)
        while started < 2:
            await trio.sleep(0.01)
        with pytest.raises(PeerRefused, match=r"503.*too many"):
            await client.get_block(address, req)
        assert not client.is_cooling(address)
        release.set()
    assert results == [b"y" * 4096] * 2
    assert started == 2


async def test_lifespan_is_acknowledged():
    app = create_peer_app(FakeOwner().serve_block, TOKEN)
    to_app, app_inbox = trio.open_memory_channel(2)
    app_outbox, from_app = trio.open_memory_channel(2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(app, {"type": "lifespan"}, app_inbox.receive, app_outbox.send)
        await to_app.send({"type": "lifespan.startup"})
        assert await from_app.receive() == {"type": "lifespan.startup.complete"}
        await to_app.send({"type": "lifespan.shutdown"})
        assert await from_app.receive() == {"type": "lifespan.shutdown.complete"}


def test_impossible_requests_are_rejected():
    with pytest.raises(ValueError, match="past the end"):
        BlockRequest("ds", "k", "e", 4096, 1, 4096)
    with pytest.raises(ValueError, match="block size"):
        BlockRequest("ds", "k", "e", 4096, 0, 100)
    assert BlockRequest("ds", "k", "e", 4097, 1, 4096).length == 1
    assert isinstance(PeerError("x"), CachefsError)
