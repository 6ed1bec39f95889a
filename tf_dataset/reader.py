"""The short-circuit reader: files of a cachefs dataset read straight from this node's block
files when they are cached here, through the FUSE mount otherwise. No TensorFlow here.

A same-node reader asks the worker (one batch request per many files, ``resolve``) where each
file's blocks are. A block cached on this node comes with its file in a tier directory
(``/dev/shm/cachefs-…/``), its length and the xxh3_64 it was admitted with; the reader reads
that file itself, skipping FUSE (one open+read per block instead of a FUSE open, read and
release through the worker's single Python thread).

Never a wrong byte:

* every block read directly is checked against the length and xxh3_64 from the worker; a block
  file can be evicted, or replaced by a new admission under a new name, at any time after the
  answer, so a missing file (ENOENT), a short one, or a checksum mismatch is expected, and
  makes the reader fall back to the mount for that file (counted);
* a file is read either entirely from block files (all blocks of the version the worker
  resolved, whose keys name that version) or entirely through the mount (one open of one
  version): never a mix, which after a dataset refresh could splice two versions;
* anything that goes wrong talking to the worker (not running, refused) means "read through
  the mount": the reader never fails because the fast path is unavailable.

Block files are mode 0600 (the worker's user): a reader running as another user always falls
back to the mount (counted as ``fallback_files``).

:func:`read_chunk` is the Python reference of the native kernel ``CachefsReadFiles``
(``native/cachefs_ops.cc``) that tf_dataset's pipeline reads with when it is built: the same
arguments, the same rules, the same results.
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from cachefs.client import ControlClient, ControlError, WorkerNotRunning

log = logging.getLogger(__name__)

#: Paths per batch-resolve request (the worker takes at most 10,000).
RESOLVE_BATCH = 2048


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One block cached on this node: its file, length and admitted xxh3_64."""

    file: str
    length: int
    checksum: int


@dataclass(frozen=True, slots=True)
class FileLayout:
    """Where one file's bytes are: per block a :class:`CachedBlock` or None (not cached here).
    ``snapshot``: the worker's name for the dataset snapshot the file was resolved in (a
    refresh makes a new one: layouts of an older snapshot may name an older version)."""

    path: str
    size: int
    blocks: tuple[CachedBlock | None, ...]
    snapshot: str | None = None

    @property
    def local(self) -> bool:
        """Every block is cached on this node (an empty file trivially is)."""
        return all(block is not None for block in self.blocks)


@dataclass
class ReaderStats:
    short_circuit_files: int = 0  # read entirely from block files
    mount_files: int = 0  # read through the mount (not cached here, or no layout)
    fallback_files: int = 0  # resolved as local, but a block file failed: read via the mount
    short_circuit_bytes: int = 0
    mount_bytes: int = 0
    resolve_errors: int = 0  # batch resolves that failed (those files went through the mount)
    hints_sent: int = 0  # prefetch hints the worker took
    hint_errors: int = 0  # hints that failed (ignored: a hint is only an optimisation)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        with self._lock:  # read from several tf.data threads at once
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {
                name: getattr(self, name)
                for name in self.__dataclass_fields__
                if not name.startswith("_")
            }


def parse_layouts(answer: dict) -> list[FileLayout | None]:
    """The worker's batch-resolve answer as layouts (None for a path it could not resolve)."""
    layouts: list[FileLayout | None] = []
    snapshot = answer.get("snapshot")
    for item in answer["files"]:
        if "error" in item:
            layouts.append(None)
            continue
        blocks = tuple(
            None if block is None else CachedBlock(block[0], int(block[1]), int(block[2], 16))
            for block in item["blocks"]
        )
        layouts.append(FileLayout(item["path"], int(item["size"]), blocks, snapshot))
    return layouts


def read_block_file(block: CachedBlock) -> bytes | None:
    """A cached block's bytes if its file is there and its first ``length`` bytes match the
    xxh3_64 the worker gave; None otherwise (evicted, replaced, unreadable, short or damaged).
    Bytes past ``length`` are not read: they cannot change what is returned."""
    try:
        fd = os.open(block.file, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, block.length)
        while len(data) < block.length:  # a short read: more to come, or the file is short
            more = os.read(fd, block.length - len(data))
            if not more:
                return None
            data += more
    except OSError:
        return None
    finally:
        os.close(fd)
    if xxhash.xxh3_64_intdigest(data) != block.checksum:
        return None
    return data


def read_mount_file(path: str | bytes) -> bytes:
    with open(path, "rb", buffering=0) as f:
        return f.readall()


def read_blocks(blocks: Sequence[CachedBlock]) -> bytes | None:
    """A file from its block files, or None if any block file does not verify."""
    if len(blocks) == 1:  # the common case: a file smaller than a block
        return read_block_file(blocks[0])
    parts = []
    for block in blocks:
        data = read_block_file(block)
        if data is None:
            return None
        parts.append(data)
    return b"".join(parts)


def read_file(mount_path: str | bytes, blocks: Sequence[CachedBlock] | None) -> tuple[bytes, bool]:
    """One file: from ``blocks`` (all of its blocks, cached here) when given and each one
    verifies, else wholly through the mount. Returns the bytes and whether blocks were given
    but failed (the caller should forget them)."""
    if blocks is not None:
        data = read_blocks(blocks)
        if data is not None:
            return data, False
    return read_mount_file(mount_path), blocks is not None


def mount_path_of(mount_root: str | bytes, name: str | bytes) -> str | bytes:
    """``<mount root>/<name>``; leading slashes of ``name`` are ignored."""
    sep = b"/" if isinstance(name, bytes) else "/"
    return os.path.join(mount_root, name.lstrip(sep))


def read_chunk(
    mount_root: bytes,
    names: Sequence[bytes],
    local: Sequence[bool],
    block_splits: Sequence[int],
    block_files: Sequence[bytes],
    block_lengths: Sequence[int],
    block_checksums: Sequence[int],
) -> tuple[list[bytes], list[bool]]:
    """The contents of a chunk of files, and per file whether its blocks failed: the Python
    reference of the native kernel ``CachefsReadFiles`` (``native/cachefs_ops.cc``), with the
    same arguments. File ``i`` is read from blocks ``block_splits[i]:block_splits[i + 1]`` of
    the block columns when ``local[i]``, else through the mount. Checksums are xxh3_64 values,
    as signed 64-bit integers (how TensorFlow carries them)."""
    contents, failed = [], []
    for i, name in enumerate(names):
        blocks = None
        if local[i]:
            blocks = [
                CachedBlock(
                    os.fsdecode(block_files[b]),
                    int(block_lengths[b]),
                    int(block_checksums[b]) & 0xFFFF_FFFF_FFFF_FFFF,
                )
                for b in range(int(block_splits[i]), int(block_splits[i + 1]))
            ]
        data, fell_back = read_file(mount_path_of(mount_root, name), blocks)
        contents.append(data)
        failed.append(fell_back)
    return contents, failed


class ShortCircuitReader:
    """Reads files of one dataset, short-circuiting FUSE for blocks cached on this node.

    Thread-safe: tf.data calls :meth:`read` from several threads at once.
    ``state_dir``: the worker's state directory (default: ``$CACHEFS_STATE`` or the default
    of the ``cachefs`` CLI). ``mount_root``: ``<mount>/<dataset>``, asked of the worker when
    not given."""

    def __init__(
        self,
        dataset: str,
        *,
        state_dir: str | None = None,
        mount_root: str | None = None,
        client: ControlClient | None = None,
        hint_timeout_s: float = 5.0,
    ):
        self.dataset = dataset
        self._client = client or ControlClient(state_dir, timeout=60.0)
        self._client_lock = threading.Lock()  # one request at a time on the shared client
        self._hint_timeout_s = hint_timeout_s
        self.mount_root = mount_root or os.path.join(self._client.status()["mount"], dataset)
        self.stats = ReaderStats()

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> ShortCircuitReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def mount_path(self, path: str) -> str:
        return mount_path_of(self.mount_root, path)

    def resolve(self, paths: Sequence[str]) -> list[FileLayout | None]:
        """Layouts of ``paths`` (None where unknown, or where the worker could not answer)."""
        layouts: list[FileLayout | None] = []
        for start in range(0, len(paths), RESOLVE_BATCH):
            batch = list(paths[start : start + RESOLVE_BATCH])
            try:
                with self._client_lock:
                    answer = self._client.resolve_many(self.dataset, batch)
                layouts += parse_layouts(answer)
            except (WorkerNotRunning, ControlError) as exc:
                self.stats.add(resolve_errors=1)
                log.warning("cachefs resolve failed, reading through the mount: %s", exc)
                layouts += [None] * len(batch)
        return layouts

    def snapshot(self) -> str | None:
        """The worker's current snapshot of the dataset (None if it cannot say): layouts of
        another snapshot are out of date."""
        try:
            with self._client_lock:
                return self._client.resolve_many(self.dataset, []).get("snapshot")
        except (WorkerNotRunning, ControlError) as exc:
            log.debug("cachefs snapshot query failed: %s", exc)
            return None

    def hint(self, paths: Sequence[str]) -> bool:
        """Tell the worker these files will be read soon. Never raises: False if it failed."""
        if not paths:
            return True
        try:
            for start in range(0, len(paths), RESOLVE_BATCH):
                batch = list(paths[start : start + RESOLVE_BATCH])
                with self._client_lock:
                    self._client.prefetch(self.dataset, batch, timeout=self._hint_timeout_s)
        except (WorkerNotRunning, ControlError) as exc:
            self.stats.add(hint_errors=1)
            log.debug("cachefs prefetch hint failed (ignored): %s", exc)
            return False
        self.stats.add(hints_sent=1)
        return True

    def read(self, path: str, layout: FileLayout | None = None) -> bytes:
        """The whole file: from its block files when ``layout`` says all are cached here and
        each one verifies, else through the mount."""
        local = layout is not None and layout.local
        data, fell_back = read_file(self.mount_path(path), layout.blocks if local else None)
        if local and not fell_back:
            self.stats.add(short_circuit_files=1, short_circuit_bytes=len(data))
        else:
            self.stats.add(fallback_files=int(fell_back), mount_files=1, mount_bytes=len(data))
        return data


def list_files(dataset: str, pattern: str = "**", *, state_dir: str | None = None) -> list[str]:
    """Paths (relative to the dataset, sorted) of the files of ``dataset`` matching the glob
    ``pattern`` (``**`` spans directories), listed through the mount (the worker answers from
    its snapshot, never from the store)."""
    with ControlClient(state_dir, timeout=60.0) as client:
        root = os.path.join(client.status()["mount"], dataset)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"dataset {dataset!r} is not mounted at {root}")
    matches = glob.glob(pattern, root_dir=root, recursive=True)
    return sorted(path for path in matches if os.path.isfile(os.path.join(root, path)))
