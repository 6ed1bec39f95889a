"""A minimal HTTP/1.1 client for the lean GET path: keep-alive connections to one origin.

urllib3 and http.client cost ~0.5 ms of CPU per GET here (header objects, response classes,
several layers of buffered reads); this client sends one GET as one ``sendall``, reads the
status line and headers from one buffer, and receives the body straight into a buffer of its
announced length. It does only what the lean client needs: GET, bodies framed by
Content-Length, chunked transfer coding, or the end of the connection; HTTP and HTTPS (the
caller's TLS context); one request at a time per connection, idle connections kept for reuse.

Failures are exceptions the store's error mapping knows (``cachefs.store.s3.map_error``):
``OSError`` subclasses for the network (refused, reset, timeouts: every socket operation is
bounded by ``timeout``), :class:`MalformedAnswer` for an answer that is not HTTP/1.x, and
:class:`BodyCutShort` for a connection that ended inside a body. A request on a reused
connection that the server had closed meanwhile (it is idle-timed-out on their side) is sent
again once on a new connection: a GET is idempotent, and no byte of an answer was seen.
"""

from __future__ import annotations

import socket
import ssl
import threading
from urllib.parse import urlsplit

#: Largest status line + headers accepted.
MAX_HEAD_BYTES = 64 * 1024
#: One recv() of the head or of a body whose length is not announced.
RECV_BYTES = 256 * 1024


class MalformedAnswer(ConnectionError):
    """The answer is not an HTTP/1.x response this client can read (a store or proxy bug)."""


class BodyCutShort(ConnectionError):
    """The connection ended (or broke) inside a body: its bytes are never handed out."""


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the answer."""


class _Connection:
    __slots__ = ("buffered", "reused", "sock")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffered = b""  # received past what was consumed (the start of a body)
        self.reused = False

    def recv_more(self) -> bytes:
        data = self.sock.recv(RECV_BYTES)
        if not data:
            raise BodyCutShort("the store closed the connection")
        return data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Response:
    """One answer: ``status``, ``headers`` (names lower-cased), and the body, read once with
    :meth:`read` (after which the connection goes back to the pool when it can carry another
    request) or dropped with :meth:`close`."""

    __slots__ = ("_connection", "_pool", "headers", "status")

    def __init__(
        self, pool: Http1Pool, connection: _Connection, status: int, headers: dict[str, str]
    ):
        self._pool = pool
        self._connection: _Connection | None = connection
        self.status = status
        self.headers = headers

    def read(self, limit: int | None = None) -> bytes:
        """The whole body; with ``limit``, at most that many bytes (the rest is not read and
        the connection is closed). Raises :class:`BodyCutShort` if the connection ends early."""
        connection = self._connection
        if connection is None:
            raise RuntimeError("the body was read or dropped already")
        self._connection = None
        reusable = self.headers.get("connection", "").lower() != "close"
        try:
            if self.status in (204, 304) or 100 <= self.status < 200:
                body = b""
            elif "chunked" in self.headers.get("transfer-encoding", "").lower():
                body = _read_chunked(connection, limit)
                reusable = reusable and limit is None
            elif "content-length" in self.headers:
                length = _content_length(self.headers["content-length"])
                if limit is not None and length > limit:
                    body, reusable = _read_exact(connection, limit), False
                else:
                    body = _read_exact(connection, length)
            else:  # delimited by the end of the connection
                body, reusable = _read_to_end(connection, limit), False
        except BaseException:
            connection.close()
            raise
        if reusable and not connection.buffered:
            self._pool._give_back(connection)
        else:
            connection.close()
        return body

    def close(self) -> None:
        """Drop the answer unread: its connection cannot carry another request."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None


class Http1Pool:
    """Keep-alive HTTP/1.1 connections to the origin of ``url_start`` ("http://host:port" or
    "https://host"). Thread-safe; at most ``max_idle`` idle connections are kept."""

    def __init__(
        self,
        url_start: str,
        *,
        timeout: float,
        tls: ssl.SSLContext | None = None,
        max_idle: int = 16,
    ):
        url = urlsplit(url_start)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) origin: {url_start!r}")
        if url.scheme == "https" and tls is None:
            raise ValueError("an https origin needs a TLS context")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        # The Host header (and what SigV4 signs): the port only when it is not the default.
        default_port = url.port is None or url.port == (443 if url.scheme == "https" else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if default_port else f"{host}:{url.port}"
        self._timeout = timeout
        self._tls = tls if url.scheme == "https" else None
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._closed = False

    def get(self, path: str, headers: list[tuple[str, str]]) -> Response:
        """Send ``GET path`` with ``headers`` (Host is added) and return once the status line
        and headers are in; the caller then reads or closes the :class:`Response`."""
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.host_header}"]
        lines += [f"{name}: {value}" for name, value in headers]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        for fresh in (False, True):
            connection = self._take(fresh)
            try:
                try:
                    connection.sock.sendall(request)
                except (BrokenPipeError, ConnectionResetError):
                    if connection.reused:
                        raise _Stale from None
                    raise
                return self._read_head(connection)
            except _Stale:
                connection.close()  # closed by the server while idle: once more, anew
            except BaseException:
                connection.close()
                raise
        raise AssertionError("unreachable: a new connection is never stale")

    def close(self) -> None:
        """Close the idle connections; those in use close when their answer is done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    @property
    def idle_connections(self) -> int:
        return len(self._idle)

    # --- internals --------------------------------------------------------------------------

    def _take(self, fresh: bool) -> _Connection:
        if not fresh:
            with self._lock:
                if self._idle:
                    connection = self._idle.pop()
                    connection.reused = True
                    return connection
        sock = socket.create_connection((self.host, self.port), timeout=self._timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        return _Connection(sock)

    def _give_back(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(connection)
                return
        connection.close()

    def _read_head(self, connection: _Connection) -> Response:
        head = b""
        while (end := head.find(b"\r\n\r\n")) < 0:
            if len(head) > MAX_HEAD_BYTES:
                raise MalformedAnswer("the answer's headers are too long")
            try:
                data = connection.sock.recv(RECV_BYTES)
            except (ConnectionResetError, BrokenPipeError):
                if connection.reused and not head:
                    raise _Stale from None
                raise
            if not data:
                if connection.reused and not head:
                    raise _Stale
                raise BodyCutShort("the store closed the connection before its answer's end")
            head += data
        if end > MAX_HEAD_BYTES:
            raise MalformedAnswer("the answer's headers are too long")
        connection.buffered = head[end + 4 :]
        status, headers = _parse_head(head[:end])
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            connection.reused = False
            while (end := connection.buffered.find(b"\r\n\r\n")) < 0:
                if len(connection.buffered) > MAX_HEAD_BYTES:
                    raise MalformedAnswer("the answer's headers are too long")
                connection.buffered += connection.recv_more()
            head, connection.buffered = connection.buffered[:end], connection.buffered[end + 4 :]
            status, headers = _parse_head(head)
        return Response(self, connection, status, headers)


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise MalformedAnswer("the answer does not start with an HTTP/1.x status line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon:
            raise MalformedAnswer("an answer header line has no colon")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise MalformedAnswer("the answer's Content-Length is not a number")
    return int(value)


def _read_exact(connection: _Connection, length: int) -> bytes:
    buffered = connection.buffered
    if len(buffered) >= length:
        connection.buffered = buffered[length:]
        return buffered[:length]
    body = bytearray(length)
    view = memoryview(body)
    view[: len(buffered)] = buffered
    filled = len(buffered)
    connection.buffered = b""
    sock = connection.sock
    while filled < length:
        received = sock.recv_into(view[filled:])
        if received == 0:
            raise BodyCutShort(f"the store closed the connection {length - filled} bytes early")
        filled += received
    return bytes(body)


def _read_line(connection: _Connection) -> bytes:
    while (end := connection.buffered.find(b"\r\n")) < 0:
        if len(connection.buffered) > MAX_HEAD_BYTES:
            raise MalformedAnswer("a chunk header is too long")
        connection.buffered += connection.recv_more()
    line = connection.buffered[:end]
    connection.buffered = connection.buffered[end + 2 :]
    return line


def _read_chunked(connection: _Connection, limit: int | None) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = _read_line(connection).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise MalformedAnswer("a chunk size is not hexadecimal") from None
        if size == 0:
            while _read_line(connection):  # trailers, up to the empty line
                pass
            return b"".join(parts)
        if limit is not None and total + size > limit:
            parts.append(_read_exact(connection, limit - total))
            return b"".join(parts)
        parts.append(_read_exact(connection, size))
        total += size
        if _read_line(connection):
            raise MalformedAnswer("a chunk does not end where its size says")


def _read_to_end(connection: _Connection, limit: int | None) -> bytes:
    parts = [connection.buffered]
    total = len(connection.buffered)
    connection.buffered = b""
    while limit is None or total < limit:
        data = connection.sock.recv(RECV_BYTES)
        if not data:
            break
        parts.append(data)
        total += len(data)
    body = b"".join(parts)
    return body if limit is None else body[:limit]
