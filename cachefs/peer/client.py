"""The reader's side of a peer read: fetch one block from the node that owns its shard.

A peer read is an optimisation over the object store, so it must fail fast and cheaply: the whole
call is bounded by ``timeout_s`` (a SIGSTOPped peer accepts connections but never answers), and
a peer that just failed at the transport level is skipped for ``cooldown_s`` without any I/O, so
reads go straight to the store instead of each paying the timeout again. A peer that answers but
declines (404/409/503) is healthy and is not cooled down. Bytes are returned only if their
length and the checksum of every chunk match those the owner sent, which its index recorded
when it admitted the block: a corrupt transfer, or a block damaged on the owner's disk, is an
error, never data (the reader then reads the store).
"""

from __future__ import annotations

import time

import httpx
import trio

from cachefs.cache.base import CHUNK_CHECKSUM_LEN, chunk_count, first_bad_chunk
from cachefs.peer.base import (
    BLOCKS_PATH,
    CHUNK_CHECKSUMS_HEADER,
    CHUNK_SIZE_HEADER,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    BlockRequest,
    PeerError,
    PeerRefused,
    PeerUnavailable,
)

#: Idle pooled connections are dropped before the server's keep-alive (hypercorn: 5 s) closes
#: them, so a request never races the server's close on a reused connection — such a reset
#: would look like a transport failure and cool down a healthy peer.
KEEPALIVE_EXPIRY_S = 4.0

REFUSED_STATUSES = frozenset({404, 409, 503})


class _PeerFault(Exception):
    """Internal: the peer misbehaved at the transport level; the message says how."""


class PeerClient:
    """Shared connection pool to all peers plus each peer's cool-down deadline.

    Use from one trio run and ``await aclose()`` before it ends (pooled connections belong to
    the run that opened them).
    """

    def __init__(
        self,
        token: str,
        *,
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        cooldown_s: float = 5.0,
        max_connections: int = 64,
    ):
        self._timeout_s = timeout_s
        self._cooldown_s = cooldown_s
        self._down_until: dict[str, float] = {}  # address -> time.monotonic() deadline
        self._http = httpx.AsyncClient(
            headers={"authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
            trust_env=False,  # peer traffic stays on the cluster network, never via a proxy
        )

    async def get_block(self, address: str, req: BlockRequest) -> bytes:
        """The block's bytes from the peer at ``address`` ("host:port"), checksum-verified.

        Raises :class:`PeerUnavailable` while the peer cools down, :class:`PeerRefused` when it
        declines, and :class:`PeerError` for any other failure.
        """
        if self.is_cooling(address):
            raise PeerUnavailable(_message(address, req, "cooling down after a recent failure"))
        with trio.move_on_after(self._timeout_s):
            try:
                return await self._fetch(address, req)
            except (httpx.HTTPError, httpx.InvalidURL, _PeerFault) as err:
                self.mark_down(address)
                raise PeerError(_message(address, req, _describe(err))) from err
        self.mark_down(address)
        raise PeerError(_message(address, req, f"no complete answer within {self._timeout_s} s"))

    def mark_down(self, address: str) -> None:
        """Skip ``address`` for ``cooldown_s`` from now."""
        self._down_until[address] = time.monotonic() + self._cooldown_s

    def is_cooling(self, address: str) -> bool:
        deadline = self._down_until.get(address)
        if deadline is None:
            return False
        if time.monotonic() < deadline:
            return True
        del self._down_until[address]
        return False

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _fetch(self, address: str, req: BlockRequest) -> bytes:
        url = f"http://{address}{BLOCKS_PATH}"
        async with self._http.stream("GET", url, params=req.to_params()) as resp:
            if resp.status_code != 200:
                reason = (await resp.aread())[:200].decode("utf-8", "replace")
                reason = f"HTTP {resp.status_code}: {reason}"
                if resp.status_code in REFUSED_STATUSES:
                    raise PeerRefused(_message(address, req, reason), status=resp.status_code)
                raise PeerError(_message(address, req, reason))
            # Check the announced length first: never read more than one block from a peer.
            announced = resp.headers.get("content-length")
            if announced != str(req.length):
                raise _PeerFault(f"content-length {announced}, expected {req.length}")
            chunk_size, chunk_sums = _chunk_checksums(resp.headers, req.length)
            data = await resp.aread()
        if len(data) != req.length:
            raise _PeerFault(f"{len(data)} bytes, expected {req.length}")
        bad = first_bad_chunk(data, chunk_sums, chunk_size=chunk_size)
        if bad is not None:
            raise _PeerFault(f"checksum mismatch in chunk {bad} ({chunk_size}-byte chunks)")
        return data


def _chunk_checksums(headers: httpx.Headers, length: int) -> tuple[int, bytes]:
    """The chunk size and chunk checksums a block's answer announces; _PeerFault if they are
    missing or malformed."""
    size_text = headers.get(CHUNK_SIZE_HEADER.decode(), "")
    if not (size_text.isascii() and size_text.isdigit()):
        raise _PeerFault(f"chunk size header {size_text[:30]!r} is not a byte count")
    chunk_size = int(size_text)
    if not MIN_BLOCK_SIZE <= chunk_size <= MAX_BLOCK_SIZE:
        raise _PeerFault(f"chunk size {chunk_size} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    sums_text = headers.get(CHUNK_CHECKSUMS_HEADER.decode(), "")
    try:
        chunk_sums = bytes.fromhex(sums_text)
    except ValueError:
        raise _PeerFault(f"chunk checksums header is not hex: {sums_text[:40]!r}") from None
    expected = chunk_count(length, chunk_size)
    if len(chunk_sums) != expected * CHUNK_CHECKSUM_LEN:
        raise _PeerFault(
            f"{len(chunk_sums) // CHUNK_CHECKSUM_LEN} chunk checksums, expected {expected}"
        )
    return chunk_size, chunk_sums


def _message(address: str, req: BlockRequest, reason: str) -> str:
    return (
        f"peer {address}: block {req.index} of key {req.key!r} in dataset {req.dataset!r}: {reason}"
    )


def _describe(err: Exception) -> str:
    """``httpx`` errors often have an empty ``str()``; the class name alone still says why."""
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
