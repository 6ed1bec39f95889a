"""What the peer server and client agree on: the block request, its wire form, the errors.

The query encoding lives here, next to the request, so both sides cannot drift apart. Object keys
may hold any character, including surrogate-escaped non-UTF-8 bytes that no URL encoding can
carry, so the key travels as unpadded base64url of its raw bytes.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from cachefs.errors import CachefsError

BLOCKS_PATH = "/v1/blocks"
# A block's answer carries its chunk checksums (cache/base.py ``chunk_checksums``): the chunk
# size in bytes (decimal), and each chunk's xxh3_64 as 16 hex digits, concatenated in order.
CHUNK_SIZE_HEADER = b"x-cachefs-chunk-size"
CHUNK_CHECKSUMS_HEADER = b"x-cachefs-chunk-checksums"
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

    def to_params(self) -> dict[str, str]:
        """The query parameters of ``GET /v1/blocks``."""
        raw_key = self.key.encode("utf-8", "surrogateescape")
        params = {
            "d": self.dataset,
            "k": base64.urlsafe_b64encode(raw_key).rstrip(b"=").decode("ascii"),
            "e": self.etag,
            "s": str(self.size),
            "i": str(self.index),
            "b": str(self.block_size),
        }
        if self.cached_only:  # absent otherwise: the form older workers send and expect
            params["c"] = "1"
        return params

    @classmethod
    def from_params(cls, params: dict[str, str]) -> BlockRequest:
        """Parse :meth:`to_params` output; ``ValueError`` with a short reason if malformed."""
        try:
            dataset, k, etag = params["d"], params["k"], params["e"]
            size, index, block_size = (_natural(params[name]) for name in "sib")
        except KeyError as err:
            raise ValueError(f"missing parameter {err.args[0]!r}") from None
        try:
            raw_key = base64.b64decode(k + "=" * (-len(k) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("k is not unpadded base64url") from None
        key = raw_key.decode("utf-8", "surrogateescape")
        cached_only = params.get("c", "0")
        if cached_only not in ("0", "1"):
            raise ValueError(f"c must be 0 or 1, not {cached_only[:30]!r}")
        return cls(dataset, key, etag, size, index, block_size, cached_only == "1")


def _natural(text: str) -> int:
    """A non-negative decimal; stricter than ``int()``, which takes signs, spaces and ``_``."""
    if not (text.isascii() and text.isdigit()) or len(text) > 20:
        raise ValueError(f"{text[:30]!r} is not a non-negative integer")
    return int(text)
