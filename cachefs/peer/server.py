"""The owner's side of a peer read: the block server other workers keep a connection open to.

The protocol (cachefs/peer/wire.py) is binary and multiplexed: after a handshake that checks the
bearer token once, a connection carries any number of block requests at once and each answer
names the request it answers, so every request is answered as soon as its block is ready: a
RAM-tier block at once by the connection's reading task (``serve_cached_now``), anything else
in a task of its own, so a block fetched from the store holds up no other. A cached block is
checked against the chunk checksums its index recorded at admission and then sent straight
from its file with ``os.sendfile``; the answer carries those checksums, so the reader checks
the bytes end to end — against what this node admitted, whatever happened to them on its disk
or on the wire. The server never sends a block of the wrong length. Concurrency is capped:
past ``max_inflight`` blocks being served the answer is an immediate "overloaded" (the reader
then goes to the store) instead of a queue into timeouts.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable

import trio

from cachefs.cache.base import CHUNK_CHECKSUM_LEN, CHUNK_SIZE, CheckedBlock, OpenBlock, chunk_count
from cachefs.errors import CachefsError
from cachefs.peer import wire
from cachefs.peer.base import BlockRequest, NativeAnswers, NotCached
from cachefs.peer.stream import (
    ConnectionEnded,
    FrameReader,
    send_file,
    sendfile_without_waiting,
    write_without_waiting,
)

log = logging.getLogger(__name__)

ServeBlock = Callable[[BlockRequest], Awaitable[CheckedBlock | OpenBlock]]
ServeCachedNow = Callable[[BlockRequest], CheckedBlock | OpenBlock | None]
#: (socket fd, received frames, most answers) -> what was answered, or None: not available.
AnswerNatively = Callable[[int, memoryview, int], NativeAnswers | None]

#: A client that has not finished its handshake after this long is dropped.
HANDSHAKE_TIMEOUT_S = 10.0
#: An answer the reader does not take within this long (a stopped reader) closes the connection,
#: so one stuck peer never holds the answers of others, or this node's descriptors, for ever.
SEND_TIMEOUT_S = 30.0
DEFAULT_MAX_INFLIGHT = 64
#: Requests a connection's reader answers inline in a row before it lets other tasks run.
INLINE_BETWEEN_CHECKPOINTS = 8
#: Requests the native table answers in one go (one call, no Python per request) before the
#: connection's reader lets other tasks run.
NATIVE_ANSWERS_IN_A_ROW = 32


class PeerServer:
    """Serves blocks to other workers: ``await nursery.start(server.serve, listener)``."""

    def __init__(
        self,
        serve_block: ServeBlock,
        token: str,
        *,
        serve_cached_now: ServeCachedNow | None = None,
        answer_natively: AnswerNatively | None = None,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        send_timeout_s: float = SEND_TIMEOUT_S,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ):
        """``serve_block`` returns the whole block (an :class:`OpenBlock` to send from its file,
        or a :class:`CheckedBlock` in memory), both with their :data:`CHUNK_SIZE` chunk
        checksums; it raises ``LookupError`` when this node does not have the file (refused:
        not this node's file), :class:`NotCached` when a cached-only request finds the block
        not cached, and a ``CachefsError`` when it cannot get the block (refused: unavailable,
        with the message).

        ``serve_cached_now``, if given, returns a block at once when it is in the fastest tier
        (None otherwise, or for anything ``serve_block`` would refuse): the connection's reader
        then answers the request itself, without a task, and writes the answer without waiting
        when the socket takes it all (else a task sends the rest). A profile of the owner put
        most of its CPU per block in the task, its cancel scope and trio's checkpoints around
        each send, not in the block. Anything else goes through ``serve_block``.

        ``answer_natively``, if given, is offered the frames received before any of them is
        parsed here, whenever no answer is being sent (while the rest of an answer it began
        is going out, the connection's reader waits for that first): it answers those at the
        front whose blocks the node's native table holds (cachefs_fast_read.c, "peer
        answers": no Python per request) and says how far it got; the rest go the ways
        above."""
        if not token:
            raise ValueError("the peer token must not be empty")
        self._serve_block = serve_block
        self._serve_cached_now = serve_cached_now
        self._answer_natively = answer_natively
        self._token = token.encode()
        self._max_inflight = max_inflight
        self._send_timeout_s = send_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self.inflight = 0  # blocks being served now, over all connections
        self.connections = 0  # open connections now

    async def serve(
        self,
        listener: socket.socket,
        *,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``listener`` (a bound TCP socket, handed over) until
        cancelled."""
        listener.listen(socket.SOMAXCONN)
        listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(listener))]
        await trio.serve_listeners(self._connection, listeners, task_status=task_status)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        peer = _address(stream)
        try:
            async with stream:
                reader = FrameReader(stream.socket)
                welcomed = False  # also when the handshake does not finish in time
                with trio.move_on_after(self._handshake_timeout_s):
                    welcomed = await self._handshake(stream, reader, peer)
                if welcomed:
                    await self._requests(stream, reader, peer)
        except (ConnectionEnded, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # the reader went away: its requests go with it
        finally:
            self.connections -= 1

    async def _handshake(self, stream: trio.SocketStream, reader: FrameReader, peer: str) -> bool:
        magic, version, token_len = wire.HELLO.unpack(await reader.exactly(wire.HELLO.size))
        if magic != wire.MAGIC or token_len > wire.MAX_TOKEN_LEN:
            log.warning("peer connection from %s: not the cachefs block protocol; closed", peer)
            return False
        token = await reader.exactly(token_len)
        if version != wire.VERSION:
            verdict = wire.HELLO_BAD_VERSION
            log.warning(
                "peer %s speaks block protocol version %d, this node speaks %d: refused (run "
                "one cachefs version on every node)",
                peer,
                version,
                wire.VERSION,
            )
        elif not hmac.compare_digest(token, self._token):
            verdict = wire.HELLO_BAD_TOKEN
            log.warning("peer connection from %s: wrong token; refused", peer)
        else:
            verdict = wire.HELLO_OK
        await stream.send_all(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, verdict))
        return verdict == wire.HELLO_OK

    async def _requests(self, stream: trio.SocketStream, reader: FrameReader, peer: str) -> None:
        """Read requests until the reader closes; answer each inline or in a task of its own."""
        # One answer at a time on the wire: head, checksums, block. A semaphore, not a lock: an
        # answer the reader started inline is finished by another task (see _answer_now).
        send_lock = trio.Semaphore(1)
        async with trio.open_nursery() as answers:
            try:
                await self._read_requests(stream, reader, peer, send_lock, answers)
            except (ConnectionEnded, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # the reader went away
            answers.cancel_scope.cancel()  # nobody is left to read the answers

    async def _read_requests(
        self,
        stream: trio.SocketStream,
        reader: FrameReader,
        peer: str,
        send_lock: trio.Semaphore,
        answers: trio.Nursery,
    ) -> None:
        answered_inline = 0
        native_rest_sent: trio.Event | None = None  # set once a native answer's rest is out
        while True:
            if self._answer_natively is not None:
                await reader.wait_for(wire.REQUEST.size)
                if native_rest_sent is not None:
                    # The socket did not take the last native answer whole, and a task sends
                    # its rest. What is asked meanwhile would be answered after it on the one
                    # wire anyway: wait for it, then offer the native table the frames
                    # received. (Parsing each in Python instead gave every one a task on the
                    # Python path: a py-spy profile of an owner put most of its peer-serving
                    # time there.) Answers of other kinds being sent are not waited for.
                    await native_rest_sent.wait()
                    native_rest_sent = None
                if send_lock.value == 1:
                    answered, native_rest_sent = self._answered_natively(
                        stream, reader, send_lock, answers
                    )
                    if answered:
                        await trio.lowlevel.checkpoint()  # up to NATIVE_ANSWERS_IN_A_ROW at once
                        continue
            head = await reader.exactly(wire.REQUEST.size)
            try:
                names = await reader.exactly(wire.request_names_length(head))
            except ValueError as err:  # no way to find the next frame: hang up
                log.warning("peer %s sent a malformed request (%s); closed", peer, err)
                return
            try:
                request_id, request = wire.decode_request(head, names)
            except ValueError as err:
                (request_id,) = struct.unpack_from("!I", head)
                refusal = wire.encode_refusal(request_id, wire.BAD_REQUEST, str(err))
                answers.start_soon(self._send, stream, send_lock, refusal, None)
                continue
            if self.inflight >= self._max_inflight:
                refusal = wire.encode_refusal(request_id, wire.OVERLOADED)
                answers.start_soon(self._send, stream, send_lock, refusal, None)
                continue
            if self._answer_now(stream, send_lock, request_id, request, answers):
                answered_inline += 1
                if answered_inline % INLINE_BETWEEN_CHECKPOINTS == 0:
                    # Requests already buffered are answered without any await: let the
                    # node's other tasks (FUSE among them) run now and then.
                    await trio.lowlevel.checkpoint()
                continue
            self.inflight += 1
            answers.start_soon(self._answer, stream, send_lock, request_id, request)

    def _answered_natively(
        self,
        stream: trio.SocketStream,
        reader: FrameReader,
        send_lock: trio.Semaphore,
        answers: trio.Nursery,
    ) -> tuple[bool, trio.Event | None]:
        """Let ``answer_natively`` answer the frames at the front of what was received:
        whether it answered any, and an event set once the last answer's rest is out when the
        socket did not take it whole (a task that holds the send lock sends it, as
        :meth:`_answer_now` does)."""
        assert self._answer_natively is not None
        try:
            done = self._answer_natively(
                stream.socket.fileno(), reader.unread(), NATIVE_ANSWERS_IN_A_ROW
            )
        except OSError as err:  # an answer's head went out: the connection must go
            raise trio.BrokenResourceError(f"send: {err}") from err
        if done is None or not done.answered:
            return False, None
        reader.skip(done.consumed)
        if done.partial is None:
            return True, None
        head, fd, length, sent = done.partial
        send_lock.acquire_nowait()
        block = OpenBlock(fd, length, b"")  # the checksums went out with the head
        rest_sent = trio.Event()
        answers.start_soon(self._finish, stream, send_lock, head, block, sent, rest_sent)
        return True, rest_sent

    def _answer_now(
        self,
        stream: trio.SocketStream,
        send_lock: trio.Semaphore,
        request_id: int,
        req: BlockRequest,
        answers: trio.Nursery,
    ) -> bool:
        """Answer a request whose block is at hand (``serve_cached_now``) from the reading
        task, if no other answer is being sent: written without waiting as far as the socket
        takes it, the rest by a task that holds the send lock until done. False: not at hand,
        the usual path answers it."""
        if self._serve_cached_now is None or send_lock.value == 0:
            return False
        try:
            block = self._serve_cached_now(req)
        except Exception:  # serve_block meets it again and answers as it should
            return False
        if block is None:
            return False
        checked = self._checked(request_id, req, block)
        if isinstance(checked, bytes):  # a refusal
            answers.start_soon(self._send, stream, send_lock, checked, None)
            return True
        head = wire.encode_answer(
            request_id, wire.OK, CHUNK_SIZE, checked.chunk_checksums, req.length
        )
        send_lock.acquire_nowait()
        try:
            sent = _send_without_waiting(stream.socket.fileno(), head, checked)
        except BaseException:
            send_lock.release()
            _close(checked)
            raise
        if sent == len(head) + req.length:
            send_lock.release()
            _close(checked)
        else:  # the socket is full: a task waits for it, the send lock held meanwhile
            answers.start_soon(self._finish, stream, send_lock, head, checked, sent)
        return True

    async def _finish(
        self,
        stream: trio.SocketStream,
        send_lock: trio.Semaphore,
        head: bytes,
        block: CheckedBlock | OpenBlock,
        sent: int,
        rest_sent: trio.Event | None = None,
    ) -> None:
        """The rest of an answer :meth:`_answer_now` or the native table began: ``sent``
        bytes of head and block are out, and the send lock is held. ``rest_sent`` is set when
        it is over (sent, or the connection closed)."""
        try:
            await self._send(stream, send_lock, head, block, sent=sent)
        finally:
            _close(block)
            if rest_sent is not None:
                rest_sent.set()

    async def _answer(
        self,
        stream: trio.SocketStream,
        send_lock: trio.Semaphore,
        request_id: int,
        req: BlockRequest,
    ) -> None:
        try:
            block = await self._block(request_id, req)
        finally:
            self.inflight -= 1
        if isinstance(block, bytes):  # a refusal
            await self._send(stream, send_lock, block, None)
            return
        try:
            await self._send(
                stream,
                send_lock,
                wire.encode_answer(
                    request_id, wire.OK, CHUNK_SIZE, block.chunk_checksums, req.length
                ),
                block,
            )
        finally:
            _close(block)

    async def _block(self, request_id: int, req: BlockRequest) -> CheckedBlock | OpenBlock | bytes:
        """The block to send, or the encoded refusal."""
        try:
            block = await self._serve_block(req)
        except NotCached:
            return wire.encode_refusal(request_id, wire.NOT_CACHED)
        except LookupError:
            return wire.encode_refusal(request_id, wire.NOT_THIS_NODES_FILE)
        except CachefsError as err:
            return wire.encode_refusal(request_id, wire.UNAVAILABLE, str(err))
        except Exception:
            log.exception(
                "serving peer block %d of %r in %r failed", req.index, req.key, req.dataset
            )
            return wire.encode_refusal(request_id, wire.INTERNAL_ERROR)
        return self._checked(request_id, req, block)

    def _checked(
        self, request_id: int, req: BlockRequest, block: CheckedBlock | OpenBlock
    ) -> CheckedBlock | OpenBlock | bytes:
        """``block`` if its length and checksums are the request's, else the encoded refusal
        (and an open block's file closed): never a block of the wrong length."""
        size = block.size if isinstance(block, OpenBlock) else len(block.data)
        if (
            size != req.length
            or len(block.chunk_checksums) != chunk_count(req.length) * CHUNK_CHECKSUM_LEN
        ):
            log.error(
                "peer block %d of %r in %r has %d bytes and %d bytes of checksums, expected %d "
                "and %d: not sent",
                req.index,
                req.key,
                req.dataset,
                size,
                len(block.chunk_checksums),
                req.length,
                chunk_count(req.length) * CHUNK_CHECKSUM_LEN,
            )
            _close(block)
            return wire.encode_refusal(
                request_id, wire.INTERNAL_ERROR, "internal error: wrong block length"
            )
        return block

    async def _send(
        self,
        stream: trio.SocketStream,
        send_lock: trio.Semaphore,
        head: bytes,
        block: CheckedBlock | OpenBlock | None,
        *,
        sent: int | None = None,
    ) -> None:
        """One whole answer, or the connection closed: a half-sent answer cannot be taken
        back, and a reader that takes nothing for SEND_TIMEOUT_S is gone. ``sent``: the send
        lock is held already and this many bytes of head and block are out."""
        with trio.move_on_after(self._send_timeout_s) as deadline:
            try:
                if sent is None:
                    await send_lock.acquire()
                try:
                    done = sent or 0
                    if done < len(head):
                        await stream.send_all(memoryview(head)[done:])
                    body_sent = max(0, done - len(head))
                    if isinstance(block, OpenBlock):
                        await send_file(stream.socket, block.fd, block.size, body_sent)
                    elif block is not None:
                        await stream.send_all(memoryview(block.data)[body_sent:])
                finally:
                    send_lock.release()
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        if deadline.cancelled_caught:
            log.warning(
                "peer %s took no answer for %.0f s; closed", _address(stream), self._send_timeout_s
            )
        await stream.aclose()


def _address(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "(gone)"
    return f"{host}:{port}"


def _send_without_waiting(fd: int, head: bytes, block: CheckedBlock | OpenBlock) -> int:
    """Write ``head`` then the block to the non-blocking socket ``fd`` until it would block:
    the bytes written. Raises ``trio.BrokenResourceError`` if the connection broke or the
    block's file ended early (the head announced the whole block: the connection must go)."""
    sent = write_without_waiting(fd, head)
    if sent < len(head):
        return sent
    if isinstance(block, OpenBlock):
        return sent + sendfile_without_waiting(fd, block.fd, 0, block.size)
    return sent + write_without_waiting(fd, block.data)


def _close(block: CheckedBlock | OpenBlock | bytes | None) -> None:
    if isinstance(block, OpenBlock):
        os.close(block.fd)
