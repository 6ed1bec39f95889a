"""A minimal HTTP/1.1 client for the lean GET path: keep-alive connections to one origin.

urllib3 and http.client cost ~0.5 ms of CPU per GET here (header objects, response classes,
several layers of Python around the socket); this client sends one GET as one ``sendall``,
reads the status line and headers with the C ``readline`` of an ``io.BufferedReader``, and the
body with one ``read(length)`` of it, which receives a large body straight into the bytes
object it returns (one copy, no zero-filled buffer). It does only what the lean client
needs: GET, bodies framed by Content-Length, chunked transfer coding, or the end of the
connection; HTTP and HTTPS (the caller's TLS context); one request at a time per connection,
idle connections kept for reuse.

Failures are exceptions the store's error mapping knows (``cachefs.store.s3.map_error``):
``OSError`` subclasses for the network (refused, reset, timeouts: every socket operation is
bounded by ``timeout``), :class:`MalformedAnswer` for an answer that is not HTTP/1.x, and
:class:`BodyCutShort` for a connection that ended inside a body. A request on a reused
connection that the server had closed meanwhile (it is idle-timed-out on their side) is sent
again once on a new connection: a GET is idempotent, and no byte of an answer was seen.
"""

from __future__ import annotations

import io
import socket
import ssl
import threading
from urllib.parse import urlsplit

#: Largest status line + headers accepted.
MAX_HEAD_BYTES = 64 * 1024
#: The connection's read buffer (a larger read goes straight into the bytes it returns).
RECV_BYTES = 256 * 1024


class MalformedAnswer(ConnectionError):
    """The answer is not an HTTP/1.x response this client can read (a store or proxy bug)."""


class BodyCutShort(ConnectionError):
    """The connection ended (or broke) inside a body: its bytes are never handed out."""


class _Stale(Exception):
    """A reused connection was closed by the server before any byte of the answer."""


class _Connection:
    __slots__ = ("reader", "reused", "sock")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = io.BufferedReader(socket.SocketIO(sock, "rb"), RECV_BYTES)
        self.reused = False

    def line(self) -> bytes:
        """One line of a head or of chunk framing, CRLF included; the connection must not end."""
        line = self.reader.readline(MAX_HEAD_BYTES + 1)
        if not line.endswith(b"\n"):
            if len(line) > MAX_HEAD_BYTES:
                raise MalformedAnswer("an answer line is too long")
            raise BodyCutShort("the store closed the connection inside an answer's head")
        return line

    def exactly(self, length: int) -> bytes:
        data = self.reader.read(length)
        if len(data) < length:
            raise BodyCutShort(f"the store closed the connection {length - len(data)} bytes early")
        return data

    def close(self) -> None:
        try:
            self.reader.close()
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
        if reusable:
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

    def get(
        self, path: str, headers: list[tuple[str, str]], *, head_timeout: float | None = None
    ) -> Response:
        """Send ``GET path`` with ``headers`` (Host is added) and return once the status line
        and headers are in; the caller then reads or closes the :class:`Response`.
        ``head_timeout``, if given, bounds the connect and every wait up to the headers
        instead of the pool's ``timeout`` (which still bounds each wait in the body)."""
        request = encode_get(self.host_header, path, headers)
        for fresh in (False, True):
            connection = self._take(fresh, head_timeout)
            try:
                if head_timeout is not None:
                    connection.sock.settimeout(head_timeout)
                try:
                    connection.sock.sendall(request)
                except (BrokenPipeError, ConnectionResetError):
                    if connection.reused:
                        raise _Stale from None
                    raise
                response = self._read_head(connection)
                if head_timeout is not None:
                    connection.sock.settimeout(self._timeout)
                return response
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

    def _take(self, fresh: bool, connect_timeout: float | None) -> _Connection:
        if not fresh:
            with self._lock:
                if self._idle:
                    connection = self._idle.pop()
                    connection.reused = True
                    return connection
        timeout = self._timeout if connect_timeout is None else connect_timeout
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
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
        try:
            first = connection.reader.readline(MAX_HEAD_BYTES + 1)
        except (ConnectionResetError, BrokenPipeError):
            if connection.reused:
                raise _Stale from None
            raise
        if not first and connection.reused:
            raise _Stale
        while True:
            lines = [first]
            total = len(first)
            while lines[-1] not in (b"\r\n", b"\n"):
                if not lines[-1].endswith(b"\n"):
                    if total > MAX_HEAD_BYTES:
                        raise MalformedAnswer("the answer's headers are too long")
                    raise BodyCutShort("the store closed the connection before its answer's end")
                lines.append(connection.reader.readline(MAX_HEAD_BYTES + 1))
                total += len(lines[-1])
                if total > MAX_HEAD_BYTES:
                    raise MalformedAnswer("the answer's headers are too long")
            status, headers = parse_head(lines[:-1])
            if not 100 <= status < 200:
                return Response(self, connection, status, headers)
            # An interim answer (100 Continue): the real one follows.
            first = connection.line()


def encode_get(host_header: str, path: str, headers: list[tuple[str, str]]) -> bytes:
    """The bytes of ``GET path`` to ``host_header`` with ``headers``: one request head."""
    lines = [f"GET {path} HTTP/1.1", f"Host: {host_header}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(lines: list[bytes]) -> tuple[int, dict[str, str]]:
    """The status and headers (names lower-cased) of an answer's head, given as its lines
    without the empty one that ends it. Raises :class:`MalformedAnswer`."""
    parts = lines[0].decode("latin-1").rstrip("\r\n").split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise MalformedAnswer("the answer does not start with an HTTP/1.x status line")
    headers: dict[str, str] = {}
    for raw in lines[1:]:
        name, colon, value = raw.decode("latin-1").partition(":")
        if not colon:
            raise MalformedAnswer("an answer header line has no colon")
        headers[name.strip().lower()] = value.strip()
    if parts[0] == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
        headers["connection"] = "close"  # HTTP/1.0 closes after each answer unless it says not
    return int(parts[1]), headers


def _content_length(value: str) -> int:
    if not value.isdigit():
        raise MalformedAnswer("the answer's Content-Length is not a number")
    return int(value)


def _read_exact(connection: _Connection, length: int) -> bytes:
    return connection.exactly(length)


def _read_chunked(connection: _Connection, limit: int | None) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = connection.line().split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise MalformedAnswer("a chunk size is not hexadecimal") from None
        if size == 0:
            while connection.line() not in (b"\r\n", b"\n"):  # trailers, up to the empty line
                pass
            return b"".join(parts)
        if limit is not None and total + size > limit:
            parts.append(connection.exactly(limit - total))
            return b"".join(parts)
        parts.append(connection.exactly(size))
        total += size
        if connection.line() not in (b"\r\n", b"\n"):
            raise MalformedAnswer("a chunk does not end where its size says")


def _read_to_end(connection: _Connection, limit: int | None) -> bytes:
    return connection.reader.read() if limit is None else connection.reader.read(limit)
