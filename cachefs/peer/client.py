"""The reader's side of a peer read: fetch blocks from the nodes that own their shards.

One connection per peer, opened on first use and kept: every block request to that peer is a
frame on it, tagged with an id, and a receive task per connection hands each answer to the
request it names (cachefs/peer/wire.py). Requests written together are a batch
(:meth:`PeerClient.get_blocks`).

A peer read is an optimisation over the object store, so it must fail fast and cheaply: each
request is bounded by ``timeout_s`` (a SIGSTOPped peer accepts connections but never answers),
and a peer that just failed at the transport level — or timed out — has its connection closed
(failing every request on it at once) and is skipped for ``cooldown_s`` without any I/O, so
reads go straight to the store instead of each paying the timeout again. A peer that answers but
declines (not its file, not cached, overloaded, its store failing) is healthy and is not cooled
down. Bytes are returned only if their length and the checksum of every chunk match those the
owner sent, which its index recorded when it admitted the block: a corrupt transfer, or a block
damaged on the owner's disk, is an error, never data (the reader then reads the store).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from cachefs.background import BackgroundTasks
from cachefs.cache.base import CHUNK_CHECKSUM_LEN, chunk_count, first_bad_chunk
from cachefs.peer import wire
from cachefs.peer.base import (
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    BlockRequest,
    PeerError,
    PeerRefused,
    PeerUnavailable,
)
from cachefs.peer.stream import ConnectionEnded, FrameReader, write_without_waiting

log = logging.getLogger(__name__)


class _PeerFault(Exception):
    """Internal: the peer misbehaved at the transport level; the message says how."""


class _Pending:
    """A request waiting for its answer (set by the connection's receive task)."""

    __slots__ = ("answer", "done", "fault", "request", "request_id")

    def __init__(self, request_id: int, request: BlockRequest):
        self.request_id = request_id
        self.request = request
        self.done = trio.Event()
        self.answer: tuple[int, int, bytes, bytes] | None = None  # status, chunk size, sums, body
        self.fault: str | None = None


class _Connection:
    """One handshaken connection to a peer, shared by every request to it."""

    def __init__(self, address: str, stream: trio.SocketStream, reader: FrameReader):
        self.address = address
        self._stream = stream
        self._reader = reader
        self._send_lock = trio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 1
        self.broken: str | None = None  # why it can no longer be used

    @property
    def stream(self) -> trio.SocketStream:
        return self._stream

    async def ask(self, requests: Sequence[BlockRequest]) -> list[_Pending]:
        """Send ``requests`` in one write; their answers arrive in the returned slots."""
        slots = []
        for request in requests:
            request_id, self._next_id = self._next_id, self._next_id % 0xFFFFFFFF + 1
            slots.append(_Pending(request_id, request))
            self._pending[request_id] = slots[-1]
        frames = b"".join(wire.encode_request(slot.request_id, slot.request) for slot in slots)
        try:
            if not self._send_lock.locked():
                # Nothing else is being sent: write now, without the lock's and the socket's
                # trips through trio's scheduler; only what the socket does not take at once
                # is sent under the lock (a request is a few dozen bytes: that is rare).
                written = write_without_waiting(self._stream.socket.fileno(), frames)
                if written == len(frames):
                    return slots
                frames = frames[written:]
            async with self._send_lock:
                await self._stream.send_all(frames)
        except BaseException as err:  # a half-written frame would garble every later one
            self.close(f"sending failed: {_describe(err)}")
            raise
        return slots

    def forget(self, slots: Sequence[_Pending]) -> None:
        """Stop waiting for these answers (done, timed out or cancelled)."""
        for slot in slots:
            self._pending.pop(slot.request_id, None)

    async def receive(self) -> None:
        """Hand every answer to its request until the connection ends (runs as a task)."""
        try:
            while True:
                head = await self._reader.exactly(wire.ANSWER.size)
                request_id, status, chunk_size, sums_len, body_len = wire.ANSWER.unpack(head)
                wire.check_answer_lengths(status, sums_len, body_len)
                slot = self._pending.get(request_id)
                if slot is not None and status == wire.OK and body_len != slot.request.length:
                    # never read more than one block for a request
                    raise _PeerFault(
                        f"an answer of {body_len} bytes for a {slot.request.length}-byte block"
                    )
                sums = await self._reader.exactly(sums_len) if sums_len else b""
                body = await self._reader.exactly(body_len)
                if slot is not None:  # else its asker gave up: the answer is dropped
                    slot.answer = status, chunk_size, sums, body
                    slot.done.set()
        except (ValueError, _PeerFault) as err:
            self.close(f"garbage on the connection: {err}")
        except (
            ConnectionEnded,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            OSError,
        ) as err:
            self.close(_describe(err))

    def close(self, reason: str) -> None:
        """Fail every waiting request with ``reason`` and close the socket."""
        if self.broken is None:
            self.broken = reason
        for slot in self._pending.values():
            if not slot.done.is_set():
                slot.fault = self.broken
                slot.done.set()
        self._pending.clear()
        self._stream.socket.close()


class PeerClient:
    """Connections to all peers plus each peer's cool-down deadline.

    The connections' receive tasks live in :meth:`run`'s nursery: start it before the first
    request (``await nursery.start(client.run)``, or ``async with open_peer_client(...)``);
    cancelling it closes every connection.
    """

    def __init__(
        self,
        token: str,
        *,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        cooldown_s: float = 5.0,
    ):
        self._token = token
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}  # address -> time.monotonic() deadline
        self._connections: dict[str, _Connection] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self._tasks = BackgroundTasks()  # the connections' receivers

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._tasks.run(task_status=task_status)
        finally:
            for connection in list(self._connections.values()):
                connection.close("the peer client stopped")
            self._connections.clear()

    @property
    def timeout_s(self) -> float:
        """How long a request may wait for its answer before the peer is marked down."""
        return self._timeout_s

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    async def get_block(self, address: str, req: BlockRequest) -> bytes:
        """The block's bytes from the peer at ``address`` ("host:port"), checksum-verified.

        Raises :class:`PeerUnavailable` while the peer cools down, :class:`PeerRefused` when it
        declines, and :class:`PeerError` for any other failure.
        """
        (result,) = await self.get_blocks(address, [req])
        if isinstance(result, PeerError):
            raise result
        return result

    async def get_blocks(
        self, address: str, requests: Sequence[BlockRequest]
    ) -> list[bytes | PeerError]:
        """Several blocks from one peer, asked in one write: for each request its verified
        bytes or the :class:`PeerError` (refused, cooling, failed) :meth:`get_block` would
        raise. The whole batch is bounded by ``timeout_s``."""
        if self.is_cooling(address):
            reason = "cooling down after a recent failure"
            return [PeerUnavailable(_message(address, reason, req)) for req in requests]
        connection: _Connection | None = None
        slots: list[_Pending] = []
        with trio.move_on_after(self._timeout_s):
            try:
                connection = await self._connection(address)
                slots = await connection.ask(requests)
                for slot in slots:
                    await slot.done.wait()
            except (
                _PeerFault,
                ConnectionEnded,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
                OSError,
            ) as err:
                self.mark_down(address, connection, _describe(err))
                return [PeerError(_message(address, _describe(err), req)) for req in requests]
            finally:
                if connection is not None:
                    connection.forget(slots)
            return [self._result(address, slot) for slot in slots]
        reason = f"no complete answer within {self._timeout_s} s"
        self.mark_down(address, connection, reason)
        return [PeerError(_message(address, reason, req)) for req in requests]

    async def open_stream(self, address: str) -> trio.SocketStream:
        """A handshaken connection of the caller's own to ``address``, for requests it sends
        and answers it reads itself (the native peer reads: cachefs/fs/native_peer_reads.py);
        the handshake (version, token) is this client's. Raises :class:`PeerUnavailable`
        while the peer cools down and :class:`PeerError` when no connection is made within
        ``timeout_s``; the caller marks the peer down if it fails later."""
        if self.is_cooling(address):
            raise PeerUnavailable(_message(address, "cooling down after a recent failure"))
        try:
            with trio.fail_after(self._timeout_s):
                connection = await self._connect(address)
        except trio.TooSlowError:
            reason = f"no handshake within {self._timeout_s} s"
        except (_PeerFault, ConnectionEnded, OSError) as err:
            reason = _describe(err)
        else:
            return connection.stream
        self.mark_down(address, reason=reason)
        raise PeerError(_message(address, reason))

    def _result(self, address: str, slot: _Pending) -> bytes | PeerError:
        req = slot.request
        try:
            if slot.fault is not None:
                raise _PeerFault(slot.fault)
            assert slot.answer is not None
            status, chunk_size, sums, body = slot.answer
            if status != wire.OK:
                reason = body.decode("utf-8", "replace")
                refusal = wire.REFUSAL_STATUS.get(status)
                if refusal is None:  # a bad request or the owner's bug: not a refusal
                    return PeerError(_message(address, reason, req))
                return PeerRefused(
                    _message(address, f"refused, {refusal}: {reason}", req), status=refusal
                )
            _check(body, chunk_size, sums, req)
            return body
        except _PeerFault as err:
            self.mark_down(address, None, str(err))
            return PeerError(_message(address, str(err), req))

    async def _connection(self, address: str) -> _Connection:
        connection = self._connections.get(address)
        if connection is not None and connection.broken is None:
            return connection
        lock = self._connecting.setdefault(address, trio.Lock())
        async with lock:  # one connection per peer, however many requests want it at once
            connection = self._connections.get(address)
            if connection is not None and connection.broken is None:
                return connection
            if not self._tasks.running:  # stopped (shutting down) or never started
                raise _PeerFault("this node's peer client is not running")
            connection = await self._connect(address)
            self._connections[address] = connection
            if not self._tasks.start_soon(self._receive, connection):  # stopped meanwhile
                connection.close("the peer client stopped")
                raise _PeerFault("this node's peer client is not running")
            return connection

    async def _receive(self, connection: _Connection) -> None:
        try:
            await connection.receive()
        finally:  # ended (the peer went away, or it was closed): the next request reconnects
            if self._connections.get(connection.address) is connection:
                del self._connections[connection.address]

    async def _connect(self, address: str) -> _Connection:
        host, _, port = address.rpartition(":")
        try:
            with trio.fail_after(self._connect_timeout_s):
                stream = await trio.open_tcp_stream(host.strip("[]"), int(port))
        except trio.TooSlowError:
            raise _PeerFault(f"no connection within {self._connect_timeout_s} s") from None
        except ValueError:
            raise _PeerFault(f"{address!r} is not host:port") from None
        try:
            reader = FrameReader(stream.socket)
            await stream.send_all(wire.hello(self._token))
            magic, version, verdict = wire.WELCOME.unpack(await reader.exactly(wire.WELCOME.size))
            if magic != wire.MAGIC:
                raise _PeerFault("does not speak the cachefs block protocol (another program?)")
            if version != wire.VERSION or verdict == wire.HELLO_BAD_VERSION:
                log.warning(
                    "peer %s speaks block protocol version %d, this node speaks %d: refused (run "
                    "one cachefs version on every node)",
                    address,
                    version,
                    wire.VERSION,
                )
                raise _PeerFault(f"speaks block protocol version {version}, not {wire.VERSION}")
            if verdict == wire.HELLO_BAD_TOKEN:
                raise _PeerFault("refused our token")
            if verdict != wire.HELLO_OK:
                raise _PeerFault(f"unknown handshake verdict {verdict}")
        except BaseException:
            stream.socket.close()
            raise
        return _Connection(address, stream, reader)

    def mark_down(
        self, address: str, connection: _Connection | None = None, reason: str = ""
    ) -> None:
        """Skip ``address`` for ``cooldown_s`` from now and close its connection (every request
        on it fails at once: one stalled peer costs the timeout once, not once per request)."""
        self._down_until[address] = time.monotonic() + self._cooldown_s
        current = self._connections.pop(address, None)
        for stale in {current, connection}:
            if stale is not None:
                stale.close(reason or "marked down")

    def is_cooling(self, address: str) -> bool:
        deadline = self._down_until.get(address)
        if deadline is None:
            return False
        if time.monotonic() < deadline:
            return True
        del self._down_until[address]
        return False


@asynccontextmanager
async def open_peer_client(token: str, **kwargs: float) -> AsyncIterator[PeerClient]:
    """A running :class:`PeerClient` for the duration of the block."""
    client = PeerClient(token, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        try:
            yield client
        finally:
            nursery.cancel_scope.cancel()


def _check(body: bytes, chunk_size: int, sums: bytes, req: BlockRequest) -> None:
    """_PeerFault unless ``body`` is the whole block and every chunk matches its checksum."""
    if len(body) != req.length:
        raise _PeerFault(f"{len(body)} bytes, expected {req.length}")
    if not MIN_BLOCK_SIZE <= chunk_size <= MAX_BLOCK_SIZE:
        raise _PeerFault(f"chunk size {chunk_size} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    expected = chunk_count(req.length, chunk_size)
    if len(sums) != expected * CHUNK_CHECKSUM_LEN:
        raise _PeerFault(f"{len(sums) // CHUNK_CHECKSUM_LEN} chunk checksums, expected {expected}")
    bad = first_bad_chunk(body, sums, chunk_size=chunk_size)
    if bad is not None:
        raise _PeerFault(f"checksum mismatch in chunk {bad} ({chunk_size}-byte chunks)")


def _message(address: str, reason: str, req: BlockRequest | None = None) -> str:
    if req is None:
        return f"peer {address}: {reason}"
    return (
        f"peer {address}: block {req.index} of key {req.key!r} in dataset {req.dataset!r}: {reason}"
    )


def _describe(err: BaseException) -> str:
    """Socket errors often have an empty ``str()``; the class name alone still says why."""
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
