"""A lean, read-only S3 endpoint that serves a local directory tree as one bucket.

    python -m bench.lean_s3 --root DIR --bucket NAME --listen 127.0.0.1:9000 [--processes N]

A benchmark fixture for loopback only. moto keeps objects in memory behind a Python web
framework: here it served ~440 small GETs/s on all of the machine's CPU and closed the
connection after every answer, so a benchmark against it measures moto. This endpoint spends
tens of microseconds per request and keeps every connection open (HTTP/1.1 persistent
connections; it closes only when the client asks, on HTTP/1.0 without keep-alive, or on a
request it cannot parse), so a benchmark against it measures the client.

**It checks no signature and accepts any credentials** (or none): never expose it beyond
loopback. It only reads: PUT, POST and DELETE are answered ``501 NotImplemented``.

What it answers, path-style (``/bucket/key``) or virtual-host style (``Host: bucket.…``):

* GetObject: whole (200) or ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (206 with
  ``Content-Range``; 416 ``InvalidRange`` past the end; a range it cannot parse is ignored, as
  S3 does). ``If-Match`` (what cachefs sends with every ranged GET of a known version) gives
  412 ``PreconditionFailed`` when the ETag differs; ``If-None-Match`` gives 304 when it matches.
* HeadObject, HeadBucket, GetBucketLocation (empty: us-east-1), ListBuckets (the one bucket).
* ListObjectsV2 (``prefix``, ``delimiter``, ``max-keys`` up to 1000, ``start-after``,
  ``continuation-token``, ``encoding-type=url``, which boto3 always sends) and ListObjects (v1:
  ``marker``; s3fs and rclone list with it), keys in UTF-8 byte order as S3 lists them.
* Errors as S3's XML: ``NoSuchKey`` and ``NoSuchBucket`` (404), ``InvalidRange`` (416),
  ``PreconditionFailed`` (412), ``NotImplemented`` (501).
* ``GET /__lean_s3__/stats``: this server's counters as JSON (all processes together):
  connections accepted and open, requests by kind, body bytes sent.

Objects: every regular file under ``--root`` (symlinks followed) is an object whose key is its
path relative to the root with ``/`` separators; names that are not valid UTF-8 are skipped.
The tree is indexed once at start, before the server listens: a file created later is neither
listed nor served. A served file's size, ETag and Last-Modified come from ``fstat`` on each
request, so a file rewritten in place gets a new ETag (an MD5-shaped hash of its size and
mtime, quoted as S3 quotes it). Bytes are read with ``os.pread`` on every request (from the page
cache, where a benchmark's data lives). If-Modified-Since and the other conditional headers,
versions, ACLs and every other subresource are not implemented.

Speed: one asyncio event loop per process with a hand-written request parser (no framework).
``--processes N`` forks N server processes after the index is built, each with its own
listening socket on the same port (``SO_REUSEPORT``: the kernel spreads connections over them),
so capacity scales with cores. Nothing here is imported by cachefs.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import bisect
import email.utils
import hashlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from xml.sax.saxutils import escape

STATS_PATH = "/__lean_s3__/stats"
#: S3's own largest page of a listing (and the default ``max-keys``).
MAX_KEYS = 1000
#: A request head longer than this is refused (431) and the connection closed.
MAX_HEAD_BYTES = 64 * 1024
#: A connection whose unsent answers exceed this stops being read until they drain, so a client
#: that sends many GETs without reading answers cannot make the server buffer whole objects.
WRITE_HIGH_WATER = 4 * 1024 * 1024
LISTEN_BACKLOG = 1024
S3_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
XML_DECLARATION = '<?xml version="1.0" encoding="UTF-8"?>\n'
#: Seconds a started server process has to print its serving line.
START_TIMEOUT_S = 120.0

_REASONS = {
    200: "OK",
    204: "No Content",
    206: "Partial Content",
    304: "Not Modified",
    400: "Bad Request",
    404: "Not Found",
    412: "Precondition Failed",
    416: "Requested Range Not Satisfiable",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
}


# --- the objects ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Listing:
    """One page of a listing: object keys (with their files' paths) and common prefixes, in
    key order, and where the next page starts (``last``: the page's last key or prefix)."""

    keys: list[str]
    prefixes: list[str]
    truncated: bool
    last: str | None


class TreeIndex:
    """Every regular file under ``root`` as a key, sorted as S3 sorts keys (by UTF-8 bytes:
    Python orders ``str`` by code point, which is the same order)."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        if not os.path.isdir(self.root):
            raise SystemExit(f"lean_s3: --root {root!r} is not a directory")
        self.paths: dict[str, str] = {}  # key -> absolute path of its file
        self.skipped_names = 0  # names that are not UTF-8 (no S3 key can name them)
        for key, path in self._walk(self.root, ""):
            self.paths[key] = path
        self.keys = sorted(self.paths)

    def _walk(self, directory: str, key_prefix: str) -> Iterator[tuple[str, str]]:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    entry.name.encode("utf-8")  # surrogate escapes: not UTF-8 on disk
                except UnicodeEncodeError:
                    self.skipped_names += 1
                    continue
                if entry.is_dir():
                    yield from self._walk(entry.path, f"{key_prefix}{entry.name}/")
                elif entry.is_file():
                    yield f"{key_prefix}{entry.name}", entry.path

    def page(self, prefix: str, delimiter: str, after: str, max_keys: int) -> Listing:
        """Keys and common prefixes under ``prefix`` that come after ``after`` (a key, or a
        common prefix of this listing, whose keys are then all skipped), at most ``max_keys``
        of them together."""
        keys = self.keys
        if max_keys == 0:
            return Listing([], [], False, None)
        index = bisect.bisect_left(keys, prefix)
        if after:
            index = max(index, bisect.bisect_right(keys, after))
            if self._is_common_prefix(after, prefix, delimiter):
                index = max(index, self._past(after, index))
        found_keys: list[str] = []
        found_prefixes: list[str] = []
        last: str | None = None
        while index < len(keys) and keys[index].startswith(prefix):
            if len(found_keys) + len(found_prefixes) >= max_keys:
                return Listing(found_keys, found_prefixes, True, last)
            key = keys[index]
            cut = key.find(delimiter, len(prefix)) if delimiter else -1
            if cut >= 0:
                common = key[: cut + len(delimiter)]
                found_prefixes.append(common)
                last = common
                index = self._past(common, index)
            else:
                found_keys.append(key)
                last = key
                index += 1
        return Listing(found_keys, found_prefixes, False, last)

    @staticmethod
    def _is_common_prefix(item: str, prefix: str, delimiter: str) -> bool:
        """Whether ``item`` is a common prefix this listing would return (it ends at the first
        delimiter after ``prefix``)."""
        if not delimiter or not item.startswith(prefix):
            return False
        cut = item.find(delimiter, len(prefix))
        return cut >= 0 and cut + len(delimiter) == len(item)

    def _past(self, common: str, index: int) -> int:
        """The first index at or after ``index`` whose key does not start with ``common``."""
        last_char = ord(common[-1])
        if last_char < sys.maxunicode:  # every key starting with common sorts before this
            return bisect.bisect_left(self.keys, common[:-1] + chr(last_char + 1), index)
        while index < len(self.keys) and self.keys[index].startswith(common):
            index += 1
        return index


def etag_of(stat: os.stat_result) -> str:
    """The quoted ETag of a file as it is now: stable while its size and mtime are."""
    digest = hashlib.md5(f"{stat.st_size}:{stat.st_mtime_ns}".encode(), usedforsecurity=False)
    return f'"{digest.hexdigest()}"'


def http_date(seconds: float) -> str:
    return email.utils.formatdate(seconds, usegmt=True)


def iso_date(seconds: float) -> str:
    """S3's listing timestamp; whole seconds, as in the Last-Modified header."""
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(int(seconds)))


def parse_range(value: str, size: int) -> tuple[int, int] | None:
    """``(first, last)`` byte of a ``Range`` header for an object of ``size`` bytes, ``None``
    for a header S3 would ignore (not one ``bytes=`` range); raises ValueError when it is
    unsatisfiable (416)."""
    unit, _, spec = value.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first_text, dash, last_text = spec.strip().partition("-")
    if not dash or not (first_text.isdigit() or last_text.isdigit()):
        return None
    if not first_text:  # bytes=-n: the last n bytes
        count = int(last_text)
        if count == 0 or size == 0:
            raise ValueError("empty suffix range")
        return max(0, size - count), size - 1
    if not first_text.isdigit() or (last_text and not last_text.isdigit()):
        return None
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last_text and last < first:
        return None  # RFC 9110: an invalid range is ignored
    if first >= size:
        raise ValueError("range starts past the end")
    return first, min(last, size - 1)


def etag_matches(condition: str, etag: str) -> bool:
    """Whether an If-Match / If-None-Match value names ``etag`` (quoted or not, or ``*``)."""
    bare = etag.strip('"')
    for candidate in condition.split(","):
        candidate = candidate.strip()
        if candidate.startswith("W/"):
            candidate = candidate[2:]
        if candidate == "*" or candidate.strip('"') == bare:
            return True
    return False


# --- counters shared by all server processes -------------------------------------------------

COUNTERS = (
    "connections_accepted",
    "connections_open",
    "requests",
    "get_object",
    "head_object",
    "list_objects",
    "other_requests",
    "errors",
    "body_bytes",
)


class SharedCounters:
    """One row of int64 counters per server process in anonymous shared memory (created before
    the fork): each process writes only its own row, :meth:`totals` adds the rows up."""

    def __init__(self, processes: int):
        self._processes = processes
        self._memory = mmap.mmap(-1, 8 * len(COUNTERS) * processes)
        self._cells = memoryview(self._memory).cast("q")
        self._row = 0

    def use_row(self, process_index: int) -> None:
        self._row = process_index * len(COUNTERS)

    def add(self, name: str, amount: int = 1) -> None:
        self._cells[self._row + COUNTERS.index(name)] += amount

    def totals(self) -> dict[str, int]:
        width = len(COUNTERS)
        return {
            name: sum(self._cells[row * width + column] for row in range(self._processes))
            for column, name in enumerate(COUNTERS)
        }


# --- HTTP ------------------------------------------------------------------------------------


class Reply:
    """An answer's status, headers and body, rendered by :meth:`head_bytes` (and the body)."""

    __slots__ = ("body", "headers", "length", "status")

    def __init__(self, status: int, headers: list[tuple[str, str]], body: bytes = b"", length=None):
        self.status = status
        self.headers = headers
        self.body = body
        self.length = len(body) if length is None else length  # HEAD: the GET's length

    def head_bytes(self, close: bool) -> bytes:
        lines = [f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}"]
        lines += [f"{name}: {value}" for name, value in self.headers]
        if self.status != 304:
            lines.append(f"Content-Length: {self.length}")
        if close:
            lines.append("Connection: close")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def xml_reply(status: int, body: str) -> Reply:
    return Reply(status, [("Content-Type", "application/xml")], body.encode("utf-8"))


def error_reply(status: int, code: str, message: str, **fields: str) -> Reply:
    extra = "".join(f"<{name}>{escape(value)}</{name}>" for name, value in fields.items())
    return xml_reply(
        status,
        f"{XML_DECLARATION}<Error><Code>{code}</Code><Message>{escape(message)}</Message>"
        f"{extra}<RequestId>lean-s3</RequestId></Error>",
    )


class S3Service:
    """What each request gets: the bucket's objects, read from the index and the files."""

    def __init__(self, index: TreeIndex, bucket: str, counters: SharedCounters):
        self.index = index
        self.bucket = bucket
        self.counters = counters
        self._bucket_host = f"{bucket}."

    def answer(self, method: str, target: str, headers: dict[str, str]) -> Reply:
        path, _, query = target.partition("?")
        if path.startswith(("http://", "https://")):  # absolute-form request target
            path = "/" + path.split("/", 3)[3] if path.count("/") >= 3 else "/"
        if path == STATS_PATH:
            return Reply(200, [("Content-Type", "application/json")], self._stats())
        if method not in ("GET", "HEAD"):
            self.counters.add("other_requests")
            return error_reply(501, "NotImplemented", "lean_s3 serves reads only")
        try:
            path = urllib.parse.unquote(path, errors="strict") if "%" in path else path
        except UnicodeDecodeError:
            return error_reply(400, "InvalidURI", "the path is not UTF-8")
        host = headers.get("host", "")
        if host.startswith(self._bucket_host):  # virtual-host style: the path is the key
            bucket, key = self.bucket, path[1:]
        else:
            bucket, _, key = path[1:].partition("/")
        if not bucket:
            return self._list_buckets()
        if bucket != self.bucket:
            self.counters.add("errors")
            return error_reply(404, "NoSuchBucket", "the bucket does not exist", BucketName=bucket)
        if key:
            return self._object(method, key, headers)
        params = urllib.parse.parse_qs(query, keep_blank_values=True) if query else {}
        if method == "HEAD":
            self.counters.add("other_requests")
            return Reply(200, [])
        if "location" in params:
            self.counters.add("other_requests")
            return xml_reply(200, f'{XML_DECLARATION}<LocationConstraint xmlns="{S3_XMLNS}"/>')
        if set(params) - LIST_PARAMETERS:
            self.counters.add("other_requests")
            return error_reply(501, "NotImplemented", "lean_s3 does not serve this subresource")
        self.counters.add("list_objects")
        return self._list(params)

    def _stats(self) -> bytes:
        totals = self.counters.totals()
        totals["objects"] = len(self.index.keys)
        return json.dumps(totals).encode()

    def _object(self, method: str, key: str, headers: dict[str, str]) -> Reply:
        path = self.index.paths.get(key)
        if path is None:
            self.counters.add("errors")
            return error_reply(404, "NoSuchKey", "the key does not exist", Key=key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.counters.add("errors")
            return error_reply(404, "NoSuchKey", "the key does not exist", Key=key)
        try:
            stat = os.fstat(fd)
            size = stat.st_size
            etag = etag_of(stat)
            fields = [
                ("ETag", etag),
                ("Last-Modified", http_date(stat.st_mtime)),
                ("Accept-Ranges", "bytes"),
                ("Content-Type", "binary/octet-stream"),
            ]
            if_match = headers.get("if-match")
            if if_match is not None and not etag_matches(if_match, etag):
                self.counters.add("errors")
                return error_reply(
                    412, "PreconditionFailed", "If-Match failed", Condition="If-Match"
                )
            if_none_match = headers.get("if-none-match")
            if if_none_match is not None and etag_matches(if_none_match, etag):
                return Reply(304, fields[:2])
            status, first, count = 200, 0, size
            range_header = headers.get("range")
            if range_header is not None:
                try:
                    span = parse_range(range_header, size)
                except ValueError:
                    self.counters.add("errors")
                    return error_reply(416, "InvalidRange", "the range is not satisfiable")
                if span is not None:
                    status, first, count = 206, span[0], span[1] - span[0] + 1
                    fields.append(("Content-Range", f"bytes {span[0]}-{span[1]}/{size}"))
            if method == "HEAD":
                self.counters.add("head_object")
                return Reply(status, fields, length=count)
            body = os.pread(fd, count, first) if count else b""
        finally:
            os.close(fd)
        if len(body) != count:  # the file shrank under us: never send a short body
            self.counters.add("errors")
            return error_reply(404, "NoSuchKey", "the file changed while it was read", Key=key)
        self.counters.add("get_object")
        return Reply(status, fields, body)

    def _list(self, params: dict[str, list[str]]) -> Reply:
        def param(name: str) -> str:
            return params.get(name, [""])[0]

        version2 = param("list-type") == "2"
        prefix, delimiter = param("prefix"), param("delimiter")
        url_encoded = param("encoding-type") == "url"
        max_text = param("max-keys")
        max_keys = min(MAX_KEYS, int(max_text)) if max_text.isdigit() else MAX_KEYS
        token = param("continuation-token")
        if version2:
            try:
                after = base64.urlsafe_b64decode(token).decode() if token else param("start-after")
            except (ValueError, UnicodeDecodeError):
                return error_reply(400, "InvalidArgument", "the continuation token is invalid")
        else:
            after = param("marker")
        page = self.index.page(prefix, delimiter, after, max_keys)

        def text(value: str) -> str:  # keys as the client asked them encoded
            return escape(urllib.parse.quote(value, safe="/") if url_encoded else value)

        parts = [
            f'{XML_DECLARATION}<ListBucketResult xmlns="{S3_XMLNS}">',
            f"<Name>{escape(self.bucket)}</Name><Prefix>{text(prefix)}</Prefix>",
            f"<MaxKeys>{max_keys}</MaxKeys>",
            f"<IsTruncated>{'true' if page.truncated else 'false'}</IsTruncated>",
        ]
        if delimiter:
            parts.append(f"<Delimiter>{text(delimiter)}</Delimiter>")
        if url_encoded:
            parts.append("<EncodingType>url</EncodingType>")
        if version2:
            parts.append(f"<KeyCount>{len(page.keys) + len(page.prefixes)}</KeyCount>")
            if token:
                parts.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
            elif after:
                parts.append(f"<StartAfter>{text(after)}</StartAfter>")
            if page.truncated and page.last is not None:
                next_token = base64.urlsafe_b64encode(page.last.encode()).decode()
                parts.append(f"<NextContinuationToken>{next_token}</NextContinuationToken>")
        else:
            parts.append(f"<Marker>{text(after)}</Marker>")
            if page.truncated and delimiter and page.last is not None:
                parts.append(f"<NextMarker>{text(page.last)}</NextMarker>")
        for key in page.keys:
            parts.append(self._contents(key, text))
        for common in page.prefixes:
            parts.append(f"<CommonPrefixes><Prefix>{text(common)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        return xml_reply(200, "".join(parts))

    def _contents(self, key: str, text) -> str:
        try:
            stat = os.stat(self.index.paths[key])
        except FileNotFoundError:
            return ""  # removed since the start: list only what a GET would serve
        return (
            f"<Contents><Key>{text(key)}</Key><LastModified>{iso_date(stat.st_mtime)}"
            f"</LastModified><ETag>{escape(etag_of(stat))}</ETag><Size>{stat.st_size}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
        )

    def _list_buckets(self) -> Reply:
        self.counters.add("other_requests")
        created = iso_date(os.stat(self.index.root).st_mtime)
        return xml_reply(
            200,
            f'{XML_DECLARATION}<ListAllMyBucketsResult xmlns="{S3_XMLNS}">'
            "<Owner><ID>lean-s3</ID><DisplayName>lean-s3</DisplayName></Owner>"
            f"<Buckets><Bucket><Name>{escape(self.bucket)}</Name>"
            f"<CreationDate>{created}</CreationDate></Bucket></Buckets>"
            "</ListAllMyBucketsResult>",
        )


#: Query parameters a bucket GET may carry and still be a listing.
LIST_PARAMETERS = frozenset(
    {
        "list-type",
        "prefix",
        "delimiter",
        "max-keys",
        "start-after",
        "continuation-token",
        "encoding-type",
        "marker",
        "fetch-owner",
    }
)


class HttpConnection(asyncio.Protocol):
    """One client connection: parses requests as they arrive, answers them in order."""

    def __init__(self, service: S3Service):
        self.service = service
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closing = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.service.counters.add("connections_accepted")
        self.service.counters.add("connections_open")

    def connection_lost(self, exc) -> None:
        self.service.counters.add("connections_open", -1)

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.closing:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while not self.closing:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._send(
                        error_reply(431, "RequestHeaderTooLarge", "head too large"), "", True
                    )
                return
            head = self.buffer[:end].decode("latin-1")
            lines = head.split("\r\n")
            request_line = lines[0].split(" ")
            if len(request_line) != 3:
                self._send(error_reply(400, "BadRequest", "malformed request line"), "", True)
                return
            method, target, version = request_line
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._send(error_reply(501, "NotImplemented", "chunked requests"), method, True)
                return
            body_length = int(headers.get("content-length", "0") or 0)
            if len(self.buffer) < end + 4 + body_length:
                return  # the body is still arriving (read and dropped: nothing is written)
            del self.buffer[: end + 4 + body_length]
            connection = headers.get("connection", "").lower()
            close = connection == "close" or (version == "HTTP/1.0" and connection != "keep-alive")
            if "100-continue" in headers.get("expect", "").lower():
                close = True  # a body is waiting for our go-ahead: refuse it and hang up
            self.service.counters.add("requests")
            try:
                reply = self.service.answer(method, target, headers)
            except Exception as exc:  # a bug must cost one answer, not the server
                reply = error_reply(500, "InternalError", f"{type(exc).__name__}: {exc}")
                close = True
            self._send(reply, method, close)

    def _send(self, reply: Reply, method: str, close: bool) -> None:
        head = reply.head_bytes(close)
        if method == "HEAD" or not reply.body:
            self.transport.write(head)
        elif len(reply.body) <= 256 * 1024:
            self.transport.write(head + reply.body)  # one segment train, one syscall
        else:
            self.transport.write(head)
            self.transport.write(memoryview(reply.body))  # no copy of a large body here
        if method != "HEAD":
            self.service.counters.add("body_bytes", len(reply.body))
        if close:
            self.closing = True
            self.transport.close()


# --- processes -------------------------------------------------------------------------------


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` listening sockets on the same address (SO_REUSEPORT when more than one); port 0
    picks a free port for all of them."""
    sockets: list[socket.socket] = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if count > 1:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        port = sock.getsockname()[1]
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
        sockets.append(sock)
    return sockets


def serve(sock: socket.socket, service: S3Service) -> None:
    """Serve connections from ``sock`` until SIGTERM or SIGINT."""

    async def run() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        server = await loop.create_server(lambda: HttpConnection(service), sock=sock)
        async with server:
            await stop.wait()

    asyncio.run(run())


def run_server(root: str, bucket: str, host: str, port: int, processes: int) -> int:
    index = TreeIndex(root)
    counters = SharedCounters(processes)
    service = S3Service(index, bucket, counters)
    sockets = listening_sockets(host, port, processes)
    port = sockets[0].getsockname()[1]
    skipped = f", {index.skipped_names} non-UTF-8 names skipped" if index.skipped_names else ""
    print(
        f"lean_s3: serving http://{host}:{port} bucket {bucket}: {len(index.keys):,} objects "
        f"from {index.root}, {processes} process(es){skipped}",
        flush=True,
    )
    if processes == 1:
        serve(sockets[0], service)
        return 0
    children = []
    for number, sock in enumerate(sockets):
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                for other in sockets:
                    if other is not sock:
                        other.close()
                counters.use_row(number)
                serve(sock, service)
                status = 0
            finally:
                os._exit(status)
        children.append(pid)
    for sock in sockets:
        sock.close()

    def forward(signum, _frame) -> None:
        for child in children:
            try:
                os.kill(child, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed = 0
    for child in children:
        _, status = os.waitpid(child, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


# --- for benchmarks and tests: the server in a child process ---------------------------------


class LeanS3Process:
    """``python -m bench.lean_s3`` in a child process of its own session; ``url`` once it
    serves. Its output goes to ``log_path`` (a temporary file when not given)."""

    def __init__(
        self,
        root: str,
        bucket: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        processes: int = 1,
        log_path: str | None = None,
        timeout: float = START_TIMEOUT_S,
    ):
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="lean_s3-", suffix=".log")
            os.close(handle)
        self.log_path = log_path
        self.bucket = bucket
        argv = [
            sys.executable, "-m", "bench.lean_s3", "--root", root, "--bucket", bucket,
            "--listen", f"{host}:{port}", "--processes", str(processes),
        ]  # fmt: skip
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {
            **os.environ,
            "PYTHONPATH": repo_root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        self.url = self._wait_serving(timeout)

    def _wait_serving(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path, errors="replace") as log:
                for line in log:
                    if line.startswith("lean_s3: serving "):
                        return line.split()[2]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        with open(self.log_path, errors="replace") as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"lean_s3 did not start in {timeout:.0f} s:\n{tail}")

    @property
    def pid(self) -> int:
        return self.process.pid

    def stats(self) -> dict:
        return fetch_stats(self.url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)

    def __enter__(self) -> LeanS3Process:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def fetch_stats(url: str, timeout: float = 10.0) -> dict:
    """The counters of a lean_s3 server at ``url`` (one new connection: it is counted)."""
    from bench.delay_proxy import fetch_json

    return fetch_json(url, STATS_PATH, "lean_s3", timeout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lean_s3",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", required=True, help="the directory served as the bucket")
    parser.add_argument("--bucket", required=True, help="the bucket's name")
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (port 0: any)")
    parser.add_argument(
        "--processes", type=int, default=1, help="server processes sharing the port (default 1)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.processes < 1:
        raise SystemExit("lean_s3: --processes must be at least 1")
    host, _, port = args.listen.rpartition(":")
    return run_server(args.root, args.bucket, host or "127.0.0.1", int(port), args.processes)


if __name__ == "__main__":
    sys.exit(main())
