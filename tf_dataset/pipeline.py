"""tf.data pipelines over a cachefs dataset: file contents (:func:`dataset`) and TFRecord
records (:func:`tfrecord_dataset`).

How :func:`dataset` runs, per epoch (each new iterator is the next epoch: Keras ``fit`` makes
one per epoch):

1. A Python generator (``tf.data.Dataset.from_generator``) computes the epoch's order
   (``order.py``: seeded uniform shuffle, local files first within windows). For each window it
   asks the worker, in one batch request, where the files' blocks are, and sends its uncached
   files as a prefetch hint; both happen one window ahead, in a thread, so the worker fetches
   them while the window before is read. Before yielding a window it asks again about the files
   that were not cached (the prefetch may have brought them in since), so those are
   short-circuited too.
2. The generator yields chunks of ``chunk`` paths; the layouts stay in Python, under the chunk's
   token. ``map(read_chunk, num_parallel_calls=AUTOTUNE)`` reads chunks in parallel with a
   ``tf.numpy_function``: one Python call per chunk, not per file, and file reads (``os.read``)
   release the GIL. Blocks cached here are read from their files and verified (xxh3_64), the
   rest through the mount (``reader.py``).
3. ``unbatch`` gives one element per file, in the epoch's order (``deterministic=True``).

The worker being down or refusing never fails the pipeline by itself: resolves and hints that
fail mean "read through the mount" (which fails only if the mount itself is gone).
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tensorflow as tf

from tf_dataset.order import DEFAULT_WINDOW, epoch_order, epoch_permutation, local_first, windows
from tf_dataset.reader import BlockLinks, FileLayout, ShortCircuitReader, list_files

log = logging.getLogger(__name__)

#: How files cached here are read: "link" — the generator hard-links each verified block file
#: into a private directory and TensorFlow's C++ reader reads the link (one copy, no Python per
#: file); "python" — a tf.numpy_function reads and verifies the block files (a second copy
#: into the tensor, and the GIL).
READ_MODES = ("link", "python")

#: Chunks whose layouts wait for their read (an abandoned iterator leaves some behind: past this
#: many the oldest are forgotten, and such a chunk is resolved again when read).
MAX_PENDING_CHUNKS = 4096


class EpochSource:
    """The generator side of :func:`dataset` and the read function of its ``map``."""

    def __init__(
        self,
        reader: ShortCircuitReader,
        paths: Sequence[str],
        *,
        seed: int,
        shuffle: bool,
        window: int,
        chunk: int,
        hints: bool,
        read_mode: str = "python",
        first_epoch: int = 0,
    ):
        if chunk < 1 or window < 1:
            raise ValueError("chunk and window must be >= 1")
        if read_mode not in READ_MODES:
            raise ValueError(f"read_mode must be one of {READ_MODES}, got {read_mode!r}")
        self.read_mode = read_mode
        # link mode: verified hard links to block files, read by TensorFlow's C++ reader.
        self.links = BlockLinks() if read_mode == "link" else None
        if self.links is not None:
            weakref.finalize(self, self.links.close)
        self._linked: OrderedDict[int, list[str]] = OrderedDict()
        self.reader = reader
        self.paths = list(paths)
        self.seed = seed
        self.shuffle = shuffle
        self.window = window
        self.chunk = chunk
        self.hints = hints
        self._next_epoch = first_epoch
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._pending: OrderedDict[int, list[FileLayout | None]] = OrderedDict()

    def __call__(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """One epoch: (token, paths, what to read) per chunk. Called by tf.data for every new
        iterator."""
        with self._lock:
            epoch = self._next_epoch
            self._next_epoch += 1
        count = len(self.paths)
        if self.shuffle:
            order = epoch_permutation(count, seed=self.seed, epoch=epoch)
        else:
            order = np.arange(count)
        parts = list(windows(order, self.window))
        # The next window is resolved (and hinted) in a thread while this one is read: the
        # request waits on the worker, another process, without holding the GIL.
        with ThreadPoolExecutor(1, thread_name_prefix="tf_dataset-resolve") as resolver:
            ahead = resolver.submit(self._resolve_and_hint, parts[0]) if parts else None
            for number, part in enumerate(parts):
                layouts = ahead.result()
                if number + 1 < len(parts):
                    ahead = resolver.submit(self._resolve_and_hint, parts[number + 1])
                if number:  # resolved a window ago: the hint may have brought files in since
                    layouts = self._refresh_remote(part, layouts)
                if self.shuffle:
                    by_index = dict(zip(part, layouts, strict=True))
                    part = local_first(part, [_is_local(by_index[i]) for i in part])
                    layouts = [by_index[i] for i in part]
                for start in range(0, len(part), self.chunk):
                    token = next(self._tokens)
                    names = [self.paths[i] for i in part[start : start + self.chunk]]
                    chunk_layouts = layouts[start : start + self.chunk]
                    names_array = np.array(names, dtype=object)
                    if self.links is not None:
                        targets = self._link_chunk(token, names, chunk_layouts)
                        yield token, names_array, np.array(targets, dtype=object)
                        continue
                    with self._lock:
                        self._pending[token] = chunk_layouts
                        while len(self._pending) > MAX_PENDING_CHUNKS:
                            self._pending.popitem(last=False)
                    yield token, names_array, names_array

    def _link_chunk(
        self, token: int, names: list[str], layouts: list[FileLayout | None]
    ) -> list[str]:
        """What TensorFlow reads for each file of a chunk: a verified link to its block file
        (a one-block file cached here), else its path under the mount."""
        targets, links = [], []
        linked_bytes = fallbacks = 0
        for name, layout in zip(names, layouts, strict=True):
            target = None
            if layout is not None and layout.local and len(layout.blocks) == 1:
                target = self.links.link(layout.blocks[0])
                if target is None:
                    fallbacks += 1
                else:
                    links.append(target)
                    linked_bytes += layout.size
            targets.append(target or self.reader.mount_path(name))
        mount_files = len(names) - len(links)
        self.reader.stats.add(
            short_circuit_files=len(links),
            short_circuit_bytes=linked_bytes,
            fallback_files=fallbacks,
            mount_files=mount_files,
        )
        with self._lock:
            self._linked[token] = links
            while len(self._linked) > MAX_PENDING_CHUNKS:  # abandoned iterators' chunks
                _, stale = self._linked.popitem(last=False)
                self.links.release(stale)
        return targets

    def release_chunk(self, token: np.int64) -> np.bool_:
        """Remove a chunk's links once TensorFlow has read it."""
        with self._lock:
            links = self._linked.pop(int(token), [])
        self.links.release(links)
        return np.bool_(True)

    def _resolve_and_hint(self, indices: list[int]) -> list[FileLayout | None]:
        layouts = self._resolve(indices)
        self._hint(indices, layouts)
        return layouts

    def _resolve(self, indices: list[int]) -> list[FileLayout | None]:
        return self.reader.resolve([self.paths[i] for i in indices])

    def _hint(self, indices: list[int], layouts: list[FileLayout | None]) -> None:
        if self.hints:
            remote = [
                self.paths[i] for i, lay in zip(indices, layouts, strict=True) if not _is_local(lay)
            ]
            self.reader.hint(remote)

    def _refresh_remote(
        self, indices: list[int], layouts: list[FileLayout | None]
    ) -> list[FileLayout | None]:
        """Ask again about the files not cached here when they were resolved (a window ago):
        the prefetch hint may have brought them in since."""
        remote = [k for k, lay in enumerate(layouts) if not _is_local(lay)]
        if not remote or not self.hints:
            return layouts
        fresh = self.reader.resolve([self.paths[indices[k]] for k in remote])
        layouts = list(layouts)
        for k, layout in zip(remote, fresh, strict=True):
            if layout is not None:
                layouts[k] = layout
        return layouts

    def read_chunk(self, token: np.int64, names: np.ndarray) -> np.ndarray:
        """The contents of one chunk's files (runs in a tf.data thread)."""
        paths = [name.decode() if isinstance(name, bytes) else str(name) for name in names]
        with self._lock:
            layouts = self._pending.pop(int(token), None)
        if layouts is None:  # forgotten (see MAX_PENDING_CHUNKS): ask again
            layouts = self.reader.resolve(paths)
        contents = np.empty(len(paths), dtype=object)
        contents[:] = self.reader.read_many(paths, layouts)
        return contents


def _is_local(layout: FileLayout | None) -> bool:
    return layout is not None and layout.local


def _paths(name: str, files: str | Sequence[str], state_dir: str | None) -> list[str]:
    if isinstance(files, str):
        found = list_files(name, files, state_dir=state_dir)
        if not found:
            raise ValueError(f"no file of dataset {name!r} matches {files!r}")
        return found
    return [str(path) for path in files]


def dataset(
    name: str,
    files: str | Sequence[str],
    *,
    seed: int = 0,
    shuffle: bool = True,
    window: int = DEFAULT_WINDOW,
    chunk: int = 64,
    with_paths: bool = False,
    hints: bool = True,
    state_dir: str | None = None,
    reader: ShortCircuitReader | None = None,
    read_mode: str = "python",
    num_parallel_calls: int = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the contents (``tf.string``) of files of a cachefs dataset.

    ``files``: a glob pattern relative to the dataset (``"train/*/*.JPEG"``, ``**`` spans
    directories) or a list of such paths. Each iteration is one epoch, shuffled with
    ``(seed, epoch number)`` (epoch numbers count iterators from 0), files cached on this node
    first within windows of ``window`` files (see ``order.py``); ``shuffle=False`` keeps the
    given order. ``with_paths``: elements are ``(path, contents)`` (labels usually come from
    the path). ``hints``: send prefetch hints one window ahead. ``chunk``: files per Python
    read call. ``state_dir``: the worker's state directory (default as the ``cachefs`` CLI).

    The dataset's cardinality is the number of files, so Keras knows the steps per epoch.
    ``dataset.reader.stats`` (an attribute added to the returned object) counts files read by
    short-circuit, through the mount, and fallbacks.
    """
    paths = _paths(name, files, state_dir)
    reader = reader or ShortCircuitReader(name, state_dir=state_dir)
    source = EpochSource(
        reader,
        paths,
        seed=seed,
        shuffle=shuffle,
        window=window,
        chunk=chunk,
        hints=hints,
        read_mode=read_mode,
    )
    chunks = tf.data.Dataset.from_generator(
        source,
        output_signature=(
            tf.TensorSpec(shape=(), dtype=tf.int64),
            tf.TensorSpec(shape=(None,), dtype=tf.string),  # paths in the dataset
            tf.TensorSpec(shape=(None,), dtype=tf.string),  # what to read (link mode)
        ),
    )

    def read_chunk(token, names, _targets):
        contents = tf.numpy_function(source.read_chunk, [token, names], tf.string, stateful=True)
        contents.set_shape([None])
        return (names, contents) if with_paths else contents

    def read_linked_chunk(token, names, targets):
        # TensorFlow's C++ reader, one file after the other within a chunk (chunks in
        # parallel): verified links to block files, or paths under the mount.
        contents = tf.map_fn(tf.io.read_file, targets, fn_output_signature=tf.string)
        with tf.control_dependencies([contents]):  # the links go only after the reads
            released = tf.numpy_function(source.release_chunk, [token], tf.bool, stateful=True)
        with tf.control_dependencies([released]):
            contents = tf.identity(contents)
        return (names, contents) if with_paths else contents

    files_ds = chunks.map(
        read_linked_chunk if read_mode == "link" else read_chunk,
        num_parallel_calls=num_parallel_calls,
        deterministic=deterministic,
    ).unbatch()
    files_ds = files_ds.apply(tf.data.experimental.assert_cardinality(len(paths)))
    files_ds.reader = reader  # for stats; tf.data.Dataset objects take attributes
    files_ds.source = source
    return files_ds


def tfrecord_dataset(
    name: str,
    files: str | Sequence[str],
    *,
    seed: int = 0,
    shuffle: bool = True,
    window: int | None = None,
    cycle_length: int = 4,
    block_length: int = 1,
    hint_shards: int = 2,
    compression_type: str | None = None,
    buffer_size: int = 8 << 20,
    hints: bool = True,
    state_dir: str | None = None,
    reader: ShortCircuitReader | None = None,
    num_parallel_reads: int = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the records of TFRecord shards of a cachefs dataset.

    Each epoch orders the shards like :func:`dataset` orders files (``window`` defaults to all
    shards: local shards first, each group shuffled — shards are written shuffled, so their
    order does not sort classes), then reads ``cycle_length`` shards at a time, interleaved,
    with ``tf.data.TFRecordDataset`` over the mount: large sequential reads, where FUSE costs
    little per byte and the worker's block read-ahead keeps the stream going. As each shard is
    opened, the next ``hint_shards`` uncached shards after the open ones are hinted.
    """
    paths = _paths(name, files, state_dir)
    reader = reader or ShortCircuitReader(name, state_dir=state_dir)
    epochs = itertools.count()
    window = window or max(1, len(paths))

    def shards() -> Iterator[str]:
        epoch = next(epochs)
        layouts = reader.resolve(paths)
        local = [_is_local(layout) for layout in layouts]
        order = epoch_order(local, seed=seed, epoch=epoch, window=window, shuffle=shuffle)
        hinted: set[int] = set()
        for position, index in enumerate(order):
            if hints:
                upcoming = order[position + cycle_length : position + cycle_length + hint_shards]
                fresh = [i for i in upcoming if not local[i] and i not in hinted]
                if fresh:
                    hinted.update(fresh)
                    reader.hint([paths[i] for i in fresh])
            yield reader.mount_path(paths[index])

    shard_paths = tf.data.Dataset.from_generator(
        shards, output_signature=tf.TensorSpec(shape=(), dtype=tf.string)
    )
    records = shard_paths.interleave(
        lambda path: tf.data.TFRecordDataset(
            path, compression_type=compression_type, buffer_size=buffer_size
        ),
        cycle_length=cycle_length,
        block_length=block_length,
        num_parallel_calls=num_parallel_reads,
        deterministic=deterministic,
    )
    records.reader = reader
    return records
