"""What the peer server and client agree on: the block request and the errors (the bytes on
the wire are in cachefs/peer/wire.py)."""

from __future__ import annotations

from dataclasses import dataclass

from cachefs.errors import CachefsError

MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = 64 << 20


class PeerError(CachefsError):
    """A failed peer read; ``str()`` names the peer address and the reason."""


class PeerUnavailable(PeerError):
    """The peer is cooling down after a recent failure (raised without any network I/O)."""


class PeerRefused(PeerError):
    """The peer answered but declined (not its file, not cached for a cached-only request, its
    own store fetch failed, overloaded): it is healthy. ``status`` is the HTTP status."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class NotCached(LookupError):
    """Raised by a block server's ``serve_block`` for a cached-only request whose block is not
    in its cache (answered 404 "not cached")."""


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """Block ``index`` (``[index*block_size, ...)``) of one object version.

    Construction rejects impossible requests (``ValueError``), so a request that exists always
    has ``length > 0`` and the server can answer 400 from the message.

    ``cached_only``: answer from the peer's cache or not at all (404 "not cached"); the peer
    never reads the store for it. Used to copy blocks from the nodes that held a copy before
    (a clone's fill, a scale hand-off), where a store read on their side would only move the
    store traffic, not save it.
    """

    dataset: str
    key: str
    etag: str
    size: int
    index: int
    block_size: int
    cached_only: bool = False

    def __post_init__(self) -> None:
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block size {self.block_size} outside [4 KiB, 64 MiB]")
        if self.size < 0 or self.index < 0:
            raise ValueError("size and index must not be negative")
        if self.index * self.block_size >= self.size:
            raise ValueError(f"block {self.index} is past the end of a {self.size}-byte object")

    @property
    def length(self) -> int:
        """Bytes in this block: a full block except for the object's last one."""
        return min(self.block_size, self.size - self.index * self.block_size)


@dataclass(frozen=True, slots=True)
class NativeAnswers:
    """What an owner's native table answered of the request frames it was handed
    (cachefs_fast_read.c, "peer answers"): ``consumed`` bytes of whole frames, ``answered``
    answers sent; ``partial``: None, or the last answer's ``(head, fd, length, sent)`` when the
    socket did not take it whole (the caller sends the rest from ``fd`` and closes it)."""

    consumed: int
    answered: int
    partial: tuple[bytes, int, int, int] | None
