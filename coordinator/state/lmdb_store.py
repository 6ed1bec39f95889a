"""The embedded default state store: one LMDB environment on the coordinator's disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import lmdb

from .base import StateStoreError

T = TypeVar("T")

#: LMDB reserves the map as sparse address space, so a generous size costs no disk: the
#: durable state (datasets, jobs, copies) is megabytes, and a full map would stop all writes.
_MAP_SIZE = 1 << 30
#: One read slot per concurrent reader thread; trio.to_thread runs at most 40 by default.
_MAX_READERS = 126


class LmdbStateStore:
    """A :class:`~coordinator.state.base.StateStore` in the LMDB environment in directory
    ``path`` (created, mode 0o700, if missing).

    Every write commits with a sync to disk, so an acknowledged write survives a crash. Write
    transactions are serialized by LMDB, which is what makes the check-then-write methods
    atomic. Keys are limited to LMDB's 511 bytes.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.path.abspath(path)
        self.where = f"lmdb:{self.path}"
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            self._env = lmdb.open(
                self.path,
                map_size=_MAP_SIZE,
                max_readers=_MAX_READERS,
                max_dbs=0,
                mode=0o600,
                sync=True,
                metasync=True,
            )
        except (OSError, lmdb.Error) as err:
            raise StateStoreError(f"{self.where}: cannot open the state store: {err}") from err

    def get(self, key: str) -> bytes | None:
        return self._run(False, lambda txn: txn.get(key.encode()))

    def put(self, key: str, value: bytes) -> None:
        self._run(True, lambda txn: txn.put(key.encode(), value))

    def delete(self, key: str) -> bool:
        return self._run(True, lambda txn: txn.delete(key.encode()))

    def list(self, prefix: str) -> list[tuple[str, bytes]]:
        start = prefix.encode()

        def scan(txn: lmdb.Transaction[bytes]) -> list[tuple[str, bytes]]:
            cursor = txn.cursor()
            found = []
            if cursor.set_range(start):
                for key, value in cursor:
                    if not key.startswith(start):
                        break
                    found.append((key.decode(), value))
            return found

        # LMDB orders keys bytewise, which for UTF-8 is the order of the str keys.
        return self._run(False, scan)

    def put_if_absent(self, key: str, value: bytes) -> bool:
        return self._run(True, lambda txn: txn.put(key.encode(), value, overwrite=False))

    def compare_and_put(self, key: str, expected: bytes | None, value: bytes) -> bool:
        def swap(txn: lmdb.Transaction[bytes]) -> bool:
            if txn.get(key.encode()) != expected:
                return False
            txn.put(key.encode(), value)
            return True

        return self._run(True, swap)

    def close(self) -> None:
        self._env.close()

    def _run(self, write: bool, body: Callable[[lmdb.Transaction[bytes]], T]) -> T:
        """Run ``body`` in one transaction (committed if it returns), with LMDB's errors
        turned into StateStoreError (a key that is not UTF-8 means the data is corrupt)."""
        try:
            with self._env.begin(write=write) as txn:
                return body(txn)
        except (lmdb.Error, UnicodeDecodeError) as err:
            raise StateStoreError(f"{self.where}: {type(err).__name__}: {err}") from err
