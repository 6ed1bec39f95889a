"""tf.data integration of cachefs: locality-ordered epochs, short-circuit reads of blocks
cached on this node, prefetch hints for the rest.

    import tf_dataset
    paths = tf_dataset.files("imagenet", "train/*/*.JPEG")
    ds = tf_dataset.dataset("imagenet", paths, seed=0, with_paths=True)   # (path, contents)
    records = tf_dataset.tfrecord_dataset("imagenet-tfr", "train-*.tfrecord")

Modules: ``order`` (epoch order, pure), ``reader`` (the short-circuit reader and the Python
reference of the read kernel; no TensorFlow), ``native`` (the C++ read kernels and their build:
``python -m tf_dataset.native``), ``pipeline`` and ``records`` (the tf.data glue for files
and for TFRecord shards; imported only when :func:`dataset` or :func:`tfrecord_dataset` is
first used, so the rest works without TensorFlow).

Talks to the worker only through ``cachefs.client`` (import-linter enforces it).
"""

from __future__ import annotations

from typing import Any

from tf_dataset.order import epoch_order, epoch_permutation, local_first
from tf_dataset.reader import FileLayout, ShortCircuitReader, list_files

__all__ = [
    "FileLayout",
    "ShortCircuitReader",
    "dataset",
    "epoch_order",
    "epoch_permutation",
    "files",
    "local_first",
    "tfrecord_dataset",
]


def files(dataset: str, pattern: str = "**", *, state_dir: str | None = None) -> list[str]:
    """Sorted paths, relative to the dataset, of its files matching the glob ``pattern``."""
    return list_files(dataset, pattern, state_dir=state_dir)


def dataset(name: str, files: Any, **options: Any):
    """A ``tf.data.Dataset`` of file contents; see :func:`tf_dataset.pipeline.dataset`."""
    from tf_dataset.pipeline import dataset as make_dataset

    return make_dataset(name, files, **options)


def tfrecord_dataset(name: str, files: Any, **options: Any):
    """A ``tf.data.Dataset`` of TFRecord records; see
    :func:`tf_dataset.records.tfrecord_dataset`."""
    from tf_dataset.records import tfrecord_dataset as make_records

    return make_records(name, files, **options)
