"""SEAM A — the object-store interface.

Everything above this module sees only :class:`ObjectStore`; SDK types and SDK exceptions never
leak upward. Implementations are *blocking* (boto3 / oss2 / os are blocking); callers on the trio
loop must use ``trio.to_thread.run_sync`` with a CapacityLimiter.

Keys passed to and returned from a store are *relative to the dataset's prefix*: for
``s3://bucket/imagenet/`` the object ``imagenet/train/a.jpg`` has key ``train/a.jpg``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from stat import S_ISREG
from typing import Protocol

from cachefs.protocol import DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_STORE_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the dataset prefix; may be hostile (validated by cachefs.meta)
    size: int
    etag: str  # opaque version tag (quotes stripped); local store: f"{mtime_ns:x}-{size:x}"
    mtime_ns: int  # last-modified, nanoseconds since the epoch
    # Local directories only (None from object stores, which have no POSIX owner): the entry's
    # st_mode (file type and permission bits), owner and group, which the mount keeps. A local
    # store lists directories as markers ("a/b/", size 0; "" for its root) and also what it
    # cannot serve (a symlink leading elsewhere, a FIFO, socket or device) with that type, so
    # the snapshot builder shows empty directories and counts what it skipped.
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None


def names_a_file(info: ObjectInfo) -> bool:
    """Whether a listed entry can be a file of the mount: not a directory marker (a key ending
    in "/", or "" for the prefix itself) nor a local entry of another type (symlink, FIFO…)."""
    key = info.key
    return bool(key) and not key.endswith("/") and (info.mode is None or S_ISREG(info.mode))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long one store request may take, and how its tries are spread.

    A request (a GET of a range, a HEAD, a LIST page) gets ``deadline_s`` in all. Within it,
    transient failures (5xx, SlowDown, resets, timeouts) are retried with jittered exponential
    backoff, and reads are *hedged* (:class:`cachefs.store.retry.HedgedReads`): a try that has
    not started answering after :attr:`hedge_after_s` gets a twin, and one still silent after
    :attr:`attempt_timeout_s` is abandoned and replaced — so a stalled store costs a reader
    seconds, not the whole budget.
    """

    attempts: int = 10  # tries in all, hedges and replacements included
    base_delay_s: float = 0.1  # first backoff after a failure; doubles each time, full jitter
    max_delay_s: float = 5.0
    deadline_s: float = DEFAULT_STORE_TIMEOUT_S  # the whole budget, from the first try
    # One try's connect, wait for the response headers, and longest pause mid-body:
    first_byte_timeout_s: float = DEFAULT_FIRST_BYTE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be at least 1, not {self.attempts}")
        for name in ("deadline_s", "first_byte_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")

    @property
    def attempt_timeout_s(self) -> float:
        """A try's first-byte (and mid-body stall) timeout: never longer than the budget."""
        return min(self.first_byte_timeout_s, self.deadline_s)

    @property
    def hedge_after_s(self) -> float:
        """A read silent this long gets a second try in parallel (the first keeps its chance
        until :attr:`attempt_timeout_s`). Half the timeout: late enough that a healthy store
        (first bytes in milliseconds) is never asked twice, early enough to halve a stall."""
        return self.attempt_timeout_s / 2

    @property
    def listing_timeout_s(self) -> float:
        """A LIST page's read timeout. Listings are not hedged, and a store may legitimately
        think for seconds over a page of a huge bucket: half the budget, so two tries fit."""
        return max(self.attempt_timeout_s, self.deadline_s / 2)


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Everything needed to open a store. Holds *references* to credentials, never secrets."""

    uri: str  # s3://bucket/prefix, oss://bucket/prefix, file:///dir
    endpoint: str | None = None  # e.g. http://127.0.0.1:9000 (S3) or OSS endpoint URL
    region: str | None = None
    path_style: bool | None = None  # S3 addressing; None = path style iff endpoint is set
    profile: str | None = None  # AWS shared-config profile name
    credentials_file: str | None = None  # S3: AWS credentials ini; OSS: ini with access_key_id/
    # access_key_secret (section [default])
    retry: RetryPolicy = field(default_factory=RetryPolicy)  # timeouts, retries and hedging
    dataset: str = ""  # for error messages only


class ObjectStore(Protocol):
    #: Human-readable location with no secrets, e.g. "s3://bucket/prefix at http://127.0.0.1:9000".
    description: str

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """All objects under ``prefix`` (relative), paginated internally, in ascending order
        of the UTF-8 bytes of the key. Directory-marker objects (keys ending in "/") are yielded
        like any other; the snapshot builder decides what they mean."""
        ...

    def head(self, key: str) -> ObjectInfo:
        """Metadata of one object; raises ObjectNotFound if it does not exist."""
        ...

    def get_range(self, key: str, offset: int, length: int, *, etag: str | None = None) -> bytes:
        """Exactly ``length`` bytes starting at ``offset`` (the caller never asks past the end).
        If ``etag`` is given and the object's etag differs, raise ObjectChanged (S3/OSS send
        If-Match on every try, hedges included: bytes of two versions are never mixed). A short
        body is retried, then raised as StoreIOError — never returned."""
        ...

    def prepare_reads(self) -> None:
        """Set up now what the first :meth:`get_range` would (a client and its signing scope),
        so that the first read of a dataset just added does not wait for it. Never raises: a
        failure is left for the reads, which meet it with their usual error."""
        ...

    def close(self) -> None: ...
