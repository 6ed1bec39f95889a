"""A threaded HTTP reverse proxy that makes a loopback S3 server behave like a remote one.

    python -m bench.delay_proxy --upstream http://127.0.0.1:5000 --first-byte-ms 20 \
        --bandwidth 50MiB --listen 127.0.0.1:5001

A loopback fake S3 server answers a small GET in a few ms of CPU and streams at memory speed; a
real object store takes tens of ms to the first byte and each connection gets a limited share of
the network. Put this in front of moto and give its URL to cachefs (or any client) as the
endpoint:

* **first-byte latency** (``--first-byte-ms``, default 20; ``--delay-ms`` is the same option
  under its old name): every request waits this long before it is forwarded. The proxy reads the
  upstream's whole answer before replying, so a client sees its first byte after this delay plus
  the upstream's own time for the whole answer (a few ms for moto on loopback).
* **bandwidth per connection** (``--bandwidth``, bytes/s, with an optional unit such as
  ``50MiB``; 0, the default, means unlimited): the body of every forwarded answer is written in
  small chunks, each no earlier than the time at which that many bytes would have passed at
  this rate since the body started. A body of n bytes therefore takes at least n / rate seconds
  after its first-byte delay. Each client connection has its own handler thread and answers
  on a connection go one after another, so the cap holds per connection; more connections get
  more bandwidth in total, as from S3.

The bytes are the upstream's, unchanged (status, headers and body are copied; only hop-by-hop
headers are dropped and the body is re-sent with a Content-Length).

It counts what it forwards, by method and, for GETs, whether the path names an object
(``/bucket/key``: a data GET) or only a bucket (a listing). ``GET /__delay_proxy__/stats``
answers the counters (and the proxy's settings, under ``config``) as JSON, without delay and
without forwarding; the bench reads it before and after each phase. Nothing here is imported by
cachefs.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cachefs.errors import ConfigError
from cachefs.units import parse_size

STATS_PATH = "/__delay_proxy__/stats"
#: Bounds of one paced write: small enough that pacing is smooth, large enough that a fast rate
#: does not cost a syscall and a sleep per few bytes.
MIN_PACING_CHUNK = 4096
MAX_PACING_CHUNK = 256 * 1024
#: A paced body is written in chunks of about this many seconds' worth of bytes.
PACING_SLICE_S = 0.01
#: Not forwarded in either direction (RFC 9110 §7.6.1), plus the length we set ourselves.
HOP_BY_HOP = frozenset(
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
        "content-length",
    }
)


def request_kind(method: str, path: str) -> str:
    """``GET object``, ``GET bucket`` (a listing or a bucket-level call) or the method: what the
    counters are keyed by. Path-style S3: ``/bucket/key...`` names an object."""
    if method != "GET":
        return method
    parts = urllib.parse.urlsplit(path).path.lstrip("/").split("/", 1)
    return "GET object" if len(parts) == 2 and parts[1] else "GET bucket"


def pacing_chunk(bandwidth: float) -> int:
    """Bytes per paced write at ``bandwidth`` bytes/s: about PACING_SLICE_S worth, within
    [MIN_PACING_CHUNK, MAX_PACING_CHUNK]."""
    return int(min(MAX_PACING_CHUNK, max(MIN_PACING_CHUNK, bandwidth * PACING_SLICE_S)))


def write_paced(write, body: bytes, bandwidth: float, clock=time.monotonic, sleep=time.sleep):
    """Send ``body`` through ``write`` no faster than ``bandwidth`` bytes/s (0: at once).

    Each chunk goes out no earlier than ``start + (bytes up to its end) / bandwidth``, so the
    last byte leaves at least ``len(body) / bandwidth`` seconds after the call began.
    """
    if bandwidth <= 0:
        write(body)
        return
    view = memoryview(body)
    chunk = pacing_chunk(bandwidth)
    began = clock()
    for offset in range(0, len(body), chunk):
        part = view[offset : offset + chunk]
        pause = began + (offset + len(part)) / bandwidth - clock()
        if pause > 0:
            sleep(pause)
        write(part)


class Counters:
    """Requests and response bytes forwarded, per kind (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self.errors = 0

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.requests[kind] = self.requests.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "bytes": dict(self.bytes),
                "errors": self.errors,
                "object_gets": self.requests.get("GET object", 0),
            }


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: boto3 reuses its connections
    # TCP_NODELAY: an answer goes out as two writes (head, then body); with Nagle on, a short
    # body waits for the client's delayed ACK of the head, ~40 ms per answer on loopback.
    disable_nagle_algorithm = True
    server: _ProxyServer

    def log_message(self, format, *args) -> None:
        pass  # one line per request would cost more than the request

    def do_GET(self) -> None:
        if self.path == STATS_PATH:
            body = json.dumps(self.server.stats()).encode()
            self._reply(200, [("Content-Type", "application/json")], body)
            return
        self._forward()

    def do_HEAD(self) -> None:
        self._forward()

    def do_PUT(self) -> None:
        self._forward()

    def do_POST(self) -> None:
        self._forward()

    def do_DELETE(self) -> None:
        self._forward()

    def _request_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after the chunk
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else None

    def _forward(self) -> None:
        proxy = self.server
        body = self._request_body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        if proxy.delay_s:
            time.sleep(proxy.delay_s)
        try:
            status, reply_headers, data = proxy.send_upstream(
                self.command, self.path, body, headers
            )
        except (OSError, http.client.HTTPException) as exc:
            proxy.counters.error()
            message = f"delay_proxy: upstream failed: {type(exc).__name__}: {exc}".encode()
            self._reply(502, [("Content-Type", "text/plain")], message)
            return
        proxy.counters.add(request_kind(self.command, self.path), len(data))
        self._reply(status, reply_headers, data, bandwidth=proxy.bandwidth)

    def _reply(
        self, status: int, headers: list[tuple[str, str]], body: bytes, bandwidth: float = 0.0
    ) -> None:
        """Status and end-to-end headers as given; the body with its own Content-Length (a
        HEAD reply has no body and keeps the upstream's Content-Length), paced to
        ``bandwidth`` bytes/s (0: unpaced)."""
        self.send_response_only(status)
        for key, value in headers:
            if key.lower() not in HOP_BY_HOP:
                self.send_header(key, value)
        if self.command == "HEAD":
            length = next((v for k, v in headers if k.lower() == "content-length"), None)
        else:
            length = str(len(body))
        if length is not None:
            self.send_header("Content-Length", length)
        self.end_headers()
        if self.command != "HEAD" and body:
            write_paced(self.wfile.write, body, bandwidth)


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], upstream: str, delay_s: float, bandwidth: float = 0.0
    ):
        if delay_s < 0 or bandwidth < 0:
            raise ValueError(f"delay and bandwidth must be >= 0, got {delay_s}, {bandwidth}")
        super().__init__(address, _Handler)
        split = urllib.parse.urlsplit(upstream)
        if split.scheme != "http" or not split.hostname:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (split.hostname, split.port or 80)
        self.delay_s = delay_s
        self.bandwidth = float(bandwidth)
        self.counters = Counters()
        self._local = threading.local()  # one upstream connection per handler thread

    def stats(self) -> dict:
        """The counters, and the settings they were made under."""
        config = {"first_byte_ms": 1000 * self.delay_s, "bandwidth_bytes_per_s": self.bandwidth}
        return {**self.counters.snapshot(), "config": config}

    def send_upstream(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        for attempt in (0, 1):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                return response.status, response.getheaders(), data
            except (ConnectionError, http.client.RemoteDisconnected, BrokenPipeError):
                conn.close()
                self._local.conn = None
                if attempt:  # a kept-alive connection the upstream had closed: retry once
                    raise
        raise AssertionError("unreachable")


class DelayProxy:
    """The proxy in a background thread of this process (tests, or ``main`` below).

    ``delay_s`` is the first-byte latency added to every request; ``bandwidth`` caps each
    connection's answer bodies, in bytes/s (0: unlimited)."""

    def __init__(
        self,
        upstream: str,
        delay_s: float,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bandwidth: float = 0.0,
    ):
        self._server = _ProxyServer((host, port), upstream, delay_s, bandwidth)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> DelayProxy:
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True
        )
        self._thread.start()
        return self

    def stats(self) -> dict:
        return self._server.stats()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def fetch_stats(url: str, timeout: float = 10.0) -> dict:
    """The counters of a proxy running at ``url`` (another process)."""
    return fetch_json(url, STATS_PATH, "delay proxy", timeout)


def fetch_json(url: str, path: str, what: str, timeout: float = 10.0) -> dict:
    """GET ``path`` of the server ``what`` at ``url`` on a new connection; its JSON answer."""
    split = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(split.hostname, split.port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        if response.status != 200:
            raise OSError(f"{what} at {url} answered {response.status}")
        return json.loads(response.read())
    finally:
        conn.close()


def stats_delta(before: dict, after: dict) -> dict:
    """``after - before`` of two :func:`fetch_stats` answers."""
    kinds = sorted(set(before["requests"]) | set(after["requests"]))
    return {
        "requests": {k: after["requests"].get(k, 0) - before["requests"].get(k, 0) for k in kinds},
        "bytes": {k: after["bytes"].get(k, 0) - before["bytes"].get(k, 0) for k in kinds},
        "errors": after["errors"] - before["errors"],
        "object_gets": after["object_gets"] - before["object_gets"],
    }


def _bandwidth(text: str) -> int:
    """Bytes/s from "0", "12500000", "50MiB", "100MB" (a size per second)."""
    try:
        return parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.delay_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--upstream", required=True, help="http://host:port to forward to")
    parser.add_argument(
        "--first-byte-ms",
        "--delay-ms",
        dest="delay_ms",
        type=float,
        default=20.0,
        help="latency added to every request before it is forwarded (default 20)",
    )
    parser.add_argument(
        "--bandwidth",
        type=_bandwidth,
        default=0,
        help="bytes/s per connection for answer bodies, e.g. 50MiB (default 0: unlimited)",
    )
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port (port 0: any)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    proxy = DelayProxy(
        args.upstream,
        args.delay_ms / 1000,
        host or "127.0.0.1",
        int(port),
        bandwidth=args.bandwidth,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with proxy:
        cap = f"{args.bandwidth:,} B/s per connection" if args.bandwidth else "no bandwidth cap"
        print(
            f"delay_proxy: {proxy.url} -> {args.upstream}, +{args.delay_ms} ms, {cap}",
            flush=True,
        )
        stop.wait()
    print(f"delay_proxy: stopped; forwarded {json.dumps(proxy.stats())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
