"""tf.data pipelines over a cachefs dataset's TFRecord shards: :func:`tfrecord_dataset` (the
records) and :class:`ShardPlan` (its Python side: each epoch's shard order, where each shard's
blocks are, prefetch hints). The file-contents pipeline and what both share are in
``pipeline.py``, whose module docstring says how the pipelines run."""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_dataset.order import epoch_order
from tf_dataset.pipeline import ORDERS_KEPT, _is_local, _object_array, _paths, native_ops
from tf_dataset.reader import ShortCircuitReader


class ShardPlan:
    """The Python side of :func:`tfrecord_dataset`: each epoch's shard order, where each
    shard's blocks are, and prefetch hints sent as shards are opened."""

    def __init__(
        self,
        reader: ShortCircuitReader,
        paths: Sequence[str],
        *,
        seed: int,
        shuffle: bool,
        window: int,
        cycle_length: int,
        hint_shards: int,
        hints: bool,
        short_circuit: bool,
    ):
        self.reader = reader
        self.paths = list(paths)
        self.seed = seed
        self.shuffle = shuffle
        self.window = window
        self.cycle_length = cycle_length
        self.hint_shards = hint_shards
        self.hints = hints
        self.short_circuit = short_circuit
        self._epochs = itertools.count()
        self._lock = threading.Lock()
        # epoch → (order, layouts, the shards hinted so far, where shards go on through the
        # mount: position → (mount path, records to skip there))
        self._epoch_state: OrderedDict[int, tuple[list[int], list, set[int], dict]] = OrderedDict()

    def begin_epoch(self) -> tuple[np.int64, np.ndarray]:
        """A new iterator's epoch number and the positions of its shards (0, 1, …)."""
        layouts = self.reader.resolve(self.paths)
        local = [_is_local(layout) for layout in layouts]
        with self._lock:
            epoch = next(self._epochs)
            order = epoch_order(
                local, seed=self.seed, epoch=epoch, window=self.window, shuffle=self.shuffle
            )
            self._epoch_state[epoch] = (order, layouts, set(), {})
            while len(self._epoch_state) > ORDERS_KEPT:
                self._epoch_state.popitem(last=False)
        return np.int64(epoch), np.arange(len(order), dtype=np.int64)

    def open_shard(self, epoch: np.int64, position: np.int64):
        """The shard at ``position`` of ``epoch``'s order: its path under the mount, the blocks
        to read it from (files, lengths, checksums; none if it is not all cached here, or
        without short-circuit), and its size. Hints the next ``hint_shards`` uncached shards
        after the ones being read."""
        with self._lock:
            order, layouts, hinted, _ = self._state(epoch)
            start = int(position) + self.cycle_length
            fresh = [
                i
                for i in order[start : start + self.hint_shards]
                if not _is_local(layouts[i]) and i not in hinted
            ]
            hinted.update(fresh)
            index = order[int(position)]
        if self.hints and fresh:
            self.reader.hint([self.paths[i] for i in fresh])
        layout = layouts[index]
        blocks = layout.blocks if self.short_circuit and _is_local(layout) else ()
        return (
            os.fsencode(self.reader.mount_path(self.paths[index])),
            _object_array([os.fsencode(block.file) for block in blocks]),
            np.array([block.length for block in blocks], dtype=np.int64),
            np.array([block.checksum for block in blocks], dtype=np.uint64).view(np.int64),
            np.int64(layout.size if layout is not None else 0),
        )

    def end_of_blocks(
        self,
        epoch: np.int64,
        position: np.int64,
        path: bytes,
        size: np.int64,
        from_blocks: np.bool_,
        failed: np.bool_,
        given: np.int64,
    ) -> np.bool_:
        """The blocks of the shard at ``position`` are done (all read, the first that failed,
        or none to read): count the shard, and say where it goes on through the mount — all
        of it, or after the ``given`` records read from its blocks — for :meth:`rest_of_shard`."""
        self.account(from_blocks, failed, size)
        if not from_blocks or failed:
            with self._lock:
                self._state(epoch)[3][int(position)] = (path, int(given) if failed else 0)
        return np.bool_(True)

    def account(self, from_blocks: np.bool_, failed: np.bool_, size: np.int64) -> np.bool_:
        """Count one shard: read from its blocks, through the mount, or from its blocks until
        one failed and through the mount after (a fallback; its bytes count as the mount's)."""
        if from_blocks and not failed:
            self.reader.stats.add(short_circuit_files=1, short_circuit_bytes=int(size))
        else:
            self.reader.stats.add(
                fallback_files=int(bool(from_blocks)), mount_files=1, mount_bytes=int(size)
            )
        return np.bool_(True)

    def rest_of_shard(self, epoch: np.int64, position: np.int64) -> tuple[np.ndarray, np.int64]:
        """Where the shard at ``position`` goes on through the mount: its path (none: nothing
        left) and how many of its records to skip there."""
        with self._lock:
            rest = self._state(epoch)[3].pop(int(position), None)
        if rest is None:
            return _object_array([]), np.int64(0)
        path, skip = rest
        return _object_array([path]), np.int64(skip)

    def _state(self, epoch: np.int64):
        state = self._epoch_state.get(int(epoch))
        if state is None:  # forgotten under ORDERS_KEPT iterators opened after it
            raise RuntimeError(f"epoch {int(epoch)} of this tfrecord_dataset is no longer open")
        return state


def _block_records(ops, path, files, lengths, checksums, end_of_blocks, context) -> tf.data.Dataset:
    """The records of a shard read from its blocks (none: ``files`` empty), block after block,
    the kernel carrying the incomplete record on to the next block, until the last block or
    the first that fails. Then ``end_of_blocks(*context, read from blocks, a block failed,
    records given)`` is called, once (the caller goes on through the mount from there).

    Records come out of the kernel's output by ``unbatch``, which moves them: slicing them with
    ``from_tensor_slices`` copied each one again and cost ~20 % of the throughput here."""
    count = tf.size(files, out_type=tf.int64)
    blocks = tf.data.Dataset.from_tensor_slices(
        (files, lengths, checksums, tf.range(count) == count - 1, tf.ones([count], tf.bool))
    )
    end = tf.data.Dataset.from_tensors(  # after the last block
        (tf.constant(b""), tf.constant(0, tf.int64), tf.constant(0, tf.int64), True, False)
    )
    no_records = tf.zeros([0], tf.string)
    zero = tf.constant(0, tf.int64)

    def step(state, block):
        carry, offset, given, failed = state
        file, length, checksum, last, is_block = block

        def read_block():
            records, next_carry, next_offset, ok = ops.cachefs_read_tf_record_block(
                carry, offset, file, length, checksum, last, path
            )
            given_now = given + tf.size(records, out_type=tf.int64)
            return (next_carry, next_offset, given_now, ~ok), records

        def finish():
            done = tf.numpy_function(
                end_of_blocks, [*context, count > 0, failed, given], tf.bool, stateful=True
            )
            with tf.control_dependencies([done]):
                return state, tf.identity(no_records)

        return tf.cond(
            is_block,
            lambda: tf.cond(failed, lambda: (state, no_records), read_block),
            finish,
        )

    initial = (tf.constant(b""), zero, zero, tf.constant(False))
    return blocks.concatenate(end).scan(initial, step).unbatch()


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
    engine: str = "auto",
    num_parallel_reads: int = tf.data.AUTOTUNE,
    deterministic: bool = True,
) -> tf.data.Dataset:
    """A ``tf.data.Dataset`` of the records of TFRecord shards of a cachefs dataset.

    Each epoch orders the shards like :func:`dataset` orders files (``window`` defaults to all
    shards: local shards first, each group shuffled — shards are written shuffled, so their
    order does not sort classes), then reads ``cycle_length`` shards at a time, interleaved.
    A shard cached here (every block) is read by short-circuit, block after block, by the
    native kernel ``CachefsReadTfRecordBlock``: each block verified, the framing and both
    record checksums checked as TensorFlow's reader does; only a block and one incomplete
    record are held at a time. Shards not cached here, compressed shards, and every shard
    without the native kernels (``engine="python"``: records need TensorFlow's crc32c) are read
    with ``tf.data.TFRecordDataset`` through the mount. So is the rest of a shard after a
    block that fails (evicted or damaged since the epoch began), its first records — those
    given from the blocks before — skipped: every record once, whole and checked. (After a
    refresh in between, the two parts could come from two versions of the shard: records, not
    shards, are the unit here; :func:`dataset` never mixes versions within a file.) As each
    shard is opened, the next ``hint_shards`` uncached shards after the open ones are hinted.
    """
    ops = native_ops(engine)
    if compression_type:  # the kernel reads plain TFRecord framing only
        ops = None
    paths = _paths(name, files, state_dir)
    reader = reader or ShortCircuitReader(name, state_dir=state_dir)
    plan = ShardPlan(
        reader,
        paths,
        seed=seed,
        shuffle=shuffle,
        window=window or max(1, len(paths)),
        cycle_length=cycle_length,
        hint_shards=hint_shards,
        hints=hints,
        short_circuit=ops is not None,
    )

    def begin_epoch(_):
        epoch, positions = tf.numpy_function(
            plan.begin_epoch, [], (tf.int64, tf.int64), stateful=True
        )
        epoch.set_shape([])
        positions.set_shape([None])
        return tf.data.Dataset.from_tensor_slices((tf.fill(tf.shape(positions), epoch), positions))

    def through_mount(paths, skip):
        return tf.data.TFRecordDataset(
            paths, compression_type=compression_type, buffer_size=buffer_size
        ).skip(skip)

    def shard_records(epoch, position):
        path, block_files, lengths, checksums, size = tf.numpy_function(
            plan.open_shard,
            [epoch, position],
            (tf.string, tf.string, tf.int64, tf.int64, tf.int64),
            stateful=True,
        )
        path.set_shape([])
        size.set_shape([])
        for column in (block_files, lengths, checksums):
            column.set_shape([None])

        if ops is None:
            counted = tf.numpy_function(plan.account, [False, False, size], tf.bool, stateful=True)
            with tf.control_dependencies([counted]):
                return through_mount(tf.reshape(path, [1]), 0)

        def rest(_):
            # Built once the blocks are done (concatenate opens it only then): the shard's
            # rest through the mount, or nothing.
            paths, skip = tf.numpy_function(
                plan.rest_of_shard, [epoch, position], (tf.string, tf.int64), stateful=True
            )
            paths.set_shape([None])
            skip.set_shape([])
            # Through an Identity: a skip count that is output 1 of a multi-output op makes
            # TensorFlow 2.21's tf.data graph optimizer (noop elimination) crash the process.
            return through_mount(paths, tf.identity(skip))

        shard = [epoch, position, path, size]  # what end_of_blocks is told first
        from_blocks = _block_records(
            ops, path, block_files, lengths, checksums, plan.end_of_blocks, shard
        )
        return from_blocks.concatenate(tf.data.Dataset.range(1).flat_map(rest))

    records = (
        tf.data.Dataset.range(1)
        .flat_map(begin_epoch)
        .interleave(
            shard_records,
            cycle_length=cycle_length,
            block_length=block_length,
            num_parallel_calls=num_parallel_reads,
            deterministic=deterministic,
        )
    )
    records.reader = reader
    records.plan = plan
    return records
