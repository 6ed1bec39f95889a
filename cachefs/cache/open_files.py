"""Open file descriptors of recently read block files, so that reading a hot block (a 4 MiB
block is read in up to 32 FUSE requests) costs an fstat and a pread instead of open + fstat +
pread + close.

A block's descriptor is kept when it is read again soon: within the next ``limit`` to
``2 * limit`` first reads of other blocks (the reads of one 4 MiB block by a sequential reader
come close together, even with many readers). Most blocks are read once in a while (a small
file is one block read in one request, once per epoch): keeping those would only push the hot
ones out, and cost their single read the table's bookkeeping (measured: ~3 µs more than a plain
open and close on this machine, where a lock round trip alone is ~0.4 µs).

Why a kept descriptor never reads wrong bytes, and never keeps a removed block's memory:

* A block file never changes after it is renamed into place, and its name (key and file id,
  unique per admission: ``tier.py``) is never used again by this process, so a kept descriptor
  always reads the file the index entry names. Damage on disk is still found: :meth:`open`
  returns a fresh ``fstat`` for the size check, and every read checks the chunks it reads.
* Removing a block unlinks its file and then calls :meth:`OpenBlockFiles.forget`, which closes
  its descriptor, so tmpfs frees the memory. A descriptor opened while that removal runs may
  enter the table after the ``forget``; so :meth:`open` ``fstat``s the descriptor *after* it is
  in the table and fails (forgetting it) if the file has no link left. Either the unlink came
  before that ``fstat`` (then :meth:`open` forgets it), or after it — then the removal's own
  ``forget`` comes later still and closes it. The same check catches a file deleted behind the
  index's back, which a kept descriptor would otherwise go on reading.
* A descriptor is closed only when no read is using it: a ``forget`` (or the bound pushing it
  out) while a read holds it only marks it, and the read's ``release`` closes it. Closing it
  under a running ``pread`` would let ``open()`` in another thread reuse the number, and the
  ``pread`` read another file's bytes.

Reads come from the trio loop (RAM tier) and from worker threads (SSD tier, preloads, peers);
removals from worker threads. One lock guards the table; no system call runs under it. A read
is one call to :meth:`open` and one to :meth:`release`, which take the lock only for a kept
descriptor: every Python call and lock costs on this path.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable

_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


class OpenBlockFile:
    """One open block file; ``users`` reads hold it, ``closing`` once it left the table."""

    __slots__ = ("closing", "fd", "users")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 1
        self.closing = False


class OpenBlockFiles:
    """A least-recently-used table of at most ``limit`` open block files, by file id.
    ``path_of(key, file id)`` names a block's file."""

    def __init__(self, limit: int, path_of: Callable[[bytes, int], str]) -> None:
        self.limit = limit
        self._path_of = path_of
        self._lock = threading.Lock()
        self._files: OrderedDict[int, OpenBlockFile] = OrderedDict()
        # File ids read once recently, in two generations of up to ``limit`` each. Single set
        # operations are atomic under the GIL, and a race only changes which read keeps a
        # descriptor: no lock.
        self._read_once: set[int] = set()
        self._read_once_before: set[int] = set()

    def __len__(self) -> int:
        return len(self._files)

    def open(self, raw: bytes, file_id: int) -> tuple[int, os.stat_result, OpenBlockFile | None]:
        """A descriptor of the block file for one read, its ``fstat``, and the table entry
        that holds it (None: the descriptor is this read's alone). Pass the descriptor and the
        entry to :meth:`release` when done. Raises FileNotFoundError if the file is not there
        or no longer linked."""
        kept = self._files.get(file_id)  # a peek without the lock; confirmed under it
        if kept is not None:
            with self._lock:
                kept = self._files.get(file_id)
                if kept is not None:
                    self._files.move_to_end(file_id)
                    kept.users += 1
        if kept is not None:
            fd = kept.fd
        else:
            fd = os.open(self._path_of(raw, file_id), _READ_FLAGS)
            if self._read_recently(file_id):
                kept = self._keep(file_id, fd)
                fd = kept.fd
        stat = os.fstat(fd)  # after _keep(): see the module docstring
        if stat.st_nlink == 0:
            if kept is not None:
                self.forget(file_id)
            self.release(fd, kept)
            raise FileNotFoundError(f"block file {file_id:x} of {raw.hex()} was removed")
        return fd, stat, kept

    def release(self, fd: int, kept: OpenBlockFile | None) -> None:
        if kept is None:
            os.close(fd)
            return
        with self._lock:
            kept.users -= 1
            close_now = kept.closing and kept.users == 0
        if close_now:
            os.close(fd)

    def forget(self, file_id: int) -> None:
        """Close the descriptor of a block whose file was just unlinked (or mark it, for the
        last read using it to close)."""
        with self._lock:
            kept = self._files.pop(file_id, None)
            if kept is None:
                return
            kept.closing = True
            close_now = kept.users == 0
        if close_now:
            os.close(kept.fd)

    def close(self) -> None:
        """Close every kept descriptor (those in use when their read releases them)."""
        with self._lock:
            dropped = list(self._files.values())
            self._files.clear()
            unused = []
            for kept in dropped:
                kept.closing = True
                if kept.users == 0:
                    unused.append(kept.fd)
        for fd in unused:
            os.close(fd)

    def _read_recently(self, file_id: int) -> bool:
        """Whether ``file_id`` was opened without being kept recently; else note that it was."""
        if file_id in self._read_once or file_id in self._read_once_before:
            return True
        if len(self._read_once) >= self.limit:
            self._read_once_before, self._read_once = self._read_once, set()
        self._read_once.add(file_id)
        return False

    def _keep(self, file_id: int, fd: int) -> OpenBlockFile:
        """Put a descriptor just opened into the table, held once; the least recently used
        ones beyond the limit leave it. If another thread kept the same file meanwhile, that
        one is held instead and ``fd`` closed."""
        pushed_out = []
        with self._lock:
            kept = self._files.get(file_id)
            if kept is not None:
                kept.users += 1
            else:
                new = self._files[file_id] = OpenBlockFile(fd)
                while len(self._files) > self.limit:
                    _file_id, oldest = self._files.popitem(last=False)
                    oldest.closing = True  # with limit 0 that is ``new``: held by this read
                    if oldest.users == 0:
                        pushed_out.append(oldest.fd)
        for unused_fd in pushed_out:
            os.close(unused_fd)
        if kept is not None:
            os.close(fd)
            return kept
        return new
