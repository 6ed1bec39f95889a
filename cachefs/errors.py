"""The error vocabulary shared by every layer.

Lower layers raise these; exactly one place (``cachefs.fs.fuse_ops``) turns them into errno
values for the kernel, and the CLI/control API turn them into messages. Every message must
name what failed (dataset, key) and why, and must never contain credentials.
"""

from __future__ import annotations


class CachefsError(Exception):
    """Base class: ``str(err)`` is a complete, user-facing sentence."""


# --- configuration / user input -------------------------------------------------------------


class ConfigError(CachefsError):
    """Bad user input: a malformed URI, size, option or dataset name."""


class InvalidURI(ConfigError):
    pass


class DatasetNotFound(CachefsError):
    pass


class DatasetExists(CachefsError):
    pass


class PreloadNotFound(CachefsError):
    """No preload job of that dataset (single-node preload; the coordinator has its own)."""


class EmptySource(ConfigError):
    """A new dataset's source lists no file it can serve: most likely a mistyped prefix. Adding
    it is refused (and nothing is added) unless the user asks for it (``--allow-empty``)."""

    def __init__(self, dataset: str, uri: str, skipped: dict[str, int] | None = None):
        found = "no objects"
        if skipped:
            reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(skipped.items()))
            found = f"no file it can serve (skipped: {reasons})"
        super().__init__(
            f"dataset {dataset!r}: {uri} lists {found}; a mistyped prefix? Nothing added "
            "(--allow-empty adds it anyway)"
        )


# --- object store ---------------------------------------------------------------------------


class StoreError(CachefsError):
    """A failure talking to the object store.

    ``dataset`` and ``key`` say what was being read (either may be empty); ``cause`` is a short
    human description of the underlying problem (never containing secrets).
    """

    #: True if retrying later may succeed (timeouts, 5xx, resets) — used by the retry loop.
    transient = False

    def __init__(self, cause: str, *, dataset: str = "", key: str = "", store: str = ""):
        self.cause = cause
        self.dataset = dataset
        self.key = key
        self.store = store
        super().__init__(self._message())

    def _message(self) -> str:
        where = []
        if self.dataset:
            where.append(f"dataset {self.dataset!r}")
        if self.store:
            where.append(self.store)
        if self.key:
            where.append(f"key {self.key!r}")
        prefix = ", ".join(where)
        return f"{prefix}: {self.cause}" if prefix else self.cause

    def with_context(self, *, dataset: str | None = None, key: str | None = None) -> StoreError:
        """Return a copy of this error naming the dataset/key (for errors raised deep down)."""
        err = type(self)(
            self.cause,
            dataset=self.dataset if dataset is None else dataset,
            key=self.key if key is None else key,
            store=self.store,
        )
        err.__cause__ = self.__cause__
        return err


class StoreAuthError(StoreError):
    """Credentials missing, wrong or not allowed (HTTP 401/403)."""


class StoreBucketNotFound(StoreError):
    """The bucket (or the local root directory) does not exist."""


class ObjectNotFound(StoreError):
    """The object vanished from the store after the snapshot was taken."""


class ObjectChanged(StoreError):
    """The object's etag no longer matches the snapshot: refresh the dataset to see new data."""


class StoreUnavailable(StoreError):
    """Timeouts, connection resets, 5xx/SlowDown — still failing after all retries."""

    transient = True


class StoreThrottled(StoreUnavailable):
    """The store asked us to slow down (HTTP 503 or 429, SlowDown and kin): retried like any
    transient failure, and a signal to the adaptive concurrency limits to send fewer requests
    at once (cachefs/store/concurrency.py)."""


class StoreIOError(StoreError):
    """Any other store failure (unexpected response, short read after retries)."""


# --- filesystem -----------------------------------------------------------------------------


class FsError(CachefsError):
    pass


class PathNotFound(FsError):
    pass


class NotADirectory(FsError):
    pass


class IsADirectory(FsError):
    pass


class ReadOnly(FsError):
    """Any attempt to modify the mount."""


class BadFileHandle(FsError):
    pass


class NotSupported(FsError):
    """An operation the mount does not implement: extended attributes, and OPEN in no-open
    mode (cachefs/fs/fuse_ops.py). The kernel remembers the answer and stops asking."""


class NotASymlink(FsError):
    """readlink of an entry that is not a symbolic link (the mount has none)."""


# --- cache ----------------------------------------------------------------------------------


class CorruptBlock(CachefsError):
    """A cached block failed its checksum or size check (it is dropped, never served)."""
