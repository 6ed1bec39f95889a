"""tf_dataset end to end: a real `cachefs up` worker process with a real FUSE mount over moto S3
(behind the fault proxy, which counts the GETs reaching the store), read by real tf.data
pipelines and a small Keras model."""

from __future__ import annotations

import math
import os
import random
import time
import uuid
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from tests.worker_process import WorkerProcess, drop_page_cache

tf = pytest.importorskip("tensorflow")  # a guard only: CI installs the [tf] extra

import tf_dataset  # noqa: E402
from tf_dataset.order import epoch_order, epoch_permutation  # noqa: E402
from tf_dataset.reader import ShortCircuitReader  # noqa: E402

BLOCK = 64 * 1024


def image_like_objects(count: int = 48, seed: int = 5) -> dict[str, bytes]:
    rng = random.Random(seed)
    objects = {
        f"train/n{k % 4:02d}/img_{k:04d}.jpg": rng.randbytes(rng.randint(1, 3 * BLOCK))
        for k in range(count)
    }
    objects["train/n00/empty.jpg"] = b""
    return objects


@pytest.fixture
def start_world(moto_s3, fault_proxy, tmp_path):
    started = []

    def start(objects: dict[str, bytes], name: str = "ds") -> SimpleNamespace:
        bucket = f"cachefs-{uuid.uuid4().hex[:12]}"
        moto_s3.make_bucket(bucket)
        for key, data in objects.items():
            moto_s3.put(bucket, f"{name}/{key}", data)
        worker = WorkerProcess(str(tmp_path / f"w{len(started)}"), env=moto_s3.env).start()
        started.append(worker)
        worker.add_dataset(
            name, f"s3://{bucket}/{name}", endpoint=fault_proxy.url, block_size=BLOCK, timeout_s=5
        )
        return SimpleNamespace(worker=worker, objects=objects, proxy=fault_proxy, name=name)

    yield start
    for worker in started:
        worker.cleanup()


def wait_for_hints_processed(worker: WorkerProcess, timeout: float = 60.0) -> None:
    """Poll until the worker's prefetch queue is empty (waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while worker.status()["prefetch"]["queued_files"]:
        assert time.monotonic() < deadline, "the prefetch queue never drained"
        time.sleep(0.05)


def store_gets(world) -> int:
    return world.proxy.count("GET", path_contains=f"/{world.name}/")


def epoch(ds) -> list[tuple[str, bytes]]:
    return [(path.decode(), contents) for path, contents in ds.as_numpy_iterator()]


def test_files_lists_the_dataset_through_the_mount(start_world):
    world = start_world(image_like_objects())
    state = world.worker.state
    assert tf_dataset.files("ds", "**", state_dir=state) == sorted(world.objects)
    assert tf_dataset.files("ds", "train/n01/*.jpg", state_dir=state) == sorted(
        key for key in world.objects if key.startswith("train/n01/")
    )


@pytest.mark.parametrize("read_mode", ["link", "python"])
def test_epochs_are_byte_exact_seeded_and_warm_epochs_skip_fuse_and_the_store(
    start_world, read_mode
):
    world = start_world(image_like_objects())
    worker, objects = world.worker, world.objects
    paths = sorted(objects)
    ds = tf_dataset.dataset(
        "ds",
        paths,
        seed=7,
        window=16,
        chunk=4,
        with_paths=True,
        state_dir=worker.state,
        read_mode=read_mode,
    )
    assert ds.cardinality().numpy() == len(paths)
    first = epoch(ds)
    assert sorted(path for path, _ in first) == paths, "every file exactly once"
    assert all(contents == objects[path] for path, contents in first)
    total_blocks = sum(math.ceil(len(data) / BLOCK) for data in objects.values())
    # Hints and reads share fetches: every block came from the store exactly once.
    assert store_gets(world) == total_blocks
    wait_for_hints_processed(worker)
    prefetch = worker.status()["prefetch"]
    assert prefetch["hinted_files"] > 0
    assert prefetch["blocks_fetched"] + prefetch["blocks_cached"] > 0

    hits_before = worker.status()["reads"]["hits"]
    short_before = ds.reader.stats.as_dict()["short_circuit_files"]
    drop_page_cache()
    second = epoch(ds)
    assert [p for p, _ in second] != [p for p, _ in first], "each epoch is shuffled anew"
    assert all(contents == objects[path] for path, contents in second)
    short_circuited = ds.reader.stats.as_dict()["short_circuit_files"] - short_before
    if read_mode == "python":
        assert short_circuited == len(paths)
        assert worker.status()["reads"]["hits"] == hits_before, "a warm epoch went through FUSE"
    else:  # links to one-block files; larger (and empty) files are read through the mount
        assert short_circuited == sum(1 for data in objects.values() if 0 < len(data) <= BLOCK)
    assert store_gets(world) == total_blocks
    if read_mode == "link":  # every link was removed once its chunk was read
        assert os.listdir(ds.source.links.root) == []

    # Another pipeline with the same seed reads the same order; everything is cached, so the
    # order is exactly the seeded permutation (no locality reordering to do).
    again = tf_dataset.dataset(
        "ds",
        paths,
        seed=7,
        window=16,
        chunk=4,
        with_paths=True,
        state_dir=worker.state,
        read_mode=read_mode,
    )
    expected = [paths[i] for i in epoch_permutation(len(paths), seed=7, epoch=0)]
    assert [p for p, _ in epoch(again)] == expected


def test_local_files_are_read_first_within_each_window(start_world):
    world = start_world(image_like_objects())
    worker, objects = world.worker, world.objects
    paths = sorted(objects)
    cached = set(paths[::3])
    for path in cached:
        with open(worker.path("ds", path), "rb") as f:
            f.read()
    ds = tf_dataset.dataset(
        "ds",
        paths,
        seed=3,
        window=8,
        chunk=3,
        with_paths=True,
        hints=False,
        state_dir=worker.state,
        read_mode="python",
    )
    order = [path for path, _ in epoch(ds)]
    local = [path in cached for path in paths]
    assert order == [paths[i] for i in epoch_order(local, seed=3, epoch=0, window=8)]
    assert ds.reader.stats.as_dict()["short_circuit_files"] == len(cached)


def test_unshuffled_dataset_keeps_the_given_order_without_paths(start_world):
    world = start_world(image_like_objects(count=10))
    paths = sorted(world.objects, reverse=True)
    ds = tf_dataset.dataset("ds", paths, shuffle=False, chunk=3, state_dir=world.worker.state)
    assert list(ds.as_numpy_iterator()) == [world.objects[p] for p in paths]


def test_a_small_keras_model_trains_for_an_epoch_from_the_mount(start_world):
    rng = np.random.default_rng(0)
    weights = rng.normal(size=8).astype(np.float32)
    objects = {}
    for k in range(64):
        features = rng.normal(size=8).astype(np.float32)
        target = np.float32(features @ weights)
        objects[f"samples/{k:03d}.f32"] = np.append(features, target).astype("<f4").tobytes()
    world = start_world(objects, name="nums")
    batch = 8

    def decode(contents):
        row = tf.io.decode_raw(contents, tf.float32)
        row.set_shape([9])
        return row[:8], row[8:]

    ds = tf_dataset.dataset("nums", "samples/*.f32", seed=1, state_dir=world.worker.state)
    ds = ds.map(decode, num_parallel_calls=tf.data.AUTOTUNE).batch(batch)

    class CountSteps(tf.keras.callbacks.Callback):
        steps = 0

        def on_train_batch_end(self, step, logs=None):
            CountSteps.steps += 1

    model = tf.keras.Sequential([tf.keras.Input(shape=(8,)), tf.keras.layers.Dense(1)])
    model.compile(optimizer=tf.keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(ds, epochs=1, shuffle=False, callbacks=[CountSteps()], verbose=0)
    assert CountSteps.steps == len(objects) // batch
    assert all(math.isfinite(loss) for loss in history.history["loss"])


def write_tfrecord_shards(tmp_path, shards: int, records: int) -> dict[str, list[bytes]]:
    rng = random.Random(1)
    contents = {}
    for shard in range(shards):
        path = tmp_path / f"train-{shard:03d}.tfrecord"
        written = [
            f"shard {shard} record {r} ".encode() + rng.randbytes(rng.randint(0, BLOCK // 3))
            for r in range(records)
        ]
        with tf.io.TFRecordWriter(str(path)) as writer:
            for record in written:
                writer.write(record)
        contents[path.name] = written
    return contents


def test_tfrecord_dataset_reads_every_record_and_local_shards_first(start_world, tmp_path):
    records = write_tfrecord_shards(tmp_path, shards=5, records=30)
    objects = {name: (tmp_path / name).read_bytes() for name in records}
    assert any(len(data) > 2 * BLOCK for data in objects.values())  # shards span blocks
    world = start_world(objects, name="tfr")
    worker = world.worker
    local_shard = "train-003.tfrecord"
    with open(worker.path("tfr", local_shard), "rb") as f:
        f.read()
    ds = tf_dataset.tfrecord_dataset(
        "tfr", "train-*.tfrecord", seed=2, cycle_length=1, state_dir=worker.state
    )
    got = list(ds.as_numpy_iterator())
    expected = [record for shard in records.values() for record in shard]
    assert Counter(got) == Counter(expected)
    # cycle_length=1 reads shard after shard: the one cached here comes first.
    assert got[: len(records[local_shard])] == records[local_shard]
    second = list(ds.as_numpy_iterator())
    assert Counter(second) == Counter(expected)
    assert worker.status()["prefetch"]["hinted_files"] > 0


@pytest.mark.parametrize("read_mode", ["link", "python"])
def test_pipeline_reads_through_the_mount_when_short_circuit_files_are_damaged(
    start_world, read_mode
):
    world = start_world(image_like_objects(count=12))
    worker, objects = world.worker, world.objects
    paths = sorted(objects)
    for path in paths:
        with open(worker.path("ds", path), "rb") as f:
            f.read()
    reader = ShortCircuitReader("ds", state_dir=worker.state)
    for layout in reader.resolve(paths):
        for block in layout.blocks:
            os.unlink(block.file)  # behind the worker's back: every short-circuit read fails
    drop_page_cache()
    ds = tf_dataset.dataset(
        "ds", paths, seed=0, with_paths=True, reader=reader, hints=False, read_mode=read_mode
    )
    for path, contents in epoch(ds):
        assert contents == objects[path], path
    stats = reader.stats.as_dict()
    if read_mode == "python":
        assert stats["fallback_files"] == sum(1 for data in objects.values() if data)
    else:
        assert stats["fallback_files"] == sum(1 for d in objects.values() if 0 < len(d) <= BLOCK)
    assert stats["short_circuit_files"] == 0 or read_mode == "python"
    assert stats["short_circuit_files"] + stats["fallback_files"] + stats["mount_files"] >= len(
        paths
    )
