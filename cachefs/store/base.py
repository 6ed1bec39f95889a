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
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str  # relative to the dataset prefix; may be hostile (validated by cachefs.meta)
    size: int
    etag: str  # opaque version tag (quotes stripped); local store: f"{mtime_ns:x}-{size:x}"
    mtime_ns: int  # last-modified, nanoseconds since the epoch


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Jittered exponential backoff for transient failures (5xx, SlowDown, resets, timeouts)."""

    attempts: int = 5  # total tries, including the first
    base_delay_s: float = 0.1  # first backoff; doubles each try, full jitter
    max_delay_s: float = 5.0
    deadline_s: float = 60.0  # give up once this much time has passed since the first try


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
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
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
        If-Match). A short body is retried, then raised as StoreIOError — never returned."""
        ...

    def close(self) -> None: ...
