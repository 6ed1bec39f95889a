"""tf_dataset end to end: a real `cachefs up` worker process with a real FUSE mount over moto S3
(behind the fault proxy, which counts the GETs reaching the store), read by real tf.data
pipelines and a small Keras model."""

from __future__ import annotations

import math
import os
import random
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from tests.waiting import WAIT_S
from tests.worker_process import WorkerProcess, drop_page_cache, start_s3_world

tf = pytest.importorskip("tensorflow")  # a guard only: CI installs the [tf] extra

import tf_dataset  # noqa: E402
from tf_dataset import native, pipeline  # noqa: E402
from tf_dataset.order import epoch_order, epoch_permutation  # noqa: E402
from tf_dataset.reader import ShortCircuitReader  # noqa: E402

BLOCK = 64 * 1024
#: Both read engines: the native kernel (built by scripts/setup.sh) and its Python reference.
ENGINES = ["native", "python"]


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
        world = start_s3_world(
            moto_s3,
            fault_proxy,
            str(tmp_path / f"w{len(started)}"),
            objects,
            name=name,
            block_size=BLOCK,
        )
        started.append(world.worker)
        return world

    yield start
    for worker in started:
        worker.cleanup()


def wait_for_hints_processed(worker: WorkerProcess, timeout: float = WAIT_S) -> None:
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


@pytest.mark.parametrize("engine", ENGINES)
def test_epochs_are_byte_exact_seeded_and_warm_epochs_skip_fuse_and_the_store(start_world, engine):
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
        engine=engine,
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
    stats_before = ds.reader.stats.as_dict()
    hinted_before = worker.status()["prefetch"]["hinted_files"]
    drop_page_cache()
    second = epoch(ds)
    assert [p for p, _ in second] != [p for p, _ in first], "each epoch is shuffled anew"
    assert all(contents == objects[path] for path, contents in second)
    stats = ds.reader.stats.as_dict()
    assert stats["short_circuit_files"] - stats_before["short_circuit_files"] == len(paths)
    assert stats["short_circuit_bytes"] - stats_before["short_circuit_bytes"] == sum(
        len(data) for data in objects.values()
    )
    assert stats["mount_files"] == stats_before["mount_files"]
    assert worker.status()["reads"]["hits"] == hits_before, "a warm epoch went through FUSE"
    assert worker.status()["prefetch"]["hinted_files"] == hinted_before, "a warm epoch hinted"
    assert store_gets(world) == total_blocks

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
        engine=engine,
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


def start_tfrecord_world(start_world, tmp_path, shards: int, records: int):
    """A dataset "tfr" of TFRecord shards that each span several blocks; the records of each
    shard by its name."""
    written = write_tfrecord_shards(tmp_path, shards=shards, records=records)
    objects = {name: (tmp_path / name).read_bytes() for name in written}
    assert all(len(data) > 2 * BLOCK for data in objects.values())  # shards span blocks
    return start_world(objects, name="tfr"), written


def test_tfrecord_dataset_reads_every_record_and_local_shards_first(start_world, tmp_path):
    world, records = start_tfrecord_world(start_world, tmp_path, shards=5, records=30)
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


@pytest.mark.parametrize("engine", ENGINES)
def test_pipeline_reads_through_the_mount_when_short_circuit_files_are_damaged(start_world, engine):
    world = start_world(image_like_objects(count=12))
    worker, objects = world.worker, world.objects
    paths = sorted(objects)
    for path in paths:
        with open(worker.path("ds", path), "rb") as f:
            f.read()
    reader = ShortCircuitReader("ds", state_dir=worker.state)
    layouts = reader.resolve(paths)
    # Behind the worker's back, the last block of every non-empty file, in three ways by turns.
    damage = {}
    for path, layout in zip(paths, layouts, strict=True):
        if not layout.blocks:
            continue
        block = layout.blocks[-1]
        damage[path] = ("evicted", "flipped", "short")[len(damage) % 3]
        if damage[path] == "evicted":
            os.unlink(block.file)
        elif damage[path] == "flipped":  # same length, one byte off: only the checksum tells
            with open(block.file, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 1]))
        else:
            os.truncate(block.file, block.length - 1)
    assert set(damage.values()) == {"evicted", "flipped", "short"}
    damaged = set(damage)
    drop_page_cache()
    ds = tf_dataset.dataset(
        "ds", paths, seed=0, with_paths=True, reader=reader, hints=False, engine=engine
    )
    for path, contents in epoch(ds):
        assert contents == objects[path], path
    stats = reader.stats.as_dict()
    assert stats["fallback_files"] == len(damaged) == sum(1 for data in objects.values() if data)
    assert stats["short_circuit_files"] == len(paths) - len(damaged)  # the empty file
    assert stats["mount_files"] == len(damaged)

    # The mount reads cached the files again (new block files): the next epoch asks the worker
    # about the files that failed and reads them by short-circuit again.
    for path, contents in epoch(ds):
        assert contents == objects[path], path
    after = reader.stats.as_dict()
    assert after["short_circuit_files"] - stats["short_circuit_files"] == len(paths)
    assert after["fallback_files"] == stats["fallback_files"]


@pytest.mark.parametrize("engine", ENGINES)
def test_the_next_epoch_after_a_refresh_reads_the_new_version(start_world, moto_s3, engine):
    """A file changed in the store and the dataset refreshed: its old block files are still
    cached and still match their checksums, so only the snapshot check keeps the next epoch
    from reading the old version by short-circuit."""
    world = start_world(image_like_objects(count=8))
    worker, objects = world.worker, dict(world.objects)
    paths = sorted(objects)
    ds = tf_dataset.dataset(
        "ds", paths, seed=1, with_paths=True, state_dir=worker.state, engine=engine
    )
    assert dict(epoch(ds)) == objects
    assert dict(epoch(ds)) == objects
    changed = paths[1]
    old_layout = ds.reader.resolve([changed])[0]
    assert old_layout.local and old_layout.blocks
    objects[changed] = b"the new version " + os.urandom(BLOCK)
    moto_s3.put(world.bucket, f"ds/{changed}", objects[changed])
    worker.client.refresh_dataset("ds")
    assert all(os.path.exists(block.file) for block in old_layout.blocks), "old blocks gone"
    assert dict(epoch(ds)) == objects
    assert dict(epoch(ds)) == objects


def test_an_unbuilt_native_engine_says_how_to_build_it_and_auto_reads_in_python(
    start_world, monkeypatch, caplog
):
    world = start_world(image_like_objects(count=6))
    paths = sorted(world.objects)
    monkeypatch.setattr(native, "library_path", lambda: "/nonexistent/_cachefs_ops.so")
    native.load.cache_clear()
    monkeypatch.setattr(pipeline, "_warned_python_engine", False)
    try:
        with pytest.raises(native.NativeUnavailable, match=r"python -m tf_dataset\.native"):
            tf_dataset.dataset("ds", paths, state_dir=world.worker.state, engine="native")
        with caplog.at_level("WARNING", logger="tf_dataset.pipeline"):
            ds = tf_dataset.dataset("ds", paths, with_paths=True, state_dir=world.worker.state)
        assert "without its native kernels" in caplog.text
        assert dict(epoch(ds)) == world.objects
        with pytest.raises(ValueError, match="engine must be one of"):
            tf_dataset.dataset("ds", paths, state_dir=world.worker.state, engine="fast")
    finally:
        native.load.cache_clear()


def test_tfrecord_shards_cached_here_are_read_from_their_blocks(start_world, tmp_path):
    world, records = start_tfrecord_world(start_world, tmp_path, shards=4, records=40)
    worker, objects = world.worker, world.objects
    for name in objects:  # cache every shard
        with open(worker.path("tfr", name), "rb") as f:
            f.read()
    expected = Counter(record for shard in records.values() for record in shard)
    hits_before = worker.status()["reads"]["hits"]
    ds = tf_dataset.tfrecord_dataset(
        "tfr", "train-*.tfrecord", seed=2, cycle_length=2, state_dir=worker.state, engine="native"
    )
    assert Counter(ds.as_numpy_iterator()) == expected
    stats = ds.reader.stats.as_dict()
    assert stats["short_circuit_files"] == len(objects) and stats["mount_files"] == 0
    assert stats["short_circuit_bytes"] == sum(len(data) for data in objects.values())
    assert worker.status()["reads"]["hits"] == hits_before, "a cached shard went through FUSE"

    # Blocks damaged behind the worker's back: the first of one shard, a middle one of
    # another, the last of a third. Each of those shards is read from its blocks up to the bad
    # one and through the mount after it, skipping the records already given: every record
    # once, whole, and each shard's records in their order.
    shards = sorted(objects)
    for shard, which in zip(shards, (0, 1, -1), strict=False):
        layout = ds.reader.resolve([shard])[0]
        assert len(layout.blocks) >= 3
        with open(layout.blocks[which].file, "r+b") as f:
            f.write(b"\0\0\0\0")
    drop_page_cache()
    got = list(ds.as_numpy_iterator())
    assert Counter(got) == expected
    for number, shard in enumerate(shards):
        prefix = f"shard {number} record ".encode()
        assert [r for r in got if r.startswith(prefix)] == records[shard], shard
    after = ds.reader.stats.as_dict()
    assert after["fallback_files"] == 3 and after["mount_files"] == 3
    assert after["short_circuit_files"] == stats["short_circuit_files"] + len(objects) - 3

    # Without the native kernels (records need TensorFlow's crc32c) every shard is read through
    # the mount.
    plain = tf_dataset.tfrecord_dataset(
        "tfr", "train-*.tfrecord", seed=2, state_dir=worker.state, engine="python"
    )
    assert Counter(plain.as_numpy_iterator()) == expected
    plain_stats = plain.reader.stats.as_dict()
    assert plain_stats["short_circuit_files"] == 0
    assert plain_stats["mount_files"] == len(objects)
