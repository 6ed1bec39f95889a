"""The coordinator's durable state behind one small key-value interface.

Datasets, policies, preload jobs, registered jobs and copies must survive a coordinator restart;
heartbeat data need not (it is rebuilt within seconds). Everything durable goes through
:class:`StateStore`, so the single-machine default (LMDB) and the replicated option (etcd) are
interchangeable and the coordinator's logic is tested once against both.
"""

from __future__ import annotations

from typing import Protocol

from cachefs.errors import CachefsError


class StateStoreError(CachefsError):
    """The state backend failed: unreachable, timed out, refused the request or returned data
    that cannot be decoded. The message names the backend (``where``), never credentials."""


class StateStore(Protocol):
    """A durable map from ``str`` keys to ``bytes`` values.

    Keys are UTF-8 text with "/" as the separator (``"datasets/imagenet"``); values are whatever
    the caller serialized (JSON). Every method blocks and is safe to call from several threads
    at once: the coordinator calls them from ``trio.to_thread``. The atomic methods
    (:meth:`put_if_absent`, :meth:`compare_and_put`) are how concurrent updates stay correct,
    also across several coordinators sharing one etcd. Every failure is a
    :class:`StateStoreError`.
    """

    #: The backend's location for messages, e.g. ``"lmdb:/var/lib/cachefs/state"``.
    where: str

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None if it does not exist."""
        ...

    def put(self, key: str, value: bytes) -> None:
        """Create or overwrite ``key``."""
        ...

    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it existed."""
        ...

    def list(self, prefix: str) -> list[tuple[str, bytes]]:
        """All ``(key, value)`` pairs whose key starts with ``prefix``, sorted by key."""
        ...

    def put_if_absent(self, key: str, value: bytes) -> bool:
        """Atomically create ``key``; False (and nothing written) if it already exists."""
        ...

    def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        """Atomically set ``key`` to ``value`` only if its current value is ``expected``
        (``None``: only if the key does not exist); False (and nothing written) otherwise."""
        ...

    def close(self) -> None:
        """Release the backend's resources; the store is unusable afterwards."""
        ...
