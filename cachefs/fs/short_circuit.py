"""Short-circuit resolve: a path of a dataset to its blocks and, for the blocks cached on this
node, the files that hold them, so that a same-node reader (tf_dataset) reads those files
directly instead of through FUSE. Served by the control API (``GET /v1/resolve``, ``POST
/v1/datasets/{name}/resolve``).

Block files are immutable once written, but a block can be evicted between an answer and the
read: a reader that finds a file gone (ENOENT) reads that block through the mount instead.
"""

from __future__ import annotations

import os
from typing import Any

import trio

from cachefs.cache.base import BlockCache, BlockFile
from cachefs.errors import ConfigError, DatasetNotFound, PathNotFound
from cachefs.fs.core import SLOT_SHIFT, FileSystem, MountedDataset
from cachefs.fs.layout import file_blocks

#: Paths one batch-resolve or prefetch request may name (clients send batches of this or less).
MAX_PATHS_PER_REQUEST = 10_000
# Paths resolved between two trio checkpoints: a batch of thousands must not hold up FUSE.
_RESOLVE_SLICE = 256


class ShortCircuit:
    def __init__(self, fs: FileSystem, cache: BlockCache, mountpoint: str) -> None:
        self._fs = fs
        self._cache = cache
        self._mountpoint = mountpoint

    def _dataset(self, name: str) -> MountedDataset:
        mounted = self._fs.dataset(name)
        if mounted is None:
            raise DatasetNotFound(f"no dataset named {name!r}")
        return mounted

    def resolve(self, dataset: str, path: str) -> dict[str, Any]:
        """One file: its size, etag, inode, and per block its offset, length and, when cached
        here, its file and the xxh3_64 it was admitted with."""
        mounted = self._dataset(dataset)
        entry = mounted.snapshot.resolve(path.strip("/"))
        if entry is None:
            raise PathNotFound(f"{path!r} not found in dataset {dataset!r}")
        if entry.is_dir:
            raise PathNotFound(f"{path!r} is a directory")
        blocks = []
        for block in file_blocks(mounted.source, entry):
            cached = self._cache.block_file(block.key)
            blocks.append(
                {
                    "index": block.index,
                    "offset": block.offset,
                    "length": block.length,
                    "file": None if cached is None else cached.path,
                    "checksum": None if cached is None else checksum_hex(cached),
                }
            )
        return {
            "dataset": dataset,
            "path": path,
            "size": entry.size,
            "etag": entry.etag,
            "inode": mounted.slot << SLOT_SHIFT | entry.ino,
            "block_size": mounted.source.block_size,
            "blocks": blocks,
            "mount_path": os.path.join(self._mountpoint, dataset, path.strip("/")),
        }

    async def resolve_many(self, dataset: str, paths: list[str]) -> dict[str, Any]:
        """Batch resolve for short-circuit readers (tf_dataset): per path its size, etag and
        blocks, each block either ``[file, length, checksum]`` — cached on this node: the file,
        the length and the xxh3_64 (16 hex digits) it was admitted with, which the reader
        verifies before trusting the bytes — or None (not cached here: read it through the
        mount). A path that is missing or a directory gets ``"error"`` instead.

        Answers describe the snapshot current when each path was looked up: a refresh during
        the call can make later paths resolve against the new one, each file consistently."""
        if len(paths) > MAX_PATHS_PER_REQUEST:
            raise ConfigError(
                f"{len(paths)} paths in one resolve request; send at most "
                f"{MAX_PATHS_PER_REQUEST} per request"
            )
        files: list[dict[str, Any]] = []
        mounted = None
        for start in range(0, len(paths), _RESOLVE_SLICE):
            if start:
                await trio.sleep(0)  # let FUSE requests in between slices
            mounted = self._dataset(dataset)  # again after each checkpoint: a refresh swaps it
            batch = paths[start : start + _RESOLVE_SLICE]
            entries = mounted.snapshot.resolve_many([path.strip("/") for path in batch])
            for path, entry in zip(batch, entries, strict=True):
                if entry is None or entry.is_dir:
                    files.append({"path": path, "error": "not a file" if entry else "not found"})
                    continue
                blocks: list[list[Any] | None] = []
                for block in file_blocks(mounted.source, entry):
                    cached = self._cache.block_file(block.key)
                    blocks.append(
                        None if cached is None else [cached.path, cached.size, checksum_hex(cached)]
                    )
                files.append(
                    {"path": path, "size": entry.size, "etag": entry.etag, "blocks": blocks}
                )
        if mounted is None:  # no paths: still say whether the dataset exists
            mounted = self._dataset(dataset)
        return {
            "dataset": dataset,
            "mount_root": os.path.join(self._mountpoint, dataset),
            "block_size": mounted.source.block_size,
            # The snapshot the last paths were looked up in (a new name after every refresh;
            # the earlier paths of this answer were looked up in it or an older one): a reader
            # keeping layouts between epochs asks again when it changes.
            "snapshot": os.path.basename(mounted.snapshot.path),
            "files": files,
        }


def checksum_hex(block: BlockFile) -> str:
    # Hex, not a JSON number: 64-bit values lose precision in many JSON readers.
    return f"{block.checksum:016x}"
