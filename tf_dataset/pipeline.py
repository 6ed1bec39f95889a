"""tf.data pipelines over a cachefs dataset: file contents (:func:`dataset`; TFRecord records,
:func:`tf_dataset.records.tfrecord_dataset`, build on what this module shares).

How :func:`dataset` runs. Each new iterator is the next epoch (Keras ``fit`` makes one per
epoch):

1. ``range(windows).scan(...)``: the first window of each iterator takes the next epoch number,
   so two iterators open at once each keep their own epoch.
2. ``map(plan_window)``, kept one window ahead by ``prefetch``: a ``tf.numpy_function`` gives the
   window's files in the epoch's order (``order.py``: a seeded uniform shuffle, files cached here
   first within each window) with, for those cached here, their block files, lengths and
   checksums. Where blocks are is kept from one epoch to the next (:class:`LocalBlocks`, numpy
   columns: planning a window is a few vector operations, not Python per file): the worker is
   asked only about files not known to be cached here — all of them in the first epoch, then
   the ones that were not cached or whose block files failed. The files of the next window not
   known to be cached here go to the worker as a prefetch hint.
3. ``flat_map`` cuts each window into chunks of ``chunk`` files, and ``map(read, AUTOTUNE)``
   reads chunks in parallel: blocks cached here from their files, each verified (xxh3_64), the
   rest through the mount. The reading *engine* is the native kernel ``CachefsReadFiles``
   (``native/``: C++, no GIL, one copy) or its Python reference (``reader.read_chunk`` in a
   ``tf.numpy_function``), same arguments and results. A small ``numpy_function`` per chunk
   counts the reads and forgets files whose block files failed. ``unbatch`` gives one element
   per file, in order.

Why no ``tf.data.Dataset.from_generator``: the first time a generator dataset runs,
TensorFlow sets glibc's ``M_TRIM_THRESHOLD`` for the whole process, which also freezes the
mmap threshold at 128 KiB. Every larger buffer after that — most image files — is mmapped and
unmapped again: a plain ``tf.io.read_file`` pipeline over tmpfs ran 1.8-2.6x slower in the
same process after one generator dataset (bench/README.md, "tf_bench"). ``numpy_function``
does not do that.

Snapshots: a refresh of the dataset makes the worker serve a new snapshot (changed files get
new block keys). Each epoch starts by asking the worker for its snapshot; when it changed, every
known layout is forgotten (an old layout can name a block of the old version, which would still
verify). Answers about another snapshot than the epoch's are not kept: those files are read
through the mount, which serves the current version.

The worker being down or refusing never fails the pipeline by itself: resolves and hints that
fail mean "read through the mount" (which fails only if the mount itself is gone).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tf_dataset import native
from tf_dataset.order import DEFAULT_WINDOW, epoch_permutation
from tf_dataset.reader import CachedBlock, ShortCircuitReader, list_files, read_chunk

log = logging.getLogger(__name__)

#: Epoch orders kept (each is one int64 per file): the current epoch's, and the one before for
#: an iterator still finishing it.
ORDERS_KEPT = 2

#: How files are read: "native" (the C++ kernels, built by ``python -m tf_dataset.native``),
#: "python" (the reference engine), or "auto" (native when built for this TensorFlow).
ENGINES = ("auto", "native", "python")

_warned_python_engine = False


def _object_array(items: Sequence) -> np.ndarray:
    """A 1-d object array of ``items`` (``np.array`` would make a 2-d one of equal tuples)."""
    array = np.empty(len(items), dtype=object)
    array[:] = items
    return array


def _ranges(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows ``first[i] .. first[i] + count[i]`` for every i, concatenated, and where each
    ``i``'s rows start in that (``splits``, one more item than ``first``)."""
    splits = np.zeros(len(count) + 1, dtype=np.int64)
    np.cumsum(count, out=splits[1:])
    rows = np.repeat(first - splits[:-1], count) + np.arange(splits[-1], dtype=np.int64)
    return rows, splits


class LocalBlocks:
    """Which files are known to be cached on this node, and where their blocks are: per file a
    range of rows in append-only block columns (file, length, xxh3_64).

    A file resolved again or forgotten leaves its old rows behind; when they outnumber the
    live ones, the columns are compacted. Not thread-safe: :class:`EpochPlan` holds its lock
    around every call."""

    #: Rows of garbage allowed beyond the live ones before growing the columns compacts them.
    COMPACT_SLACK = 1024

    def __init__(self, count: int):
        self.known = np.zeros(count, dtype=bool)
        self._first = np.zeros(count, dtype=np.int64)
        self._count = np.zeros(count, dtype=np.int64)
        self._rows = 0  # rows in use, garbage included
        self._live = 0  # rows of known files
        self._files = np.empty(0, dtype=object)
        self._lengths = np.empty(0, dtype=np.int64)
        self._checksums = np.empty(0, dtype=np.uint64)

    def learn(self, indices: Sequence[int], layouts: Sequence[Sequence[CachedBlock]]) -> None:
        """Files ``indices`` are cached here, each in its blocks (all of them, in order)."""
        if not indices:
            return
        self.forget(np.asarray(indices, dtype=np.int64))
        counts = np.fromiter((len(blocks) for blocks in layouts), np.int64, len(layouts))
        added = int(counts.sum())
        if self._rows + added > len(self._files):
            if self._rows > 2 * self._live + self.COMPACT_SLACK:
                self._compact()
            if self._rows + added > len(self._files):
                self._grow(max(2 * len(self._files), self._rows + added, self.COMPACT_SLACK))
        blocks = [block for file_blocks in layouts for block in file_blocks]
        rows = slice(self._rows, self._rows + added)
        self._files[rows] = _object_array([os.fsencode(block.file) for block in blocks])
        self._lengths[rows] = [block.length for block in blocks]
        self._checksums[rows] = [block.checksum for block in blocks]
        firsts = self._rows + np.cumsum(counts) - counts
        self._first[indices], self._count[indices] = firsts, counts
        self._rows += added
        self._live += added
        self.known[indices] = True

    def forget(self, indices: np.ndarray) -> None:
        held = indices[self.known[indices]]
        self._live -= int(self._count[held].sum())
        self.known[held] = False

    def forget_all(self) -> None:
        self.known[:] = False
        self._rows = self._live = 0

    def gather(self, indices: np.ndarray):
        """For the files ``indices``, in that order: whether each is known to be cached here,
        where its rows start (``splits``), and the block columns of those rows (checksums as
        int64, as TensorFlow carries them)."""
        local = self.known[indices]
        rows, splits = _ranges(self._first[indices], np.where(local, self._count[indices], 0))
        return (
            local,
            splits,
            self._files[rows],
            self._lengths[rows],
            self._checksums[rows].view(np.int64),
        )

    def _compact(self) -> None:
        held = np.flatnonzero(self.known)
        rows, splits = _ranges(self._first[held], self._count[held])
        for column in (self._files, self._lengths, self._checksums):
            column[: len(rows)] = column[rows]  # a fancy index copies first: no overlap issue
        self._first[held] = splits[:-1]
        self._rows = len(rows)

    def _grow(self, capacity: int) -> None:
        def grown(column: np.ndarray) -> np.ndarray:
            bigger = np.empty(capacity, dtype=column.dtype)
            bigger[: self._rows] = column[: self._rows]
            return bigger

        self._files = grown(self._files)
        self._lengths = grown(self._lengths)
        self._checksums = grown(self._checksums)


class EpochPlan:
    """The Python side of :func:`dataset`: epoch orders, what is cached here, the accounting.

    Thread-safe: tf.data calls :meth:`account` from several threads at once, while
    :meth:`window_files` runs (in order, one window after the other) in another. The worker is
    asked outside the lock. Memory: ~100 bytes per file, plus one row per cached block."""

    def __init__(
        self,
        reader: ShortCircuitReader,
        paths: Sequence[str],
        *,
        seed: int,
        shuffle: bool,
        window: int,
        hints: bool,
    ):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.reader = reader
        self.paths = list(paths)
        self.names = _object_array([os.fsencode(path) for path in self.paths])
        self.mount_root = os.fsencode(reader.mount_root)
        self.seed = seed
        self.shuffle = shuffle
        self.window = window
        self.hints = hints
        self.window_count = -(-len(self.paths) // window)
        self._epochs = itertools.count()
        self._lock = threading.Lock()
        self._orders: OrderedDict[int, np.ndarray] = OrderedDict()
        self._local = LocalBlocks(len(self.paths))
        self._snapshot: str | None = None  # the worker's snapshot when the last epoch began

    def next_epoch(self) -> np.int64:
        """The epoch number of a new iterator (0, 1, … in the order iterators start). Asks the
        worker for its snapshot of the dataset (one request): layouts of another are dropped."""
        snapshot = self.reader.snapshot()
        with self._lock:
            epoch = next(self._epochs)
            if snapshot is not None and snapshot != self._snapshot:
                self._local.forget_all()
                self._snapshot = snapshot
        return np.int64(epoch)

    def window_files(self, epoch: np.int64, number: np.int64):
        """Window ``number`` of ``epoch``, in the order its files are read: their indices and
        names, and (:meth:`LocalBlocks.gather`) which are cached here and in which blocks."""
        order = self._order(int(epoch))
        start = int(number) * self.window
        part = order[start : start + self.window]
        following = order[start + self.window : start + 2 * self.window]
        # This window's files not known to be cached here: in the first window all of them;
        # later, those the resolve a window ago found uncached (its hint may have brought them
        # in since). Then the next window, so that only its files really not cached here are
        # hinted (a warm epoch sends no hints, and each file is resolved once).
        self._resolve(part)
        self._resolve(following)
        if self.hints:
            # Not this window's own files, even in the first window: its reads are about to
            # fetch them, and hints for them only delayed the next window's (measured: the
            # first epoch of a cold dataset was ~12 % slower, bench/README.md "tf_bench").
            self._hint(following)
        with self._lock:
            if self.shuffle:  # order.local_first: a stable partition, local files first
                here = self._local.known[part]
                part = np.concatenate([part[here], part[~here]])
            local, splits, files, lengths, checksums = self._local.gather(part)
        return part, self.names[part], local, splits, files, lengths, checksums

    def account(
        self, indices: np.ndarray, local: np.ndarray, fell_back: np.ndarray, sizes: np.ndarray
    ) -> np.bool_:
        """Count one chunk's reads; forget the files whose block files failed (evicted or
        damaged since they were resolved: the worker is asked again next time)."""
        short = local & ~fell_back
        self.reader.stats.add(
            short_circuit_files=int(short.sum()),
            short_circuit_bytes=int(sizes[short].sum()),
            fallback_files=int(fell_back.sum()),
            mount_files=int((~short).sum()),
            mount_bytes=int(sizes[~short].sum()),
        )
        if fell_back.any():
            with self._lock:
                self._local.forget(indices[fell_back])
        return np.bool_(True)

    def _order(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                count = len(self.paths)
                order = (
                    epoch_permutation(count, seed=self.seed, epoch=epoch)
                    if self.shuffle
                    else np.arange(count)
                ).astype(np.int64)
                self._orders[epoch] = order
                while len(self._orders) > ORDERS_KEPT:
                    self._orders.popitem(last=False)
            return order

    def _resolve(self, indices: np.ndarray) -> None:
        """Ask the worker about the files of ``indices`` not known to be cached here."""
        with self._lock:
            unknown = indices[~self._local.known[indices]].tolist()
            snapshot = self._snapshot
        if not unknown:
            return
        layouts = self.reader.resolve([self.paths[i] for i in unknown])
        # Kept only if the answer names the snapshot seen before it was asked: snapshots only
        # move forward, so then every path of it was looked up in that snapshot.
        with self._lock:
            if snapshot != self._snapshot:  # a new epoch saw a new snapshot meanwhile
                return
            cached = [
                (index, layout.blocks)
                for index, layout in zip(unknown, layouts, strict=True)
                if _is_local(layout) and layout.snapshot == snapshot
            ]
            self._local.learn([index for index, _ in cached], [blocks for _, blocks in cached])

    def _hint(self, indices: np.ndarray) -> None:
        with self._lock:
            remote = indices[~self._local.known[indices]].tolist()
        if remote:
            self.reader.hint([self.paths[i] for i in remote])


def native_ops(engine: str):
    """The native kernels for ``engine`` (:data:`ENGINES`), or None: read without them."""
    global _warned_python_engine
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "python":
        return None
    try:
        return native.load()
    except native.NativeUnavailable as exc:
        if engine == "native":
            raise
        if not _warned_python_engine:
            _warned_python_engine = True
            log.warning("tf_dataset reads without its native kernels (slower): %s", exc)
        return None


def read_engine(engine: str) -> Callable:
    """The function that reads a chunk of files in a tf.data function, for ``engine``
    (:data:`ENGINES`): ``(mount_root, names, local, splits, files, lengths, checksums) ->
    (contents, fell_back)``."""
    ops = native_ops(engine)
    if ops is not None:
        return ops.cachefs_read_files

    def read_in_python(*chunk):
        contents, fell_back = tf.numpy_function(
            _read_chunk_arrays, list(chunk), (tf.string, tf.bool), stateful=True
        )
        contents.set_shape(chunk[1].shape)
        fell_back.set_shape(chunk[1].shape)
        return contents, fell_back

    return read_in_python


def _read_chunk_arrays(mount_root, names, local, splits, files, lengths, checksums):
    contents, failed = read_chunk(mount_root, names, local, splits, files, lengths, checksums)
    return _object_array(contents), np.array(failed, dtype=bool)


def _paths(name: str, files: str | Sequence[str], state_dir: str | None) -> list[str]:
    """The dataset's files named by a glob pattern, or a list of paths checked to be paths
    inside the dataset (no empty, ``.`` or ``..`` component, no NUL byte)."""
    if isinstance(files, str):
        found = list_files(name, files, state_dir=state_dir)
        if not found:
            raise ValueError(f"no file of dataset {name!r} matches {files!r}")
        return found
    paths = [str(path) for path in files]
    for path in paths:
        parts = path.lstrip("/").split("/")
        if "\0" in path or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{path!r} is not a path of a file inside dataset {name!r}")
    return paths


def _epoch_windows(window_count: int, next_epoch) -> tf.data.Dataset:
    """(epoch, window number) for every window; each iterator takes its own epoch number."""

    def number_epoch(epoch, number):
        epoch = tf.cond(
            tf.equal(number, 0),
            lambda: tf.reshape(tf.numpy_function(next_epoch, [], tf.int64, stateful=True), []),
            lambda: epoch,
        )
        return epoch, (epoch, number)

    return tf.data.Dataset.range(window_count).scan(tf.constant(-1, tf.int64), number_epoch)


def _chunks(window: dict, chunk: int) -> tf.data.Dataset:
    """A window cut into chunks of ``chunk`` files, each with its own rows of the block
    columns (so a chunk is self-contained: the arguments of one read)."""
    count = tf.size(window["index"], out_type=tf.int64)

    def cut(start):
        stop = tf.minimum(start + chunk, count)
        first, last = window["splits"][start], window["splits"][stop]
        part = {key: window[key][start:stop] for key in ("index", "name", "local")}
        part["splits"] = window["splits"][start : stop + 1] - first
        for key in ("files", "lengths", "checksums"):
            part[key] = window[key][first:last]
        return part

    return tf.data.Dataset.range(0, count, chunk).map(cut)


def dataset(
    name: str,
    files: str | Sequence[str],
    *,
    seed: int = 0,
    shuffle: bool = True,
    window: int = DEFAULT_WINDOW,
    chunk: int = 128,
    with_paths: bool = False,
    hints: bool = True,
    state_dir: str | None = None,
    reader: ShortCircuitReader | None = None,
    engine: str = "auto",
    num_parallel_calls: int = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the contents (``tf.string``) of files of a cachefs dataset.

    ``files``: a glob pattern relative to the dataset (``"train/*/*.JPEG"``, ``**`` spans
    directories) or a list of such paths. Each iteration is one epoch, shuffled with
    ``(seed, epoch number)`` (epoch numbers count iterators from 0), files cached on this node
    first within windows of ``window`` files (see ``order.py``); ``shuffle=False`` keeps the
    given order. ``with_paths``: elements are ``(path, contents)`` (labels usually come from
    the path). ``hints``: send prefetch hints one window ahead. ``chunk``: files per read call.
    ``engine``: see :data:`ENGINES`. ``state_dir``: the worker's state directory (default as
    the ``cachefs`` CLI).

    The dataset's cardinality is the number of files, so Keras knows the steps per epoch.
    ``dataset.reader.stats`` (an attribute added to the returned object) counts files read by
    short-circuit, through the mount, and fallbacks.
    """
    if chunk < 1:
        raise ValueError("chunk must be >= 1")
    read = read_engine(engine)
    paths = _paths(name, files, state_dir)
    reader = reader or ShortCircuitReader(name, state_dir=state_dir)
    plan = EpochPlan(reader, paths, seed=seed, shuffle=shuffle, window=window, hints=hints)
    mount_root = tf.constant(plan.mount_root)

    def plan_window(epoch, number):
        columns = tf.numpy_function(
            plan.window_files,
            [epoch, number],
            (tf.int64, tf.string, tf.bool, tf.int64, tf.string, tf.int64, tf.int64),
            stateful=True,
        )
        keys = ("index", "name", "local", "splits", "files", "lengths", "checksums")
        window = dict(zip(keys, columns, strict=True))
        for column in window.values():
            column.set_shape([None])
        return window

    def read_chunk_files(part):
        contents, fell_back = read(
            mount_root,
            part["name"],
            part["local"],
            part["splits"],
            part["files"],
            part["lengths"],
            part["checksums"],
        )
        sizes = tf.strings.length(contents, unit="BYTE")
        counted = tf.numpy_function(
            plan.account,
            [part["index"], part["local"], fell_back, tf.cast(sizes, tf.int64)],
            tf.bool,
            stateful=True,
        )
        with tf.control_dependencies([counted]):
            contents = tf.identity(contents)
        return (part["name"], contents) if with_paths else contents

    files_ds = (
        _epoch_windows(plan.window_count, plan.next_epoch)
        .map(plan_window)
        .prefetch(1)  # the next window is planned (and hinted) while this one is read
        .flat_map(lambda window: _chunks(window, chunk))
        .map(read_chunk_files, num_parallel_calls=num_parallel_calls, deterministic=deterministic)
        .unbatch()
        .apply(tf.data.experimental.assert_cardinality(len(paths)))
    )
    files_ds.reader = reader  # for stats; tf.data.Dataset objects take attributes
    files_ds.plan = plan
    return files_ds


def _is_local(layout) -> bool:
    return layout is not None and layout.local


# TFRecord records (tfrecord_dataset, ShardPlan) are in tf_dataset/records.py.
