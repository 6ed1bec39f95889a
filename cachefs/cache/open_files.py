"""Open file descriptors of recently read block files, so that reading a hot block costs an
fstat and a pread instead of open + fstat + pread + close.

Why a kept descriptor never reads wrong bytes, and never keeps a removed block's memory:

* A block file never changes after it is renamed into place, and its name (key and file id,
  unique per admission: ``tier.py``) is never used again by this process, so a kept descriptor
  always reads the file the index entry names. (Damage on disk is still found: every read
  checks size and link count, and the checksum as before.)
* Removing a block unlinks its file and then calls :meth:`OpenBlockFiles.forget`, which closes
  its descriptor, so tmpfs frees the memory. A descriptor opened while that removal runs may be
  added after the ``forget``; so every user ``fstat``s the descriptor it got *after* ``add``
  or ``acquire`` returned it, and forgets it if the file has no link left
  (``Tier.open_block``). Either the unlink came before that ``fstat`` (the user forgets it), or
  after it — then the removal's own ``forget`` comes after the ``add`` and closes it.
* A descriptor is closed only when no read is using it: a ``forget`` (or the bound pushing it
  out) while a read holds it only marks it, and the read's ``release`` closes it. Closing it
  under a running ``pread`` would let ``open()`` in another thread reuse the number, and the
  ``pread`` read another file's bytes.

Reads come from the trio loop (RAM tier) and from worker threads (SSD tier, preloads, peers);
removals from worker threads. One lock guards the table; no system call runs under it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict


class OpenBlockFile:
    """One open block file; ``users`` reads hold it, ``closing`` once it left the table."""

    __slots__ = ("closing", "fd", "users")

    def __init__(self, fd: int, *, closing: bool = False) -> None:
        self.fd = fd
        self.users = 1
        self.closing = closing


class OpenBlockFiles:
    """A least-recently-used table of at most ``limit`` open block files, by file id."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._files: OrderedDict[int, OpenBlockFile] = OrderedDict()

    def __len__(self) -> int:
        return len(self._files)

    def acquire(self, file_id: int) -> OpenBlockFile | None:
        """The kept file of ``file_id``, held for one read (pair with :meth:`release`), or
        None if none is kept."""
        with self._lock:
            kept = self._files.get(file_id)
            if kept is not None:
                self._files.move_to_end(file_id)
                kept.users += 1
            return kept

    def add(self, file_id: int, fd: int) -> OpenBlockFile:
        """Keep a descriptor the caller just opened, held for one read (pair with
        :meth:`release`). If another thread kept the same file first, that one is returned
        and ``fd`` closed."""
        with self._lock:
            other = self._files.get(file_id)
            if other is not None:  # another thread opened and kept the same file meanwhile
                other.users += 1
            elif self.limit <= 0:
                return OpenBlockFile(fd, closing=True)  # held for this read only
            else:
                kept = self._files[file_id] = OpenBlockFile(fd)
                pushed_out = self._pop_beyond_limit()
        if other is not None:
            os.close(fd)
            return other
        _close_all(pushed_out)
        return kept

    def release(self, kept: OpenBlockFile) -> None:
        with self._lock:
            kept.users -= 1
            close_now = kept.closing and kept.users == 0
        if close_now:
            os.close(kept.fd)

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
            for kept in dropped:
                kept.closing = True
            unused = [kept for kept in dropped if kept.users == 0]
        _close_all(unused)

    def _pop_beyond_limit(self) -> list[OpenBlockFile]:
        """Take the least recently used files out of the table until it fits the limit;
        return those no read holds (to be closed outside the lock). Caller holds the lock."""
        unused = []
        while len(self._files) > self.limit:
            _file_id, oldest = self._files.popitem(last=False)
            oldest.closing = True
            if oldest.users == 0:
                unused.append(oldest)
        return unused


def _close_all(files: list[OpenBlockFile]) -> None:
    for kept in files:
        os.close(kept.fd)
