"""Bulk fetching for the preloader, spread over several processes.

An SDK GET costs about 1.4 ms of client CPU (boto3), so one Python process tops out near 700
GETs/s per core — and the worker process must keep its core for FUSE. Preload fetches run in a
pool of helper processes instead; each opens its own store client once per dataset. The
preload's requests (:meth:`FetcherPool.start_into`) name a file of a cache reservation
(cachefs/cache/admission.py): the fetcher writes the block there and sends back only its
checksums, and the worker admits the file (a rename and an index entry) — the block's bytes
never cross the pipe or the worker. :meth:`FetcherPool.fetch` / ``start`` send the bytes back
instead (the benchmarks measure the GET path with them).

Each fetcher process keeps many GETs in flight at once (up to ``threads``): how many the whole
pool has in flight is the preloader's to decide (its adaptive limit,
cachefs/store/concurrency.py), not one per process. The small blocks of S3 sources have their
first try on the process's main thread, in a selector loop over keep-alive connections
(:class:`cachefs.store.get_loop.GetLoop`), which also reads the pipe: a thread per GET cost
more CPU in thread hand-offs than in HTTP (0.29-0.36 ms of a fetcher's CPU per 110 KB GET
against 0.11-0.13 ms in the loop, bench/results/store_fetch_rate/2026-12-01-get-loop.md).
Large blocks, other stores, and every request whose first try the loop left undone (a
transient error, a stall) run on threads (one per request, up to ``threads``), through the
store's ordinary read with its retries. Requests and answers are multiplexed
over one pipe per process, tagged with a request number; a reader thread in the worker hands
each answer to the future of its request. An answer says whether any of the request's tries
the store answered "slow down" (the adaptive limit's signal); the checksums of a written block,
or the bytes, follow. Messages are packed with ``struct``, not pickled: pickling each request
(its store configuration included) and each answer took a fifth of the preloading thread's
Python time and about half of a fetcher's
(bench/results/store_fetch_rate/2026-11-28-packed-pipe.md). A store configuration crosses the
pipe once, pickled, and requests name it by a number.

S3 sources are read through S3Store, whose GETs use the lean bulk-GET client
(:class:`cachefs.store.s3_bulk.S3BulkReader`: its own SigV4 signer over pooled keep-alive
connections, a fraction of boto3's client CPU per GET) unless ``lean_s3=False`` or the source's
configuration needs boto3 (then botocore, logged once). OSS and local sources use their usual
store clients.

The processes are started with ``forkserver``: forking the worker itself (threads, a FUSE
session) would copy locks held by other threads. ``processes=0`` fetches on threads of the
worker's own process instead (no extra processes; for small machines and tests).

Each fetcher exits when the worker that owns the pool does, however it ends: its pipe reaches
EOF, and a watcher thread follows the owner's pid (a fetcher blocked in a GET still ends).
They ignore SIGINT: Ctrl-C in a terminal reaches every process of the foreground group, and
the worker, which handles it, stops its fetchers itself (a fetcher interrupted mid-GET would
only print a traceback).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import random
import select
import signal
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import ForkServerContext
from typing import Any, NamedTuple

from cachefs.cache.base import block_checksums
from cachefs.cache.tier import write_new_file
from cachefs.errors import CachefsError, StoreError
from cachefs.store import ObjectStore, StoreConfig, open_store, parse_uri
from cachefs.store.concurrency import PRELOAD_BOUNDS, throttled_tries
from cachefs.store.get_loop import LOOP_MAX_BYTES, GetLoop
from cachefs.store.retry import backoff_s
from cachefs.store.s3 import LEAN_GETS, S3Store
from cachefs.store.s3_bulk import S3BulkReader
from cachefs.threads import LazyThreads

log = logging.getLogger(__name__)

#: GETs one fetcher process runs at once: enough for the preload's whole adaptive ceiling,
#: however the requests spread over the processes (threads start only when needed).
FETCHER_THREADS = PRELOAD_BOUNDS.ceiling


#: Whether fetchers read S3 sources with the lean bulk-GET client (cachefs/store/s3_bulk.py)
#: rather than boto3: the store's own default; ``FetcherPool(lean_s3=...)`` overrides it.
LEAN_S3_GETS = LEAN_GETS

# Per process: one store client per dataset source (and client kind).
_stores: dict[tuple[StoreConfig, bool], ObjectStore] = {}
_stores_lock = threading.Lock()

#: A fetch as it crosses the pipe: the arguments of :func:`fetch_range` before ``lean_s3``
#: (config, key, offset, length, etag).
FetchRequest = tuple[StoreConfig, str, int, int, str]


@dataclass(frozen=True, slots=True)
class Fetched:
    """A block's bytes, and whether the store answered "slow down" to any of its tries."""

    data: bytes
    throttled: bool


@dataclass(frozen=True, slots=True)
class Written:
    """A block a fetcher wrote to the file it was given (a cache reservation's path): the
    checksums of the bytes written, for the cache's index, and whether the store answered
    "slow down" on the way."""

    checksum: int
    chunk_checksums: bytes
    throttled: bool


#: Outcome labels (FetchFailed.kind) of failures that are not the store's errors.
SHORT_READ = "ShortRead"
CACHE_WRITE = "CacheWriteError"

#: A written block's checksums as they cross the pipe: (checksum, chunk checksums).
WrittenSums = tuple[int, bytes]


class FetchFailed(StoreError):
    """A fetch failed: the store's error as one line; ``kind``, the class name of the error
    (the outcome label of the GET in the worker's metrics); ``throttled``: the store told it
    to slow down on the way."""

    def __init__(
        self, cause: str, *, kind: str = "FetchFailed", throttled: bool = False, **context: str
    ):
        super().__init__(cause, **context)
        self.kind = kind
        self.throttled = throttled


class Failure(NamedTuple):
    """A failed fetch as it crosses the pipe: our exceptions carry keyword-only constructor
    arguments that do not survive pickling, so the class name and the message go instead."""

    kind: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        return cls(type(exc).__name__, str(exc))

    def error(self, throttled: bool) -> FetchFailed:
        return FetchFailed(self.message, kind=self.kind, throttled=throttled)


# --- the pipe between the pool and a fetcher process -----------------------------------------
#
# Every message is one ``send_bytes``. To the fetcher: a store configuration (``_CONFIG``, then
# the pickled (number, StoreConfig)), sent once before the first request that names it; a
# request (``_REQUEST``: its number, its configuration's number, offset, length, and the lengths
# of the key, etag and path that follow in UTF-8; no path: the bytes come back); or "stop".
# From the fetcher: ``_ANSWER`` (the request's number, its outcome, whether it was throttled, the
# block's checksum), then for a written block its chunk checksums, for a failure the error's
# kind and message (UTF-8, split by a NUL), and for the bytes, a second message holding them.

_CONFIG = b"C"
_REQUEST = b"R"
_STOP = b"S"
_REQUEST_HEAD = struct.Struct("<cQIQQIII")
_ANSWER = struct.Struct("<QBBQ")
_WRITTEN, _BYTES, _FAILED = 0, 1, 2


def _encode_request(
    number: int, config_number: int, request: FetchRequest, path: str | None
) -> bytes:
    _, key, offset, length, etag = request
    # surrogatepass: a key or path may hold any str, undecodable bytes of a local store's
    # file names (surrogateescape) included; it must come back exactly as it went.
    raw_key, raw_etag, raw_path = (_utf8(text) for text in (key, etag, path or ""))
    head = _REQUEST_HEAD.pack(
        _REQUEST, number, config_number, offset, length, len(raw_key), len(raw_etag), len(raw_path)
    )
    return b"".join((head, raw_key, raw_etag, raw_path))


def _decode_request(
    message: bytes, configs: dict[int, StoreConfig]
) -> tuple[int, FetchRequest, str | None]:
    _, number, config_number, offset, length, key_len, etag_len, path_len = (
        _REQUEST_HEAD.unpack_from(message)
    )
    at = _REQUEST_HEAD.size
    key = _text(message[at : at + key_len])
    etag = _text(message[at + key_len : at + key_len + etag_len])
    path = _text(message[at + key_len + etag_len : at + key_len + etag_len + path_len])
    return number, (configs[config_number], key, offset, length, etag), path or None


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass")


def _encode_failure(number: int, failure: Failure, throttled: bool) -> bytes:
    text = _utf8(f"{failure.kind}\0{failure.message}")
    return _ANSWER.pack(number, _FAILED, throttled, 0) + text


def _decode_failure(text: bytes) -> Failure:
    kind, _, message = _text(text).partition("\0")
    return Failure(kind, message)


def _store(config: StoreConfig, lean_s3: bool) -> ObjectStore:
    with _stores_lock:  # many fetch threads: one client per source
        store = _stores.get((config, lean_s3))
        if store is None:
            store = _stores[(config, lean_s3)] = _open(config, lean_s3)
        return store


def _open(config: StoreConfig, lean_s3: bool) -> ObjectStore:
    """The client a fetcher reads ``config``'s source with: its usual store, whose S3 GETs go
    through the lean bulk-GET client (cachefs/store/s3.py ``LEAN_GETS``) unless ``lean_s3`` is
    off (benchmarks compare both) or the client cannot handle the configuration (the reasons
    are in cachefs/store/s3_bulk.py, ``_refuse_unsupported``: a proxy, a signing other than
    SigV4 for "s3", an unusual URL)."""
    if parse_uri(config.uri).scheme == "s3":
        from cachefs.store.s3 import S3Store

        return S3Store(config, lean_gets=lean_s3)
    return open_store(config)


def fetch_range(
    config: StoreConfig,
    key: str,
    offset: int,
    length: int,
    etag: str,
    *,
    lean_s3: bool = LEAN_S3_GETS,
) -> tuple[bytes | Failure, bool]:
    """One GET (with the store's retries). Returns (the bytes or the :class:`Failure`,
    throttled): ``throttled``, the store counted a "slow down" try meanwhile."""
    try:
        # Opening can fail too (no credentials, a bad profile): the fetch fails with it.
        store = _store(config, lean_s3)
    except CachefsError as exc:
        return Failure.of(exc), False
    before = throttled_tries(store)
    try:
        data: bytes | Failure = store.get_range(key, offset, length, etag=etag)
    except CachefsError as exc:
        data = Failure.of(exc)
    return data, throttled_tries(store) > before


def _fetch_inline(request: FetchRequest, lean_s3: bool) -> Fetched:
    """:func:`fetch_range` as a pool thread of this process runs it (``processes=0``)."""
    data, throttled = fetch_range(*request, lean_s3=lean_s3)
    if isinstance(data, Failure):
        raise data.error(throttled)
    return Fetched(data, throttled)


def whole(fetched: Fetched, key: str, length: int) -> Fetched:
    """``fetched`` if it holds the ``length`` bytes asked for, else FetchFailed: a short read
    is never admitted."""
    if len(fetched.data) != length:
        raise FetchFailed(
            f"got {len(fetched.data)} bytes for a {length}-byte range of {key!r}",
            kind=SHORT_READ,
            throttled=fetched.throttled,
        )
    return fetched


def fetch_into(
    request: FetchRequest, path: str, *, lean_s3: bool = LEAN_S3_GETS
) -> tuple[WrittenSums | Failure, bool]:
    """One GET whose bytes go to a new file at ``path`` (mode 0600) rather than back through
    the pipe: the block's checksums, or the :class:`Failure`; and whether it was throttled.
    A short read is a failure, and leaves no file."""
    data, throttled = fetch_range(*request, lean_s3=lean_s3)
    if isinstance(data, Failure):
        return data, throttled
    return write_block(request, path, data), throttled


def write_block(request: FetchRequest, path: str, data: bytes | bytearray) -> WrittenSums | Failure:
    """The fetched bytes of ``request`` written to a new file at ``path``: their checksums,
    or the :class:`Failure` (a short read leaves no file)."""
    _, key, _, length, _ = request
    if len(data) != length:
        return Failure(SHORT_READ, f"got {len(data)} bytes for a {length}-byte range of {key!r}")
    try:
        write_new_file(path, data)
    except OSError as exc:
        return Failure(CACHE_WRITE, f"could not write the block to the cache: {exc}")
    return block_checksums(data)


def _fetch_into_inline(request: FetchRequest, path: str, lean_s3: bool) -> Written:
    """:func:`fetch_into` as a pool thread of this process runs it (``processes=0``)."""
    sums, throttled = fetch_into(request, path, lean_s3=lean_s3)
    if isinstance(sums, Failure):
        raise sums.error(throttled)
    return Written(sums[0], sums[1], throttled)


def exit_with(owner: int) -> None:
    """Runs first in each fetcher process: SIGINT is ignored (the owner stops us), and a daemon
    thread ends the process when ``owner`` (the worker's pid, alive when this runs) exits. A
    pidfd names that very process (no pid reuse); where there is none (Linux < 5.3), the pid is
    polled once a second."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch() -> None:
        try:
            owner_fd = os.pidfd_open(owner)
        except ProcessLookupError:
            os._exit(0)
        except (AttributeError, OSError):
            while True:
                time.sleep(1.0)
                try:
                    os.kill(owner, 0)
                except ProcessLookupError:
                    os._exit(0)
        waiting = select.poll()  # (not select(): a descriptor may be numbered past 1,023)
        waiting.register(owner_fd, select.POLLIN)
        waiting.poll()  # readable once the owner has exited
        os._exit(0)

    threading.Thread(target=watch, name="cachefs-fetcher-owner", daemon=True).start()


def _answer(
    number: int, request: FetchRequest, path: str | None, lean_s3: bool, throttled: bool = False
) -> list[bytes | bytearray]:
    """The GET of one request, and the messages that answer it (``throttled``: an earlier try
    of it was answered "slow down")."""
    if path is not None:  # into a file: only the checksums go back
        sums, slowed = fetch_into(request, path, lean_s3=lean_s3)
        return _answer_written(number, sums, throttled or slowed)
    data, slowed = fetch_range(*request, lean_s3=lean_s3)
    return _answer_fetched(number, data, throttled or slowed)


def _answer_written(
    number: int, sums: WrittenSums | Failure, throttled: bool
) -> list[bytes | bytearray]:
    if isinstance(sums, Failure):
        return [_encode_failure(number, sums, throttled)]
    return [_ANSWER.pack(number, _WRITTEN, throttled, sums[0]) + sums[1]]


def _answer_fetched(
    number: int, data: bytes | bytearray | Failure, throttled: bool
) -> list[bytes | bytearray]:
    if isinstance(data, Failure):
        return [_encode_failure(number, data, throttled)]
    return [_ANSWER.pack(number, _BYTES, throttled, 0), data]  # the bytes follow the head


def _loop_reader(request: FetchRequest, lean_s3: bool) -> S3BulkReader | None:
    """The lean client whose GET of ``request`` the process's GET loop may send, or None: the
    request goes to a thread (not S3, boto3, a large block, or a store or client not open yet:
    opening one may wait on the network, a credentials provider, retries, so a thread's
    :func:`fetch_range` does it, and reports why it could not). Never blocks."""
    config, _, _, length, _ = request
    if not lean_s3 or not 0 < length <= LOOP_MAX_BYTES:
        return None
    if not _stores_lock.acquire(blocking=False):  # a thread is opening a store
        return None
    try:
        store = _stores.get((config, lean_s3))
    finally:
        _stores_lock.release()
    return store.opened_bulk_reader() if isinstance(store, S3Store) else None


def serve(conn: Connection, owner: int, threads: int, lean_s3: bool) -> None:
    """A fetcher process: GETs for each request on the pipe, answers in any order.

    Requests the GET loop can take (:func:`_loop_reader`) have their first try there, on this
    thread, at most ``threads`` at once; the others, and every request whose first try the
    loop did not finish (a transient error, a stall: cachefs/store/get_loop.py), go to up to
    ``threads`` threads that run the store's ordinary read, retries included."""
    exit_with(owner)
    send_lock = threading.Lock()  # an answer and its bytes go out together
    configs: dict[int, StoreConfig] = {}

    def send(messages: list[bytes | bytearray]) -> None:
        with send_lock:
            for message in messages:
                conn.send_bytes(message)

    def answer(
        number: int, request: FetchRequest, path: str | None, throttled: bool, after_s: float
    ) -> None:
        time.sleep(after_s)  # a try the store answered "slow down": its backoff
        try:
            messages = _answer(number, request, path, lean_s3, throttled)
        except Exception as exc:  # a bug here must still answer: the worker waits for each one
            messages = [_encode_failure(number, Failure.of(exc), throttled)]
        send(messages)

    answers = LazyThreads(threads, "cachefs-fetch", answer)
    loop = GetLoop(connections=threads)
    in_loop: dict[int, tuple[FetchRequest, str | None]] = {}

    def take(message: bytes) -> None:
        kind = message[:1]
        if kind == _REQUEST:
            number, request, path = _decode_request(message, configs)
            reader = _loop_reader(request, lean_s3)
            if reader is None:
                answers.submit((number, request, path, False, 0.0))
            else:
                _, key, offset, length, etag = request
                try:
                    loop.submit(number, reader, key, offset, length, etag)
                    in_loop[number] = (request, path)
                except Exception:  # it could not be signed (credentials that will not refresh,
                    # say): the ordinary read on a thread reports why
                    answers.submit((number, request, path, False, 0.0))
        elif kind == _CONFIG:
            config_number, config = pickle.loads(message[1:])
            configs[config_number] = config
        else:  # the owner closed the pool
            os._exit(0)

    def read_pipe() -> None:
        try:
            take(conn.recv_bytes())
            while conn.poll():  # every request already sent, before the loop's sockets
                take(conn.recv_bytes())
        except (EOFError, OSError):  # the owner is gone
            os._exit(0)

    loop.watch(conn, read_pipe)
    while True:
        for number, body, throttled in loop.poll():
            request, path = in_loop.pop(number)
            if body is None:  # not done there: the ordinary read, on a thread
                # After "slow down", its first try waits a backoff (the policy's first).
                after_s = backoff_s(request[0].retry, 1, random.random) if throttled else 0.0
                answers.submit((number, request, path, throttled, after_s))
                continue
            messages: list[bytes | bytearray]
            try:
                if isinstance(body, StoreError):  # the store's answer: no such key, say
                    messages = [_encode_failure(number, Failure.of(body), throttled)]
                elif path is None:
                    messages = _answer_fetched(number, body, throttled)
                else:
                    messages = _answer_written(number, write_block(request, path, body), throttled)
            except Exception as exc:  # as in answer(): every request is answered
                messages = [_encode_failure(number, Failure.of(exc), throttled)]
            send(messages)


class _Fetcher:
    """One fetcher process, seen from the worker: its pipe, and the requests it has not
    answered yet."""

    def __init__(self, context: ForkServerContext, threads: int, lean_s3: bool):
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(
            target=serve,
            args=(child_conn, os.getpid(), threads, lean_s3),
            name="cachefs-fetcher",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.pending: dict[int, Future[Any]] = {}  # Fetched or Written
        self._config_numbers: dict[StoreConfig, int] = {}  # the configurations sent
        self.alive = True
        self._lock = threading.Lock()  # pending, alive
        self._send_lock = threading.Lock()  # one request at a time on the pipe
        self._reader = threading.Thread(
            target=self._read_answers, name="cachefs-fetch-answers", daemon=True
        )
        self._reader.start()

    def submit(self, number: int, request: FetchRequest, path: str | None) -> Future[Any]:
        """Ask for one GET: its bytes back (a :class:`Fetched`), or with a ``path``, written
        there (a :class:`Written`)."""
        future: Future[Any] = Future()
        with self._lock:
            if not self.alive:
                raise FetchFailed("the fetcher process has exited (or the pool was closed)")
            self.pending[number] = future  # before it is sent: the answer may come at once
        # Sent under a lock of its own: the answers' reader takes _lock for each answer, and
        # must never wait behind a send waiting for the fetcher, which may be sending answers.
        with self._send_lock:
            try:
                config_number = self._config_numbers.get(request[0])
                if config_number is None:
                    config_number = self._config_numbers[request[0]] = len(self._config_numbers)
                    self.conn.send_bytes(_CONFIG + pickle.dumps((config_number, request[0])))
                self.conn.send_bytes(_encode_request(number, config_number, request, path))
            except OSError:  # the process is gone; its reader thread notices too
                with self._lock:
                    self.pending.pop(number, None)
                raise FetchFailed("the fetcher process has exited") from None
        return future

    def _read_answers(self) -> None:
        try:
            while True:
                message = self.conn.recv_bytes()
                number, outcome, throttled, block_checksum = _ANSWER.unpack_from(message)
                data = self.conn.recv_bytes() if outcome == _BYTES else b""
                with self._lock:
                    future = self.pending.pop(number)
                rest = message[_ANSWER.size :]
                if outcome == _FAILED:
                    future.set_exception(_decode_failure(rest).error(bool(throttled)))
                elif outcome == _WRITTEN:
                    future.set_result(Written(block_checksum, rest, bool(throttled)))
                else:
                    future.set_result(Fetched(data, bool(throttled)))
        except (EOFError, OSError):
            pass
        with self._lock:
            self.alive = False
            pending, self.pending = self.pending, {}
            self.conn.close()
        for future in pending.values():
            future.set_exception(FetchFailed("the fetcher process exited mid-fetch"))

    def close(self) -> None:
        """Without waiting: the process reads "stop" and exits at once (GETs in flight are
        dropped); our reader thread then reads EOF and closes the pipe (only it closes it: a
        pipe closed under a blocked reader could be reused by another file)."""
        with self._lock:
            self.alive = False
        with self._send_lock:
            try:
                self.conn.send_bytes(_STOP)
            except OSError:
                pass  # gone already


class FetcherPool:
    """``processes`` fetcher processes (started on the first fetch; one that died is replaced
    on the next), each running up to ``threads`` GETs at once; S3 sources through the lean
    bulk-GET client unless ``lean_s3`` is false (boto3)."""

    def __init__(
        self, processes: int, *, threads: int = FETCHER_THREADS, lean_s3: bool = LEAN_S3_GETS
    ):
        self.processes = processes
        self.threads = threads
        self.lean_s3 = lean_s3
        self._fetchers: list[_Fetcher] = []
        self._numbers = itertools.count()
        self._lock = threading.Lock()  # many preload threads call fetch(): one set of processes
        self._inline: ThreadPoolExecutor | None = None  # processes=0: the GETs' threads

    def pids(self) -> list[int]:
        with self._lock:
            return [f.process.pid for f in self._fetchers if f.process.pid is not None]

    def _least_busy(self) -> _Fetcher:
        with self._lock:
            self._fetchers = [f for f in self._fetchers if f.alive]
            if len(self._fetchers) < self.processes:
                context = multiprocessing.get_context("forkserver")
                while len(self._fetchers) < self.processes:
                    self._fetchers.append(_Fetcher(context, self.threads, self.lean_s3))
            return min(self._fetchers, key=lambda f: len(f.pending))

    def start(
        self, config: StoreConfig, key: str, offset: int, length: int, etag: str
    ) -> Future[Fetched]:
        """Start one GET without waiting: the future ends with the :class:`Fetched` bytes (not
        yet length-checked: :func:`whole`) or :class:`FetchFailed`. With ``processes=0`` the GET
        runs on a thread of this process."""
        request: FetchRequest = (config, key, offset, length, etag)
        if self.processes > 0:
            future: Future[Fetched] = self._least_busy().submit(next(self._numbers), request, None)
            return future
        return self._inline_pool().submit(_fetch_inline, request, self.lean_s3)

    def start_into(
        self, config: StoreConfig, key: str, offset: int, length: int, etag: str, path: str
    ) -> Future[Written]:
        """Like :meth:`start`, but the fetcher writes the bytes to a new file at ``path`` (a
        cache :class:`~cachefs.cache.base.Reservation`'s) and only their checksums come back:
        a block's bytes never cross the pipe, nor this process."""
        request: FetchRequest = (config, key, offset, length, etag)
        if self.processes > 0:
            future: Future[Written] = self._least_busy().submit(next(self._numbers), request, path)
            return future
        return self._inline_pool().submit(_fetch_into_inline, request, path, self.lean_s3)

    def _inline_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._inline is None:
                self._inline = ThreadPoolExecutor(self.threads, thread_name_prefix="cachefs-fetch")
            return self._inline

    def fetch(self, config: StoreConfig, key: str, offset: int, length: int, etag: str) -> Fetched:
        """Blocking: call from a thread. Raises FetchFailed with the reason."""
        return whole(self.start(config, key, offset, length, etag).result(), key, length)

    def close(self) -> None:
        with self._lock:
            fetchers, self._fetchers = self._fetchers, []
            inline, self._inline = self._inline, None
        for fetcher in fetchers:
            fetcher.close()
        if inline is not None:
            inline.shutdown(wait=False, cancel_futures=True)
        with _stores_lock:
            stores = list(_stores.values())
            _stores.clear()
        for store in stores:
            store.close()
