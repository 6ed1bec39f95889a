"""The coordinator's durable state: a small key-value store, LMDB by default or etcd.

``open_state_store(location)`` picks the backend from the ``--state`` location:

- ``lmdb:///abs/path`` or a plain filesystem path: an LMDB environment in that directory (one
  coordinator);
- ``etcd://host:port[,host:port...]`` (or ``etcd+http://...``): an etcd cluster through its
  HTTP gateway, for a replicated coordinator.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from cachefs.errors import ConfigError

from .base import StateStore, StateStoreError
from .etcd_store import EtcdStateStore
from .lmdb_store import LmdbStateStore

__all__ = [
    "EtcdStateStore",
    "LmdbStateStore",
    "StateStore",
    "StateStoreError",
    "open_state_store",
]

_ETCD_SCHEMES = ("etcd://", "etcd+http://")
_ETCD_DEFAULT_PORT = 2379
_LMDB_SCHEME = "lmdb://"


def open_state_store(location: str) -> StateStore:
    """The state store at ``location`` (see the module docstring); ConfigError if malformed."""
    for scheme in _ETCD_SCHEMES:
        if location.startswith(scheme):
            return EtcdStateStore(_etcd_endpoints(location[len(scheme) :]))
    if location.startswith(_LMDB_SCHEME):
        path = location[len(_LMDB_SCHEME) :]
        if not path.startswith("/"):
            raise ConfigError(
                f"state store {location!r}: an lmdb location needs an absolute path, "
                "as in lmdb:///var/lib/cachefs/state"
            )
        return LmdbStateStore(path)
    if not location or "://" in location:
        raise ConfigError(
            f"state store {location!r}: expected a directory, lmdb:///abs/path or "
            "etcd://host:port[,host:port...]"
        )
    return LmdbStateStore(os.path.abspath(location))


def _etcd_endpoints(members: str) -> list[str]:
    """``http://host:port`` for each of the comma-separated ``host[:port]`` (port 2379 if
    left out)."""
    endpoints = []
    for member in members.rstrip("/").split(","):
        parts = urlsplit(f"//{member}")
        try:
            port = _ETCD_DEFAULT_PORT if parts.port is None else parts.port
        except ValueError:  # not a number, or out of range
            port = 0
        if not parts.hostname or not port or "@" in parts.netloc or parts.path:
            # The member is not echoed: it could hold a user:password.
            raise ConfigError(
                "etcd state store: each member must be host[:port], as in "
                "etcd://10.0.0.1:2379,10.0.0.2:2379"
            )
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        endpoints.append(f"http://{host}:{port}")
    return endpoints
