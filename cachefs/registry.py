"""The embedded dataset registry: which datasets this worker serves (durable, in LMDB).

In single-node mode (`cachefs up`) this is the whole "coordinator". It stores DatasetSpecs
(credential *references* only) and hands out inode-space slots that are never reused.
"""

from __future__ import annotations

import json
import os
import time

import lmdb

from cachefs.errors import DatasetExists, DatasetNotFound
from cachefs.protocol import DatasetSpec, check_dataset_name

_MAX_SLOT = (1 << 15) - 1


class Registry:
    def __init__(self, path: str | os.PathLike[str]):
        os.makedirs(path, mode=0o700, exist_ok=True)
        self._env = lmdb.open(str(path), map_size=64 << 20, max_dbs=2, subdir=True)
        self._datasets = self._env.open_db(b"datasets")
        self._meta = self._env.open_db(b"meta")

    def close(self) -> None:
        self._env.close()

    def list(self) -> list[DatasetSpec]:
        with self._env.begin(db=self._datasets) as txn:
            return [DatasetSpec.from_json(json.loads(value)) for _, value in txn.cursor()]

    def get(self, name: str) -> DatasetSpec:
        with self._env.begin(db=self._datasets) as txn:
            raw = txn.get(name.encode())
        if raw is None:
            raise DatasetNotFound(f"no dataset named {name!r}")
        return DatasetSpec.from_json(json.loads(raw))

    def add(self, spec: DatasetSpec) -> DatasetSpec:
        """Store a new dataset, assigning it a fresh slot. The spec is returned as stored."""
        check_dataset_name(spec.name)
        with self._env.begin(write=True) as txn:
            if txn.get(spec.name.encode(), db=self._datasets) is not None:
                raise DatasetExists(f"dataset {spec.name!r} already exists")
            last_slot = int(txn.get(b"last_slot", b"0", db=self._meta))
            if last_slot >= _MAX_SLOT:
                raise DatasetExists("no dataset slots left in this state directory")
            spec.slot = last_slot + 1
            spec.created_at = spec.created_at or time.time()
            txn.put(b"last_slot", str(spec.slot).encode(), db=self._meta)
            txn.put(spec.name.encode(), json.dumps(spec.to_json()).encode(), db=self._datasets)
        return spec

    def update(self, spec: DatasetSpec) -> None:
        with self._env.begin(write=True, db=self._datasets) as txn:
            if txn.get(spec.name.encode()) is None:
                raise DatasetNotFound(f"no dataset named {spec.name!r}")
            txn.put(spec.name.encode(), json.dumps(spec.to_json()).encode())

    def remove(self, name: str) -> DatasetSpec:
        spec = self.get(name)
        with self._env.begin(write=True, db=self._datasets) as txn:
            txn.delete(name.encode())
        return spec
