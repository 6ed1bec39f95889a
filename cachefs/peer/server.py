"""The owner's side of a peer read: a raw ASGI app serving blocks to other workers.

No framework: this is on the read path of every remote cache hit, and a block request needs only
a path compare, a token compare and a query parse. Each response carries the block's chunk
checksums as ``serve_block`` hands them over — for a cached block, those its index recorded at
admission, never computed here over what was just read — so the reader checks the bytes end to
end: against what this node admitted, whatever happened to them on its disk or on the wire. The
server never sends a block of the wrong length. Concurrency is capped: past ``max_inflight`` the
answer is an immediate 503, so an overloaded owner sheds readers (who then go to the store)
instead of queueing them into timeouts.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qsl

from cachefs.cache.base import CHUNK_CHECKSUM_LEN, CHUNK_SIZE, CheckedBlock, chunk_count
from cachefs.errors import CachefsError
from cachefs.peer.base import (
    BLOCKS_PATH,
    CHUNK_CHECKSUMS_HEADER,
    CHUNK_SIZE_HEADER,
    BlockRequest,
    NotCached,
)

log = logging.getLogger(__name__)

HEALTH_PATH = "/v1/peer/health"

ServeBlock = Callable[[BlockRequest], Awaitable[CheckedBlock]]


def create_peer_app(serve_block: ServeBlock, token: str, *, max_inflight: int = 64):
    """Return the ASGI app answering ``GET /v1/blocks`` (bearer ``token``) and the health probe.

    ``serve_block`` returns the whole block with its :data:`CHUNK_SIZE` chunk checksums (a
    ``CheckedBlock``); it raises ``LookupError`` when this node does not
    have the file (404), :class:`NotCached` when a cached-only request (``req.cached_only``)
    finds the block not cached (404 "not cached"), and a ``CachefsError`` when it cannot get the
    block (503, message as body).
    """
    if not token:
        raise ValueError("the peer token must not be empty")
    expected_auth = f"Bearer {token}".encode()
    inflight = 0

    async def app(scope, receive, send) -> None:
        nonlocal inflight
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close"})  # the only other scope type
            return
        if scope["method"] != "GET":
            await _respond(send, 404, b"not found")
            return
        if scope["path"] == HEALTH_PATH:
            await _respond(send, 200, b"ok")
            return
        if scope["path"] != BLOCKS_PATH:
            await _respond(send, 404, b"not found")
            return
        auth = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if not hmac.compare_digest(auth, expected_auth):
            await _respond(send, 401, b"bad or missing peer token")
            return
        try:
            req = _parse(scope["query_string"])
        except ValueError as err:
            await _respond(send, 400, str(err).encode())
            return
        if inflight >= max_inflight:
            await _respond(send, 503, b"too many concurrent peer reads")
            return
        inflight += 1
        try:
            status, body, chunk_sums = await _serve(serve_block, req)
        finally:
            inflight -= 1
        if status != 200:
            await _respond(send, status, body)
            return
        checksum_headers = [
            (CHUNK_SIZE_HEADER, str(CHUNK_SIZE).encode()),
            (CHUNK_CHECKSUMS_HEADER, chunk_sums.hex().encode()),
        ]
        await _respond(send, 200, body, b"application/octet-stream", checksum_headers)

    return app


def _parse(query_string: bytes) -> BlockRequest:
    """The request in the query; ``ValueError`` with a short reason if it is malformed."""
    try:
        pairs = parse_qsl(
            query_string.decode("ascii"),
            keep_blank_values=True,  # an etag (or key) may be empty
            strict_parsing=True,
            errors="strict",
        )
    except UnicodeError:
        raise ValueError("query is not valid percent-encoded UTF-8") from None
    return BlockRequest.from_params(dict(pairs))


async def _serve(serve_block: ServeBlock, req: BlockRequest) -> tuple[int, bytes, bytes]:
    """Status, body and chunk checksums for one block: the block itself, or a short error text
    (and no checksums)."""
    try:
        data, chunk_sums = await serve_block(req)
    except NotCached:
        return 404, b"not cached", b""
    except LookupError:
        return 404, b"not this node's file", b""
    except CachefsError as err:
        return 503, str(err).encode("utf-8", "backslashreplace"), b""
    except Exception:
        log.exception("serving peer block %d of %r in %r failed", req.index, req.key, req.dataset)
        return 500, b"internal error", b""
    expected_sums = chunk_count(req.length) * CHUNK_CHECKSUM_LEN
    if len(data) != req.length or len(chunk_sums) != expected_sums:
        log.error(
            "peer block %d of %r in %r has %d bytes and %d bytes of checksums, expected %d "
            "and %d: not sent",
            req.index,
            req.key,
            req.dataset,
            len(data),
            len(chunk_sums),
            req.length,
            expected_sums,
        )
        return 500, b"internal error: wrong block length", b""
    return 200, data, chunk_sums


TEXT = b"text/plain; charset=utf-8"


async def _respond(send, status: int, body: bytes, content_type=TEXT, extra=()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive, send) -> None:
    """Acknowledge startup and shutdown: the app holds no resources of its own."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
