"""First tries of many ranged S3 GETs at once, on one thread: a selector loop.

A preload fetcher process (cachefs/cluster/fetchers.py) keeps dozens of GETs in flight. With a
thread per GET, each one costs several thread wake-ups and GIL hand-offs (the request handed
to a thread, the answer's head, its body, the answer sent back), and on a small machine those
cost more CPU than the HTTP itself (bench/results/store_fetch_rate/2026-12-01-get-loop.md).
Here one thread sends each request on a keep-alive connection of its own and, each time the
selector wakes, reads whatever has arrived on every connection: under load one wake-up serves
many answers.

It completes the plain cases, within the bounds of :class:`~cachefs.store.base.RetryPolicy`
that an inline first try has (cachefs/store/retry.py: the connect and the head within
``hedge_after_s``, no pause in the body longer than ``attempt_timeout_s``):

- an answer ``206`` (or ``200`` for a range from offset 0) whose ``Content-Length`` is the
  length asked and whose ETag, when it sends one, is the one asked for: the bytes;
- an S3 error answer (a status of 300 or more, its XML body framed by ``Content-Length``) that
  is permanent — no such key, the object changed, credentials refused: the very error
  :meth:`S3BulkReader.get_range <cachefs.store.s3_bulk.S3BulkReader.get_range>` raises for it
  (:meth:`~cachefs.store.s3_bulk.S3BulkReader.answer_error`), so the store is asked once, as
  on the ordinary path.

Anything else — a refused or slow connect, a transient error answer (5xx, "slow down"),
another length, chunked coding, a changed ETag on a 2xx, a stall, a body cut short — ends the
try *not done here*: the caller then reads the range through ``get_range``, with its retries,
hedges, backoff and one-line errors. That read starts anew (its own tries and deadline, so a
range can take up to the loop's try longer than ``deadline_s``), as a stalled try is replaced
at once; a "slow down" answer marks the try *throttled*, for the caller's adaptive limit and
for a backoff before that read (cachefs/cluster/fetchers.py). A request on a kept connection
that the store closed while it was idle (no byte of an answer seen) is sent once more on a new
connection, as :class:`~cachefs.store.http1.Http1Pool` does, and a kept connection is reused
only while it has nothing to read: bytes past the last answer would be taken for the next.

Connects (TCP and, for ``https``, the TLS handshake) are non-blocking too: a slow store
holds up only the tries waiting for it. The caller's other file descriptors (a fetcher's
pipe) can be watched by the same selector (:meth:`GetLoop.watch`).
"""

from __future__ import annotations

import errno
import selectors
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cachefs.errors import StoreError, StoreThrottled
from cachefs.store.http1 import MAX_HEAD_BYTES, MalformedAnswer, parse_head
from cachefs.store.s3_bulk import ERROR_BODY_LIMIT, S3BulkReader

#: Blocks of at most this many bytes have their first try in a GET loop (a preload fetcher's,
#: cachefs/cluster/fetchers.py; the mount's, cachefs/store/get_thread.py), larger ones on a
#: thread each: the loop saves the thread hand-offs of every GET, which count for the many
#: small GETs of small files, while a large block's transfer is better spread over threads.
LOOP_MAX_BYTES = 1 << 20

#: Bytes asked of the socket per receive while reading a head (a body is received in place).
_HEAD_RECV_BYTES = 64 * 1024

#: How a try ended: (tag, the body's bytes, or the store's error for a permanent error answer,
#: or None when it was not done here; throttled).
Outcome = tuple[Any, bytearray | StoreError | None, bool]


#: Where a connection goes: host, port, and the TLS context (None: plain HTTP).
Origin = tuple[str, int, ssl.SSLContext | None]


@dataclass(slots=True, eq=False)
class _Try:
    tag: Any
    reader: S3BulkReader
    key: str
    origin: Origin
    request: bytes  # the signed request head
    offset: int
    length: int
    etag: str | None
    head_timeout_s: float  # the connect and the wait for the head (the policy's hedge_after_s)
    stall_timeout_s: float  # the longest pause inside the body (attempt_timeout_s)
    resent: bool = False  # sent again after a kept connection turned out closed


@dataclass(slots=True, eq=False)
class _Connection:
    sock: socket.socket
    origin: Origin
    address: Any  # the socket address it connects to
    candidates: list[tuple[Any, Any, Any, Any]]  # the addresses not tried yet
    state: str = "connecting"  # connecting | handshake | idle | head | body
    status: int = 0  # of the answer being read
    reused: bool = False
    attempt: _Try | None = None
    deadline: float = 0.0
    head: bytearray = field(default_factory=bytearray)
    body: bytearray | None = None
    received: int = 0
    close_after: bool = False
    want_write: bool = False  # what the selector waits for: writable (connect, TLS) or readable


class GetLoop:
    """Runs first tries of ranged GETs on the calling thread, for any number of sources, at
    most ``connections`` at once (further ones wait their turn). Not thread-safe: one thread
    calls :meth:`submit`, :meth:`poll` and :meth:`close`."""

    def __init__(self, *, connections: int):
        if connections < 1:
            raise ValueError(f"connections must be at least 1, not {connections}")
        self._max_connections = connections
        self._selector = selectors.DefaultSelector()
        self._connections: set[_Connection] = set()
        self._idle: dict[Origin, list[_Connection]] = {}  # kept connections, by origin
        self._good_address: dict[Origin, Any] = {}  # the address that last connected
        self._failed_address: dict[Origin, Any] = {}  # the one that last failed to
        self._waiting: deque[_Try] = deque()
        self._ended: list[Outcome] = []

    @property
    def tries(self) -> int:
        """Tries not ended yet (waiting or in flight)."""
        return len(self._waiting) + sum(1 for c in self._connections if c.attempt is not None)

    def watch(self, fileobj: Any, on_readable: Callable[[], None]) -> None:
        """Have :meth:`poll` call ``on_readable()`` whenever ``fileobj`` is readable."""
        self._selector.register(fileobj, selectors.EVENT_READ, on_readable)

    def submit(
        self, tag: Any, reader: S3BulkReader, key: str, offset: int, length: int, etag: str | None
    ) -> None:
        """Start a try of ``length`` bytes (> 0) of ``reader``'s ``key`` from ``offset``: the
        GET ``reader.get_range`` would send; its outcome comes out of a later :meth:`poll`,
        under ``tag``."""
        request = reader.signed_get(key, offset, length, etag)
        policy = reader.retry
        self._waiting.append(
            _Try(tag, reader, key, reader.origin, request, offset, length, etag,
                 policy.hedge_after_s, policy.attempt_timeout_s)
        )  # fmt: skip

    def poll(self, timeout: float | None = None) -> list[Outcome]:
        """Wait (at most ``timeout`` seconds, or until the next try's deadline) for the
        sockets and the watched files; return the tries that ended meanwhile."""
        self._start_waiting()
        if self._ended:  # tries ended already (a connect refused at once): do not wait
            timeout = 0.0
        deadline = min((c.deadline for c in self._connections if c.attempt), default=None)
        if deadline is not None:
            until = max(0.0, deadline - time.monotonic())
            timeout = until if timeout is None else min(timeout, until)
        for key, _ in self._selector.select(timeout):
            if isinstance(key.data, _Connection):
                self._progress(key.data)
            else:
                key.data()
        now = time.monotonic()
        for connection in [c for c in self._connections if c.attempt and c.deadline <= now]:
            self._not_done(connection)  # silent too long: the ordinary path takes it over
        self._start_waiting()
        ended, self._ended = self._ended, []
        return ended

    def __enter__(self) -> GetLoop:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection; tries not ended are dropped."""
        for connection in list(self._connections):
            self._drop(connection)
        self._waiting.clear()
        self._selector.close()

    # --- internals --------------------------------------------------------------------------

    def _start_waiting(self) -> None:
        while self._waiting:
            origin = self._waiting[0].origin
            connection: _Connection | None
            if self._idle.get(origin):
                connection = self._idle[origin].pop()
                if not _quiet(connection.sock):  # bytes past an answer, or closed: not reused
                    self._drop(connection)
                    continue
            elif len(self._connections) < self._max_connections:
                connection = self._connect(origin)
            elif other := next((c for kept in self._idle.values() for c in kept), None):
                self._drop(other)  # a kept connection to another source makes room
                continue
            else:
                return
            if connection is None:  # refused at once: the ordinary path will say why
                self._ended.append((self._waiting.popleft().tag, None, False))
            else:
                self._begin(connection, self._waiting.popleft())

    def _connect(self, origin: Origin) -> _Connection | None:
        """A new connection on its way to ``origin``; None if none could be started. The name
        is resolved on this thread (connections are kept, so this is rare); its addresses are
        tried in turn, as ``socket.create_connection`` does, the one that last connected first
        and the one that last failed (refused, or timed out) last."""
        host, port, _ = origin
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):  # a name that does not resolve, say
            return None
        good, failed = self._good_address.get(origin), self._failed_address.get(origin)
        found.sort(key=lambda entry: 0 if entry[4] == good else 2 if entry[4] == failed else 1)
        candidates = [(family, kind, proto, address) for family, kind, proto, _, address in found]
        started = _start_connect(candidates)
        if started is None:
            return None
        sock, address = started
        connection = _Connection(sock, origin, address, candidates, want_write=True)
        self._connections.add(connection)
        self._selector.register(sock, selectors.EVENT_WRITE, connection)
        return connection

    def _next_address(self, connection: _Connection) -> bool:
        """The connect failed: go on to the next address, if there is one (True)."""
        self._connect_failed(connection)
        self._selector.unregister(connection.sock)
        connection.sock.close()
        started = _start_connect(connection.candidates)
        if started is None:
            self._connections.discard(connection)
            return False
        connection.sock, connection.address = started
        self._selector.register(connection.sock, selectors.EVENT_WRITE, connection)
        return True

    def _connect_failed(self, connection: _Connection) -> None:
        """Its address is tried last by the next connection to its origin."""
        self._failed_address[connection.origin] = connection.address
        if self._good_address.get(connection.origin) == connection.address:
            del self._good_address[connection.origin]

    def _begin(self, connection: _Connection, attempt: _Try) -> None:
        connection.attempt = attempt
        connection.deadline = time.monotonic() + attempt.head_timeout_s
        connection.head.clear()
        connection.body, connection.received, connection.close_after = None, 0, False
        if connection.state == "idle":
            self._send(connection)

    def _progress(self, connection: _Connection) -> None:
        """The connection's socket is ready for what it waits for."""
        try:
            if connection.state == "connecting":
                code = connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    if self._next_address(connection):
                        return
                    raise OSError(code, "connect failed")
                self._good_address[connection.origin] = connection.address
                host, _, tls = connection.origin
                if tls is not None:
                    # Wrapping detaches the plain socket: the selector must watch the new one.
                    self._selector.unregister(connection.sock)
                    connection.sock = tls.wrap_socket(
                        connection.sock, server_hostname=host, do_handshake_on_connect=False
                    )
                    self._selector.register(connection.sock, selectors.EVENT_WRITE, connection)
                    connection.state = "handshake"
                else:
                    connection.state = "idle"
            if connection.state == "handshake":
                try:
                    connection.sock.do_handshake()  # type: ignore[attr-defined]
                except ssl.SSLWantReadError:
                    return self._wait_for(connection, write=False)
                except ssl.SSLWantWriteError:
                    return self._wait_for(connection, write=True)
                connection.state = "idle"
            if connection.state == "idle":
                if connection.attempt is None:  # a kept connection the store closed: drop it
                    return self._drop(connection)
                return self._send(connection)
            self._receive(connection)
        except (OSError, MalformedAnswer, ValueError):
            self._not_done(connection)

    def _wait_for(self, connection: _Connection, *, write: bool) -> None:
        if connection.want_write != write:
            events = selectors.EVENT_WRITE if write else selectors.EVENT_READ
            self._selector.modify(connection.sock, events, connection)
            connection.want_write = write

    def _send(self, connection: _Connection) -> None:
        assert connection.attempt is not None
        request = connection.attempt.request
        try:
            sent = connection.sock.send(request)
        except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
            sent = 0
        except OSError:
            return self._stale_or_not_done(connection)
        if sent != len(request):  # a request head fits an empty socket buffer: a sick socket
            return self._not_done(connection)
        connection.state = "head"
        self._wait_for(connection, write=False)

    def _receive(self, connection: _Connection) -> None:
        """Read what has arrived (and, for TLS, what the TLS layer holds decrypted)."""
        sock = connection.sock
        while connection.attempt is not None:
            try:
                if connection.state == "body":
                    assert connection.body is not None
                    view = memoryview(connection.body)[connection.received :]
                    count = sock.recv_into(view)
                    if count == 0:
                        return self._not_done(connection)  # the body was cut short
                    connection.received += count
                    if connection.received == len(connection.body):
                        return self._complete(connection)
                else:
                    data = sock.recv(_HEAD_RECV_BYTES)
                    if not data:
                        return self._stale_or_not_done(connection)
                    connection.head += data
                    self._read_head(connection)  # may end the try, or start its body
                if connection.attempt is not None and connection.state == "body":
                    connection.deadline = time.monotonic() + connection.attempt.stall_timeout_s
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:  # renegotiation: not for this loop
                return self._not_done(connection)
            except OSError:
                return self._stale_or_not_done(connection)

    def _read_head(self, connection: _Connection) -> None:
        """Once the head is complete, check it and start the body; an answer this loop does
        not finish ends the try not done here."""
        attempt = connection.attempt
        assert attempt is not None
        end = connection.head.find(b"\r\n\r\n")
        if end < 0:
            if len(connection.head) > MAX_HEAD_BYTES:
                raise MalformedAnswer("the answer's headers are too long")
            return
        lines = bytes(connection.head[:end]).split(b"\r\n")
        status, headers = parse_head(lines)
        announced = headers.get("content-length", "")
        if "transfer-encoding" in headers or not announced.isdigit():
            return self._not_done(connection, throttled=status == 503)
        length = int(announced)
        if status >= 300:  # an error answer: its body says which
            if length > ERROR_BODY_LIMIT:  # not read here (S3's are a few hundred bytes)
                return self._not_done(connection, throttled=status == 503)
        else:
            returned_etag = headers.get("etag")
            if (
                status not in (200, 206)
                or (status == 200 and attempt.offset != 0)
                or length != attempt.length
                or (attempt.etag is not None and returned_etag is not None
                    and returned_etag.strip('"') != attempt.etag)
            ):  # fmt: skip
                return self._not_done(connection)
        connection.status = status
        connection.close_after = headers.get("connection", "").lower() == "close"
        rest = connection.head[end + 4 :]
        if len(rest) > length:  # bytes past the body: not an answer to trust
            return self._not_done(connection)
        connection.body = bytearray(length)
        connection.body[: len(rest)] = rest
        connection.received = len(rest)
        connection.state = "body"
        if connection.received == length:
            self._complete(connection)

    def _complete(self, connection: _Connection) -> None:
        attempt = connection.attempt
        assert attempt is not None and connection.body is not None
        if connection.status < 300:
            self._ended.append((attempt.tag, connection.body, False))
        else:
            error = attempt.reader.answer_error(connection.status, connection.body, attempt.key)
            if error.transient:  # retried by the ordinary path (after a backoff if throttled)
                self._ended.append((attempt.tag, None, isinstance(error, StoreThrottled)))
            else:
                self._ended.append((attempt.tag, error, False))
        connection.attempt, connection.body = None, None
        if connection.close_after:
            return self._drop(connection)
        connection.state, connection.reused = "idle", True
        self._idle.setdefault(connection.origin, []).append(connection)

    def _stale_or_not_done(self, connection: _Connection) -> None:
        """The connection ended or broke. Before any byte of the answer on a kept connection,
        the store had closed it while idle: send the request once more on a new one."""
        attempt = connection.attempt
        if (
            attempt is not None
            and connection.reused
            and connection.state in ("idle", "head")  # failed at the send, or before any byte
            and not connection.head
            and not attempt.resent
        ):
            attempt.resent = True
            connection.attempt = None
            self._drop(connection)
            self._waiting.appendleft(attempt)
            return
        self._not_done(connection)

    def _not_done(self, connection: _Connection, *, throttled: bool = False) -> None:
        if connection.state == "connecting":  # timed out
            self._connect_failed(connection)
        if connection.attempt is not None:
            self._ended.append((connection.attempt.tag, None, throttled))
            connection.attempt = None
        self._drop(connection)  # unread bytes, or a broken socket: never reused

    def _drop(self, connection: _Connection) -> None:
        self._connections.discard(connection)
        kept = self._idle.get(connection.origin, [])
        if connection in kept:
            kept.remove(connection)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()


def _start_connect(
    candidates: list[tuple[Any, Any, Any, Any]],
) -> tuple[socket.socket, Any] | None:
    """A non-blocking connect started to the first of ``candidates`` that takes one (each
    tried is removed from the list), or None when none does."""
    while candidates:
        family, kind, proto, address = candidates.pop(0)
        try:
            sock = socket.socket(family, kind, proto)
        except OSError:
            continue
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            code = sock.connect_ex(address)
        except OSError:
            code = -1
        if code in (0, errno.EINPROGRESS):
            return sock, address
        sock.close()
    return None


def _quiet(sock: socket.socket) -> bool:
    """Whether a kept connection has nothing to read (no bytes past the last answer, no end):
    only then may it carry another request, whose answer must be the first bytes it reads."""
    if isinstance(sock, ssl.SSLSocket):
        if sock.pending():
            return False
        sock = socket.socket(fileno=sock.fileno())  # the same socket, to peek at its raw bytes
        try:
            return _quiet(sock)
        finally:
            sock.detach()
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False  # a byte, or the end of the connection
