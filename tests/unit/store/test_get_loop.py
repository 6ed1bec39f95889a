"""The GET loop (cachefs/store/get_loop.py) against a real loopback server that answers from a
script (tests/unit/store/test_http1.py's ``ScriptedServer``), over HTTP and over TLS with a
certificate made for the test: many GETs in flight byte for byte on kept connections, every
answer the loop must leave to the ordinary read path ("not done here"), a kept connection the
server closed, a server that never answers. The requests are signed by a real
``S3BulkReader`` (its probe signs locally; nothing reaches a store). The same loop inside the
fetcher processes, against moto behind the fault proxy, is in
tests/e2e/store/test_get_loop.py."""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import time
from contextlib import closing

import pytest

from cachefs.errors import StoreError
from cachefs.store.base import RetryPolicy, StoreConfig
from cachefs.store.get_loop import GetLoop, Outcome
from cachefs.store.s3_bulk import S3BulkReader
from tests.unit.store.test_http1 import Answer, ScriptedServer, raw
from tests.unit.store.test_http1 import certificate as certificate  # the fixture, shared
from tests.waiting import WAIT_S

OBJECTS = {f"/bucket/obj/{i}": os.urandom(1000 + 5000 * i) for i in range(8)}
RANGE = re.compile(rb"\r\nRange: bytes=(\d+)-(\d+)")


def ranged(objects: dict[str, bytes], *extra: str) -> Answer:
    """A store's answer to a ranged GET: 206 with the bytes asked for."""
    headers = "".join(f"{line}\r\n" for line in extra)

    def answer(head: bytes) -> tuple[bytes, bool]:
        path = head.split(b" ", 2)[1].decode()
        match = RANGE.search(head)
        assert match is not None, head
        start, end = int(match.group(1)), int(match.group(2))
        body = objects[path][start : end + 1]
        reply = f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
        return reply.encode() + body, False

    return answer


@pytest.fixture(autouse=True)
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")


@pytest.fixture
def serve():
    """A scripted server and a reader whose GETs go to it."""
    servers: list[ScriptedServer] = []
    readers: list[S3BulkReader] = []

    def start(answers: list[Answer], retry: RetryPolicy = RetryPolicy()):
        server = ScriptedServer(answers)
        servers.append(server)
        config = StoreConfig(
            "s3://bucket/", endpoint=f"http://127.0.0.1:{server.port}", dataset="ds", retry=retry
        )
        readers.append(S3BulkReader(config))
        return server, readers[-1]

    yield start
    for reader in readers:
        reader.close()
    for server in servers:
        server.close()


def run(loop: GetLoop, expected: int) -> dict[object, Outcome]:
    """Poll until ``expected`` tries have ended (bounded); their outcomes by tag."""
    ended: dict[object, Outcome] = {}
    deadline = time.monotonic() + WAIT_S
    while len(ended) < expected:
        assert time.monotonic() < deadline, f"only {len(ended)} of {expected} tries ended"
        for outcome in loop.poll(timeout=1.0):
            ended[outcome[0]] = outcome
    return ended


def test_many_gets_in_flight_come_back_byte_for_byte_on_kept_connections(serve):
    server, reader = serve([ranged(OBJECTS)])
    with GetLoop(connections=3) as loop:
        wanted = {}
        for round_ in range(4):  # ranges from 0 and from inside, every object, 4 times
            for path, data in OBJECTS.items():
                key = path.removeprefix("/bucket/")
                offset = 0 if round_ % 2 == 0 else 7
                tag = (round_, key)
                wanted[tag] = data[offset:]
                loop.submit(tag, reader, key, offset, len(data) - offset, None)
        assert loop.tries == len(wanted)
        ended = run(loop, len(wanted))
        for tag, (_, body, throttled) in ended.items():
            assert body == wanted[tag], tag
            assert not throttled
        assert loop.tries == 0
        assert server.connections == 3  # never more than asked for, each kept for the next
        assert len(server.requests) == len(wanted)
        # The requests are the lean client's, signed.
        assert all(b"\r\nAuthorization: AWS4-HMAC-SHA256 " in head for head in server.requests)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 500 Internal Error\r\nContent-Length: 0\r\n\r\n",  # transient: retried
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n012",  # the range from 7 was ignored
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 4\r\n\r\n0123",  # not the length
        b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n789\r\n0\r\n\r\n",
        b'HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\nETag: "other"\r\n\r\n789',
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\n\r\n78",  # then closed
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\n\r\n789extra",
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 206 Partial Content\r\nContent-Length: 3\r\n" + b"X: y\r\n" * 20000,
    ],
    ids=[
        "500",
        "chunked-404",
        "200-for-a-range",
        "length",
        "chunked",
        "etag",
        "cut",
        "extra",
        "not-http",
        "huge",
    ],
)
def test_answers_the_loop_does_not_finish_are_left_to_the_ordinary_path(serve, reply):
    _server, reader = serve([raw(reply, close=True)])
    with GetLoop(connections=2) as loop:
        loop.submit("t", reader, "obj/0", 7, 3, "etag")
        assert run(loop, 1)["t"] == ("t", None, False)
        assert loop.tries == 0


def s3_error(status: int, code: str) -> bytes:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>"
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}"
    return f"{head}\r\n\r\n{body}".encode()


@pytest.mark.parametrize(
    "status, code", [(404, "NoSuchKey"), (403, "AccessDenied"), (412, "PreconditionFailed")]
)
def test_a_permanent_error_answer_is_the_stores_own_error_after_one_request(serve, status, code):
    """The error get_range raises for the same answer, class and one line, and the connection
    is kept (the body was read whole)."""
    server, reader = serve([raw(s3_error(status, code), close=False)])
    with GetLoop(connections=1) as loop:
        for n in range(2):
            loop.submit(n, reader, "obj/0", 0, 3, "etag")
            _tag, error, throttled = run(loop, 1)[n]
            assert isinstance(error, StoreError) and not error.transient
            assert not throttled
            with pytest.raises(type(error)) as direct:
                reader.get_range("obj/0", 0, 3, etag="etag")
            assert str(error) == str(direct.value)
        assert len(server.requests) == 4  # two from the loop, two from get_range
        assert server.connections == 2  # the loop's kept its one


def test_a_slow_down_is_not_done_and_marked_throttled(serve):
    _server, reader = serve([raw(s3_error(503, "SlowDown"), close=False)])
    with GetLoop(connections=2) as loop:
        loop.submit("t", reader, "obj/0", 0, 3, None)
        assert run(loop, 1)["t"] == ("t", None, True)


def test_a_kept_connection_the_server_closed_is_replaced_once_and_connection_close_honoured(
    serve,
):
    data = OBJECTS["/bucket/obj/1"]
    closing = ranged(OBJECTS)

    def answer_then_close(head: bytes) -> tuple[bytes, bool]:
        return closing(head)[0], True  # closes without saying so

    server, reader = serve([answer_then_close])
    with GetLoop(connections=1) as loop:
        for n in range(3):  # each on the kept connection, found closed, sent again on a new one
            loop.submit(n, reader, "obj/1", 0, len(data), None)
            assert run(loop, 1)[n][1] == data
        assert server.connections == 3
        assert len(server.requests) == 3  # no request was lost on a closed connection
    server, reader = serve([ranged(OBJECTS, "Connection: close")])
    with GetLoop(connections=1) as loop:
        for n in range(2):
            loop.submit(n, reader, "obj/1", 0, len(data), None)
            assert run(loop, 1)[n][1] == data
        assert server.connections == 2  # not kept: it said so


def test_a_silent_server_and_a_refused_port_end_the_try_not_done(serve):
    # A server that reads the request and never answers: the try ends after the head bound.
    silent = lambda _head: (b"", False)  # noqa: E731
    _server, reader = serve([silent], retry=RetryPolicy(first_byte_timeout_s=0.4))
    with GetLoop(connections=1) as loop:
        loop.submit("silent", reader, "obj/0", 0, 3, None)
        assert run(loop, 1)["silent"] == ("silent", None, False)
    free = socket.socket()  # a port nothing listens on
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    refused = S3BulkReader(
        StoreConfig("s3://bucket/", endpoint=f"http://127.0.0.1:{port}", dataset="ds")
    )
    with GetLoop(connections=1) as loop, closing(refused):
        loop.submit("refused", refused, "obj/0", 0, 3, None)
        assert loop.poll(timeout=WAIT_S) == [("refused", None, False)]
    # A name that does not resolve ends the try before any wait: the poll does not wait for
    # its files (in a fetcher, an idle pipe) before returning it.
    nowhere = S3BulkReader(
        StoreConfig("s3://bucket/", endpoint="http://nowhere.invalid:1", dataset="ds")
    )
    readable, writable = os.pipe()
    try:
        with GetLoop(connections=1) as loop, closing(nowhere):
            loop.watch(readable, lambda: None)
            loop.submit("nowhere", nowhere, "obj/0", 0, 3, None)
            started = time.monotonic()
            assert loop.poll(timeout=WAIT_S) == [("nowhere", None, False)]
            assert time.monotonic() - started < WAIT_S  # not the poll's bound: the try's end
    finally:
        os.close(readable)
        os.close(writable)


def test_over_tls_with_a_trusted_certificate_and_not_done_with_an_untrusted_one(
    certificate, monkeypatch
):
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    server = ScriptedServer([ranged(OBJECTS)], tls=server_side)
    endpoint = f"https://127.0.0.1:{server.port}"
    try:
        monkeypatch.setenv("AWS_CA_BUNDLE", str(cert))
        reader = S3BulkReader(StoreConfig("s3://bucket/", endpoint=endpoint, dataset="ds"))
        with GetLoop(connections=2) as loop, closing(reader):
            for path, data in OBJECTS.items():
                loop.submit(path, reader, path.removeprefix("/bucket/"), 0, len(data), None)
            ended = run(loop, len(OBJECTS))
            assert {tag: body for tag, body, _ in ended.values()} == OBJECTS
            assert server.connections == 2
        monkeypatch.delenv("AWS_CA_BUNDLE")  # the default CAs: not our certificate
        stranger = S3BulkReader(StoreConfig("s3://bucket/", endpoint=endpoint, dataset="ds"))
        with GetLoop(connections=1) as loop, closing(stranger):
            loop.submit("x", stranger, "obj/0", 0, 10, None)
            assert run(loop, 1)["x"] == ("x", None, False)
    finally:
        server.close()


def test_watched_files_are_served_by_the_same_poll():
    readable, writable = os.pipe()
    seen: list[bytes] = []
    try:
        with GetLoop(connections=1) as loop:
            loop.watch(readable, lambda: seen.append(os.read(readable, 100)))
            os.write(writable, b"request")
            deadline = time.monotonic() + WAIT_S
            while not seen:
                assert time.monotonic() < deadline
                assert loop.poll(timeout=1.0) == []
            assert seen == [b"request"]
    finally:
        os.close(readable)
        os.close(writable)


def test_a_kept_connection_holding_bytes_past_its_answer_is_not_reused(serve):
    """A store (or proxy) that sends more than the answer: the bytes left on the connection
    would be read as the next request's answer. Here they are a whole forged answer of the
    right length, so reusing the connection would hand back wrong bytes."""
    data = os.urandom(200_000)  # longer than a head's receive: the body is read to its end only
    objects = {"/bucket/big": data}
    honest = ranged(objects)
    forged = (
        f"HTTP/1.1 206 Partial Content\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + b"X" * len(data)
    )

    def answer_and_more(head: bytes) -> tuple[bytes, bool]:
        reply, _ = honest(head)
        return reply + forged, False

    server, reader = serve([answer_and_more, honest])
    with GetLoop(connections=1) as loop:
        loop.submit(1, reader, "big", 0, len(data), None)
        assert run(loop, 1)[1][1] == data
        # The forged bytes have reached the kept connection (bounded wait on that state).
        [kept] = [c for kept in loop._idle.values() for c in kept]
        assert select.select([kept.sock], [], [], WAIT_S)[0]
        loop.submit(2, reader, "big", 0, len(data), None)
        assert run(loop, 1)[2][1] == data  # from a new connection, not the forged answer
        assert server.connections == 2


def test_every_address_of_the_name_is_tried_and_the_good_one_first(serve, monkeypatch):
    """A name whose first address refuses (127.0.0.2: the server listens on 127.0.0.1 only):
    the connect goes on to the next address, and later connections start with the one that
    worked."""
    data = OBJECTS["/bucket/obj/2"]
    server, reader = serve([ranged(OBJECTS)])
    resolve = socket.getaddrinfo
    asked: list[tuple] = []

    def two_addresses(host, port, *args, **kwargs):
        if host != "127.0.0.1" or port != server.port:
            return resolve(host, port, *args, **kwargs)
        asked.append((host, port))
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
        ]

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    with GetLoop(connections=3) as loop:
        for n in range(3):  # three at once: three connections
            loop.submit(n, reader, "obj/2", 0, len(data), None)
        ended = run(loop, 3)
        assert all(body == data for _, body, _ in ended.values())
        assert len(asked) == 3
        assert server.connections == 3
        assert loop._good_address and loop._failed_address  # as the next connect sorts them
