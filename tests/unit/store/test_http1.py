"""The lean client's HTTP/1.1 connections against a real loopback server that answers from a
script: body framings, keep-alive and its stale connections, answers that end early or are not
HTTP, and TLS with a certificate made for the test (openssl). The S3 side of the same client
(moto, the fault proxy) is tested in tests/e2e/store/test_s3_bulk.py."""

from __future__ import annotations

import os
import queue
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from cachefs.store.http1 import BodyCutShort, Http1Pool, MalformedAnswer
from tests.waiting import WAIT_S

#: One answer: given the request's head, what to send, and whether to close afterwards.
Answer = Callable[[bytes], tuple[bytes, bool]]


class ScriptedServer:
    """Answers requests in order from ``answers`` (the last one repeats); counts connections
    and keeps every request head it saw."""

    def __init__(self, answers: list[Answer], tls: ssl.SSLContext | None = None):
        self.answers = answers
        self.requests: list[bytes] = []
        self.connections = 0
        self._sockets: list[socket.socket] = []  # of the connections, in order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._tls = tls
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(sock,), daemon=True).start()

    def _connection(self, sock: socket.socket) -> None:
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            self._sockets.append(sock)
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = sock.recv(65536)
                    if not data:
                        return
                    buffered += data
                head, buffered = buffered.split(b"\r\n\r\n", 1)
                self.requests.append(head)
                answer = self.answers[min(len(self.requests), len(self.answers)) - 1]
                reply, close = answer(head)
                sock.sendall(reply)
                if close:
                    return
        except OSError:
            return
        finally:
            sock.close()

    def send_to_last(self, data: bytes) -> None:
        """More bytes on the newest connection, after its scripted answer."""
        self._sockets[-1].sendall(data)

    def close(self) -> None:
        self._listener.close()


def ok(body: bytes, *extra: str) -> Answer:
    headers = "".join(f"{line}\r\n" for line in extra)
    reply = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body
    return lambda _head: (reply, False)


def raw(reply: bytes, close: bool = True) -> Answer:
    return lambda _head: (reply, close)


@pytest.fixture
def serve():
    servers: list[ScriptedServer] = []
    pools: list[Http1Pool] = []

    def start(answers: list[Answer], **pool_args) -> tuple[ScriptedServer, Http1Pool]:
        server = ScriptedServer(answers)
        servers.append(server)
        pool = Http1Pool(f"http://127.0.0.1:{server.port}", timeout=10, **pool_args)
        pools.append(pool)
        return server, pool

    yield start
    for pool in pools:
        pool.close()
    for server in servers:
        server.close()


def test_answers_with_a_length_are_read_exactly_and_the_connection_is_kept(serve):
    big = os.urandom(3 << 20)
    server, pool = serve([ok(b"small"), ok(big), ok(b"")])
    assert pool.get("/a", []).read() == b"small"
    assert pool.get("/b", [("Range", "bytes=0-9")]).read() == big
    assert pool.get("/c", []).read() == b""
    assert server.connections == 1
    assert server.requests[1].startswith(b"GET /b HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nRange: bytes=0-9" in server.requests[1]


def test_chunked_and_connection_delimited_bodies(serve):
    chunked = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nTrailer: x\r\n\r\n"
    )
    server, pool = serve([raw(chunked, close=False), raw(b"HTTP/1.0 200 OK\r\n\r\nuntil the end")])
    assert pool.get("/chunked", []).read() == b"hello world"
    assert pool.get("/to-the-end", []).read() == b"until the end"
    assert server.connections == 1 and pool.idle_connections == 0  # ended with its body


def test_a_connection_the_server_closed_while_idle_is_replaced_once(serve):
    """The server answers and closes without saying so: the next GET finds the kept
    connection dead before any answer byte and is sent again on a new one."""
    server, pool = serve([raw(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\none", close=True)])
    assert pool.get("/1", []).read() == b"one"
    assert pool.idle_connections == 1
    assert pool.get("/2", []).read() == b"one"
    assert pool.get("/3", []).read() == b"one"
    assert server.connections == 3 and len(server.requests) == 3


def test_an_http10_answer_without_keep_alive_is_not_kept(serve):
    _server, pool = serve([raw(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", close=True)])
    assert pool.get("/1", []).read() == b"ok"
    assert pool.idle_connections == 0


def test_connection_close_is_honoured(serve):
    _server, pool = serve([ok(b"x", "Connection: close")])
    assert pool.get("/1", []).read() == b"x"
    assert pool.idle_connections == 0


def test_a_body_cut_short_raises_and_never_returns_bytes(serve):
    _server, pool = serve(
        [raw(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly 20 bytes here..")]
    )
    response = pool.get("/short", [])
    assert response.status == 200
    with pytest.raises(BodyCutShort):
        response.read()
    assert pool.idle_connections == 0


def test_an_answer_that_ends_before_its_headers_on_a_new_connection_is_an_error(serve):
    _server, pool = serve([raw(b"HTTP/1.1 200 OK\r\nContent-Le")])
    with pytest.raises(BodyCutShort):
        pool.get("/x", [])


@pytest.mark.parametrize(
    "reply",
    [
        b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"y" * (80 * 1024) + b"\r\n\r\n",
    ],
)
def test_answers_that_are_not_http_are_malformed(serve, reply):
    _server, pool = serve([raw(reply)])
    with pytest.raises(MalformedAnswer):
        pool.get("/x", []).read()
    assert pool.idle_connections == 0


def test_an_interim_100_continue_is_skipped(serve):
    reply = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    _server, pool = serve([raw(reply, close=False)])
    response = pool.get("/x", [])
    assert (response.status, response.read()) == (200, b"ok")


def test_a_limited_read_of_a_long_error_body_stops_and_drops_the_connection(serve):
    body = b"<Error><Code>SlowDown</Code></Error>" + b" " * 100_000
    _server, pool = serve([ok(body)])
    response = pool.get("/x", [])
    assert response.read(64) == body[:64]
    assert pool.idle_connections == 0


def test_a_server_that_stalls_costs_the_timeout_and_a_refused_port_is_an_oserror(serve):
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        pool = Http1Pool(f"http://127.0.0.1:{stalled.getsockname()[1]}", timeout=0.5)
        with pytest.raises(TimeoutError):
            pool.get("/x", [])
    finally:
        stalled.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with pytest.raises(ConnectionRefusedError):
        Http1Pool(f"http://127.0.0.1:{port}", timeout=5).get("/x", [])


def test_a_head_timeout_bounds_the_wait_for_the_headers_but_not_the_body():
    """``head_timeout`` cuts a request whose headers do not come, where the pool's own
    timeout (an hour here) would wait on; once the headers are in, the body's waits are the
    pool's again, so a body that pauses for longer than the head timeout still arrives."""
    stalled = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        pool = Http1Pool(f"http://127.0.0.1:{stalled.getsockname()[1]}", timeout=3600)
        outcome: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()

        def get() -> None:
            try:
                pool.get("/x", [], head_timeout=0.5)
                outcome.put(None)
            except BaseException as exc:
                outcome.put(exc)

        threading.Thread(target=get, daemon=True).start()
        assert isinstance(outcome.get(timeout=WAIT_S), TimeoutError)
    finally:
        stalled.close()

    def headers_then_pause(_head: bytes) -> tuple[bytes, bool]:
        return b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", False

    server = ScriptedServer([headers_then_pause])
    pool = Http1Pool(f"http://127.0.0.1:{server.port}", timeout=WAIT_S)
    try:
        response = pool.get("/x", [], head_timeout=2.0)
        assert response.status == 200
        with ThreadPoolExecutor(1) as thread:
            body = thread.submit(response.read)
            time.sleep(3.0)  # longer than the head timeout: the body's wait must outlast it
            server.send_to_last(b"hello")
            assert body.result(timeout=WAIT_S) == b"hello"
    finally:
        pool.close()
        server.close()


def test_origins_it_cannot_serve_are_refused():
    with pytest.raises(ValueError):
        Http1Pool("ftp://127.0.0.1:21", timeout=1)
    with pytest.raises(ValueError):
        Http1Pool("https://127.0.0.1:443", timeout=1)  # https without a TLS context
    pool = Http1Pool("http://example.invalid:80", timeout=1)
    assert pool.host_header == "example.invalid"  # the default port is not in Host


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost, made by openssl."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_https_with_a_trusted_certificate_and_refused_with_an_untrusted_one(certificate):
    cert, key = certificate
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    server = ScriptedServer([ok(b"over tls")], tls=server_side)
    try:
        trusting = ssl.create_default_context(cafile=str(cert))
        pool = Http1Pool(f"https://localhost:{server.port}", timeout=10, tls=trusting)
        assert pool.get("/x", []).read() == b"over tls"
        assert pool.get("/y", []).read() == b"over tls"
        assert server.connections == 1
        pool.close()
        stranger = ssl.create_default_context()  # the system's CAs: not our certificate
        pool = Http1Pool(f"https://localhost:{server.port}", timeout=10, tls=stranger)
        with pytest.raises(ssl.SSLCertVerificationError):
            pool.get("/x", [])
    finally:
        server.close()
