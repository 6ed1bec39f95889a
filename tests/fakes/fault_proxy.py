"""A threaded HTTP/1.1 reverse proxy on 127.0.0.1 that counts requests and injects faults.

Put it between the code under test and a real upstream (moto, the fake OSS server) to:

- **count** requests: ``proxy.count("GET", path_contains="train/")`` — every request that
  reached the proxy, answered or faulted, by method and URL path (percent-decoded, without the
  query string: a ListObjects call counts as ``GET /bucket``); ``proxy.user_agents(...)``: the
  User-Agent headers they came with (which client sent them);
- **inject faults** by rule, each for the next ``n`` matching requests or until cleared:
  an HTTP error with an S3/OSS-style XML body (``fail_next``, ``fail_matching``, or for a
  random fraction of the requests ``fail_fraction``: a throttling store), a TCP reset
  (``reset_next``), a delay (``delay_next``), a body cut short (``truncate_next``), no
  answer at all (``blackhole``), a ``Range`` header dropped (``ignore_range_next``), or a
  *stall* — a pause before the response or in the middle of its body, after which the answer
  goes on byte-exactly — for the next ``n`` requests (``stall_next``) or for a random fraction
  of them (``stall_fraction``; :attr:`stalled` counts the stalls); a request takes the first
  matching rule, in the order the rules were added (a fractional rule a request does not draw
  passes it on to the next);
- **stop and restart** on the same port (``stop()``/``start()``): the "store went away" case;
- **model a slow store** for benchmarks: ``first_byte_delay_s`` before every response and
  ``bandwidth_bytes_per_s`` per connection.

Bodies pass through byte-exactly in both directions. Client connections are kept alive
whatever the upstream does (moto closes its connection after every response); each client
connection has its own upstream connection, reopened as needed. The ``Host`` header is
forwarded unchanged, so signatures computed over the proxy's address still verify upstream.

Example::

    with FaultProxy(moto.endpoint) as proxy:
        proxy.fail_next(2, status=503)            # two SlowDowns, then real answers
        store = S3Store(StoreConfig(uri, endpoint=proxy.url))
        store.get_range(...)
        assert proxy.count("GET") == 3
"""

from __future__ import annotations

import http.client
import random
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote, urlsplit

# Headers that describe one hop of a connection, not the message (RFC 9110 section 7.6.1); the
# proxy frames bodies itself, and has already answered any "Expect: 100-continue".
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_DEFAULT_ERROR_CODES = {
    403: "AccessDenied",
    404: "NoSuchKey",
    500: "InternalError",
    502: "BadGateway",
    503: "SlowDown",
    504: "GatewayTimeout",
}
_RELAY_CHUNK = 64 * 1024


@dataclass
class FaultRule:
    """One fault: what to do to requests matching ``method`` and ``path_contains``.

    ``remaining`` is how many more requests it applies to (None: until cleared).
    """

    action: str  # "status" | "reset" | "delay" | "truncate" | "blackhole" | "stall" | "no_range"
    method: str | None = None
    path_contains: str | None = None
    remaining: int | None = None
    status: int = 503
    code: str = "SlowDown"
    delay_s: float = 0.0  # "delay" and "stall": how long
    keep_bytes: int = 0  # "truncate": body bytes sent before the cut
    stall_after_bytes: int | None = None  # "stall": mid-body after this many; None: before
    fraction: float = 1.0  # the share of matching requests it takes (drawn per request)

    def matches(self, method: str, path: str) -> bool:
        return (self.method is None or self.method == method) and (
            self.path_contains is None or self.path_contains in path
        )


class FaultProxy:
    """See the module docstring. ``port=0`` picks a free port on the first :meth:`start`;
    later starts reuse it."""

    def __init__(
        self,
        upstream: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        first_byte_delay_s: float = 0.0,
        bandwidth_bytes_per_s: float | None = None,
        upstream_timeout_s: float = 60.0,
    ):
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"upstream must be an http://host:port URL, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.host = host
        self.port = port
        #: Seconds to wait before answering each request (models a real store's latency).
        self.first_byte_delay_s = first_byte_delay_s
        #: Per-connection cap on response body bytes per second (None: unlimited).
        self.bandwidth_bytes_per_s = bandwidth_bytes_per_s
        self.upstream_timeout_s = upstream_timeout_s
        self._lock = threading.Lock()
        self._seen: list[tuple[str, str]] = []
        self._user_agents: list[str] = []  # the User-Agent of each request in _seen
        self._rules: list[FaultRule] = []
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self._stopping = threading.Event()  # set while stopped: wakes delays and black holes
        self._unblock = threading.Event()  # set when black-holed requests should give up
        self._random = random.Random(0)  # draws for fractional rules: the same run, every run
        self._stalled = 0

    # --- lifecycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        if self._server is not None:
            raise RuntimeError("fault proxy already running")
        self._stopping = threading.Event()
        self._unblock = threading.Event()
        self._server = _Server((self.host, self.port), _ProxyHandler, proxy=self)
        self.port = self._server.server_address[1]
        self._serve_thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fault-proxy-{self.port}",
            daemon=True,
        )
        self._serve_thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (clients see resets/EOF), like a store
        that went down. :meth:`start` brings it back on the same port."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        self._unblock.set()
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by its handler
        if self._serve_thread is not None:
            self._serve_thread.join(timeout=10)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --- counting -----------------------------------------------------------------------------

    def count(self, method: str | None = None, *, path_contains: str | None = None) -> int:
        """How many requests (faulted ones included) matched ``method`` and ``path_contains``."""
        with self._lock:
            return sum(
                1
                for seen_method, path in self._seen
                if (method is None or seen_method == method)
                and (path_contains is None or path_contains in path)
            )

    @property
    def requests(self) -> list[tuple[str, str]]:
        """(method, decoded path) of every request so far, oldest first."""
        with self._lock:
            return list(self._seen)

    def user_agents(
        self, method: str | None = None, *, path_contains: str | None = None
    ) -> set[str]:
        """The User-Agent headers ("" for none) of the requests matching ``method`` and
        ``path_contains``: which client sent them."""
        with self._lock:
            return {
                agent
                for (seen_method, path), agent in zip(self._seen, self._user_agents, strict=True)
                if (method is None or seen_method == method)
                and (path_contains is None or path_contains in path)
            }

    def reset_counts(self) -> None:
        with self._lock:
            self._seen.clear()
            self._user_agents.clear()
            self._stalled = 0

    @property
    def stalled(self) -> int:
        """How many requests a stall rule has held so far."""
        with self._lock:
            return self._stalled

    # --- faults ------------------------------------------------------------------------------

    def fail_next(
        self,
        n: int,
        status: int = 503,
        *,
        code: str | None = None,
        method: str | None = "GET",
        path_contains: str | None = None,
    ) -> None:
        """Answer the next ``n`` matching requests with ``status`` and an XML error body whose
        ``<Code>`` is ``code`` (default by status: 503 SlowDown, 500 InternalError, ...)."""
        self._add(FaultRule("status", method, path_contains, n, status, _code(status, code)))

    def fail_matching(
        self,
        path_contains: str,
        status: int = 503,
        *,
        code: str | None = None,
        method: str | None = None,
    ) -> None:
        """Answer every request whose path contains ``path_contains`` with ``status``, until
        :meth:`clear_faults`."""
        self._add(FaultRule("status", method, path_contains, None, status, _code(status, code)))

    def fail_fraction(
        self,
        fraction: float,
        status: int = 503,
        *,
        code: str | None = None,
        method: str | None = "GET",
        path_contains: str | None = None,
    ) -> None:
        """Answer a random ``fraction`` (0..1) of the matching requests with ``status`` (503
        SlowDown by default: a store throttling us), until :meth:`clear_faults`. The draws
        come from a seeded generator."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], not {fraction}")
        self._add(
            FaultRule(
                "status", method, path_contains, None, status, _code(status, code),
                fraction=fraction,
            )
        )  # fmt: skip

    def reset_next(
        self, n: int = 1, *, method: str | None = "GET", path_contains: str | None = None
    ) -> None:
        """Reset the TCP connection (RST, no response) on the next ``n`` matching requests."""
        self._add(FaultRule("reset", method, path_contains, n))

    def delay_next(
        self,
        n: int,
        delay_s: float,
        *,
        method: str | None = None,
        path_contains: str | None = None,
    ) -> None:
        """Hold the next ``n`` matching requests for ``delay_s`` before forwarding them."""
        self._add(FaultRule("delay", method, path_contains, n, delay_s=delay_s))

    def truncate_next(
        self,
        n: int = 1,
        keep_bytes: int = 0,
        *,
        method: str | None = "GET",
        path_contains: str | None = None,
    ) -> None:
        """Forward the next ``n`` matching requests, but cut each response body after
        ``keep_bytes`` bytes and close the connection (headers still promise the full length):
        a transfer that dies midway."""
        self._add(FaultRule("truncate", method, path_contains, n, keep_bytes=keep_bytes))

    def ignore_range_next(
        self, n: int = 1, *, method: str | None = "GET", path_contains: str | None = None
    ) -> None:
        """Forward the next ``n`` matching requests without their ``Range`` header, as a store
        that ignores it would: the whole object comes back (with 200)."""
        self._add(FaultRule("no_range", method, path_contains, n))

    def stall_next(
        self,
        n: int,
        stall_s: float,
        *,
        after_bytes: int | None = None,
        method: str | None = "GET",
        path_contains: str | None = None,
    ) -> None:
        """Stall the next ``n`` matching requests for ``stall_s``, then answer them in full:
        before the response (``after_bytes=None``: the client waits for its first byte), or
        after ``after_bytes`` bytes of the body (headers and those bytes sent and flushed).
        A stall ends early at :meth:`clear_faults` or :meth:`stop` (which drops the connection).
        """
        self._add(
            FaultRule(
                "stall", method, path_contains, n, delay_s=stall_s, stall_after_bytes=after_bytes
            )
        )

    def stall_fraction(
        self,
        fraction: float,
        stall_s: float,
        *,
        after_bytes: int | None = None,
        method: str | None = "GET",
        path_contains: str | None = None,
    ) -> None:
        """Like :meth:`stall_next`, for a random ``fraction`` (0..1) of the matching requests,
        until :meth:`clear_faults`. The draws come from a seeded generator."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], not {fraction}")
        self._add(
            FaultRule(
                "stall",
                method,
                path_contains,
                delay_s=stall_s,
                stall_after_bytes=after_bytes,
                fraction=fraction,
            )
        )

    def blackhole(self, *, method: str | None = None, path_contains: str | None = None) -> None:
        """Accept matching requests but never answer them (until :meth:`clear_faults` or
        :meth:`stop`, which then drop the connection): a store that hangs."""
        self._add(FaultRule("blackhole", method, path_contains))

    def clear_faults(self) -> None:
        """Remove all rules and let black-holed requests go (their connections are dropped)."""
        with self._lock:
            self._rules.clear()
            unblock, self._unblock = self._unblock, threading.Event()
        unblock.set()

    def _add(self, rule: FaultRule) -> None:
        with self._lock:
            self._rules.append(rule)

    # --- used by the handler -----------------------------------------------------------------

    def _record_and_match(
        self, method: str, path: str, user_agent: str = ""
    ) -> tuple[FaultRule | None, threading.Event]:
        """Count the request and consume one use of the first rule that matches it."""
        with self._lock:
            self._seen.append((method, path))
            self._user_agents.append(user_agent)
            for rule in self._rules:
                if rule.matches(method, path):
                    if rule.fraction < 1.0 and self._random.random() >= rule.fraction:
                        continue  # not drawn this time: the next rule, or no fault
                    if rule.action == "stall":
                        self._stalled += 1
                    if rule.remaining is not None:
                        rule.remaining -= 1
                        if rule.remaining <= 0:
                            self._rules.remove(rule)
                    return rule, self._unblock
            return None, self._unblock

    def _track(self, connection: socket.socket, active: bool) -> None:
        with self._lock:
            if active:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)


def _code(status: int, code: str | None) -> str:
    return code or _DEFAULT_ERROR_CODES.get(status, "InjectedFault")


class _Server(socketserver.ThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True  # restart on the same port while old sockets sit in TIME_WAIT
    daemon_threads = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], handler: type, *, proxy: FaultProxy):
        self.proxy = proxy
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients vanishing mid-request are routine here: no tracebacks for those."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _ProxyHandler(BaseHTTPRequestHandler):
    """Handles one client connection (many requests over keep-alive)."""

    protocol_version = "HTTP/1.1"
    server: _Server
    # TCP_NODELAY: an answer goes out as two writes (head, then body); with Nagle on, a short
    # body waits for the client's delayed ACK of the head, ~40 ms per answer on loopback.
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()
        self.proxy = self.server.proxy
        self.proxy._track(self.connection, True)
        self.upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass  # the client is gone already
        if self.upstream is not None:
            self.upstream.close()
        self.proxy._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: tests count requests with FaultProxy.count(), not by reading logs."""

    def do_GET(self) -> None:
        self._proxy_request()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _proxy_request(self) -> None:
        method = self.command
        path = unquote(urlsplit(self.path).path)
        try:
            body = self._read_request_body()
        except (OSError, ValueError):
            self.close_connection = True
            return
        user_agent = self.headers.get("User-Agent", "")
        rule, unblock = self.proxy._record_and_match(method, path, user_agent)
        action = "forward" if rule is None else rule.action
        if action == "blackhole":
            unblock.wait()  # until clear_faults() or stop(); then drop the connection
            self.close_connection = True
            return
        if action == "reset":
            self._reset_connection()
            return
        delay_s = self.proxy.first_byte_delay_s + (rule.delay_s if action == "delay" else 0.0)
        if delay_s > 0 and self.proxy._stopping.wait(delay_s):
            self.close_connection = True  # stopped while waiting
            return
        if action == "no_range":
            del self.headers["Range"]
        stall = None
        if action == "stall":
            if rule.stall_after_bytes is None:
                if not self._stall(rule.delay_s, unblock):
                    return
            else:
                stall = (rule.stall_after_bytes, rule.delay_s, unblock)
        try:
            if action == "status":
                self._send_error(rule.status, rule.code)
            else:
                keep_bytes = rule.keep_bytes if action == "truncate" else None
                self._forward(method, body, keep_bytes, stall)
        except OSError:
            self.close_connection = True  # client or upstream went away mid-exchange

    def _stall(self, stall_s: float, unblock: threading.Event) -> bool:
        """Hold this request for ``stall_s`` (less if the faults are cleared). False if the
        proxy was stopped meanwhile: the connection is then dropped."""
        unblock.wait(stall_s)
        if self.proxy._stopping.is_set():
            self.close_connection = True
            return False
        return True

    def _read_request_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return _read_chunked(self.rfile)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reset_connection(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN. The socket is
        # only really closed once its buffered reader is closed too, so close that first.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.rfile.close()
        self.connection.close()
        self.close_connection = True

    def _send_error(self, status: int, code: str) -> None:
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>injected by the test fault proxy</Message>"
            "<RequestId>fault-proxy</RequestId></Error>"
        ).encode()
        head = [
            f"HTTP/1.1 {status} {http.client.responses.get(status, 'Error')}",
            "Content-Type: application/xml",
            f"Content-Length: {0 if self.command == 'HEAD' else len(body)}",
        ]
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if self.command != "HEAD":
            self.wfile.write(body)

    def _forward(
        self,
        method: str,
        body: bytes,
        keep_bytes: int | None,
        stall: tuple[int, float, threading.Event] | None = None,
    ) -> None:
        try:
            response = self._send_upstream(method, body)
        except (OSError, http.client.HTTPException):
            self._send_error(502, "BadGateway")
            return
        try:
            self._relay_response(response, keep_bytes, stall)
        finally:
            response.close()
        if response.will_close and self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    def _send_upstream(self, method: str, body: bytes) -> http.client.HTTPResponse:
        if self.upstream is not None:
            try:
                return self._request_on(self.upstream, method, body)
            except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine):
                # The upstream closed our kept-alive connection meanwhile: once more, afresh.
                self.upstream.close()
        self.upstream = http.client.HTTPConnection(
            *self.proxy.upstream, timeout=self.proxy.upstream_timeout_s
        )
        return self._request_on(self.upstream, method, body)

    def _request_on(
        self, upstream: http.client.HTTPConnection, method: str, body: bytes
    ) -> http.client.HTTPResponse:
        upstream.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
        for name, value in self.headers.items():
            if name.lower() not in _HOP_BY_HOP and name.lower() != "content-length":
                upstream.putheader(name, value)
        if body or method in ("PUT", "POST"):
            upstream.putheader("Content-Length", str(len(body)))
        upstream.endheaders(body or None)
        return upstream.getresponse()

    def _relay_response(
        self,
        response: http.client.HTTPResponse,
        keep_bytes: int | None,
        stall: tuple[int, float, threading.Event] | None = None,
    ) -> None:
        """Send the upstream response on; with ``keep_bytes``, only that much of the body,
        then close the connection; with ``stall`` (offset, seconds, unblock), pause the body
        at that offset."""
        head = [f"HTTP/1.1 {response.status} {response.reason}"]
        for name, value in response.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                head.append(f"{name}: {value}")
        has_length = response.getheader("Content-Length") is not None
        bodyless = self.command == "HEAD" or response.status in (204, 304)
        chunked = not (bodyless or has_length)
        if chunked:
            # Chunked or close-delimited upstream body: re-frame it as chunked for our client,
            # whose connection can then stay open whatever the upstream does with its own.
            head.append("Transfer-Encoding: chunked")
        if keep_bytes is not None:
            head.append("Connection: close")
            self.close_connection = True
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if not bodyless:
            self._relay_body(response, chunked=chunked, keep_bytes=keep_bytes, stall=stall)

    def _relay_body(
        self,
        response: http.client.HTTPResponse,
        *,
        chunked: bool,
        keep_bytes: int | None,
        stall: tuple[int, float, threading.Event] | None = None,
    ) -> None:
        started = time.monotonic()
        sent = 0
        stall_at, stall_s, unblock = stall if stall is not None else (None, 0.0, None)
        while True:
            if stall_at is not None and sent >= stall_at:
                self.wfile.flush()  # the client has had these bytes; now nothing for a while
                if not self._stall(stall_s, unblock):
                    return
                stall_at = None
            room = _RELAY_CHUNK if stall_at is None else stall_at - sent
            chunk = response.read(min(_RELAY_CHUNK, room))
            if not chunk:
                break
            if keep_bytes is not None:
                chunk = chunk[: max(0, keep_bytes - sent)]
                if not chunk:
                    return  # cut here: no terminating chunk, and the connection gets closed
            if chunked:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            else:
                self.wfile.write(chunk)
            sent += len(chunk)
            self._pace(started, sent)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def _pace(self, started: float, sent: int) -> None:
        rate = self.proxy.bandwidth_bytes_per_s
        if rate:
            ahead_s = sent / rate - (time.monotonic() - started)
            if ahead_s > 0:
                self.proxy._stopping.wait(ahead_s)


def _read_chunked(rfile: Any) -> bytes:
    """Read a chunked request body (RFC 9112 section 7.1), dropping any trailer fields."""
    chunks = []
    while True:
        size_line = rfile.readline(1024)
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(chunks)
        chunks.append(rfile.read(size))
        rfile.readline(1024)  # the CRLF after the chunk data
