"""The peer mounts (bench/suite/peers.py): real s3fs and rclone mounts of a moto bucket, read
through a counting delay proxy. Skipped per peer only when its binary is not installed."""

from __future__ import annotations

import json
import os
import random
import stat

import pytest

from bench.delay_proxy import DelayProxy
from bench.read_bench import BenchmarkFailure
from bench.suite import peers

#: A small nested tree like the suite's (class directories, no directory objects), plus one
#: object large enough for s3fs's parallel ranged GETs and rclone's chunked reads.
LARGE_KEY = "large/shard-0000.tfrecord"


def tree_objects() -> dict[str, bytes]:
    rng = random.Random(5)
    objects = {
        f"small/train/{cls}/{cls}_{i:07d}.JPEG": rng.randbytes(rng.randint(1, 200_000))
        for cls in ("n01440764", "n01443537")
        for i in range(1, 4)
    }
    objects["top.bin"] = b"top-level object"
    objects[LARGE_KEY] = rng.randbytes(40 * 2**20 + 12345)
    return objects


@pytest.fixture(scope="module")
def bucket(moto_s3):
    """A bucket holding tree_objects(); returns (name, objects)."""
    name = moto_s3.make_bucket()
    objects = tree_objects()
    for key, data in objects.items():
        moto_s3.put(name, key, data)
    return name, objects


@pytest.fixture(params=[peers.S3fsMount, peers.RcloneMount], ids=["s3fs", "rclone"])
def peer_class(request):
    missing = peers.available()[request.param.name]
    if missing:
        pytest.skip(missing)
    return request.param


@pytest.fixture
def proxy(moto_s3):
    with DelayProxy(moto_s3.endpoint, 0.0) as running:
        yield running


@pytest.fixture
def mount(peer_class, proxy, bucket, moto_s3, tmp_path):
    peer = peer_class(proxy.url, bucket[0], str(tmp_path), env=moto_s3.env, cache_size=1 << 30)
    with peer:
        yield peer
    assert not peers.is_mounted(peer.root)


def object_gets(proxy: DelayProxy) -> int:
    return proxy.stats()["object_gets"]


def read_tree(root: str, keys) -> dict[str, bytes]:
    """Every key's bytes through the mount, the kernel page cache of each file dropped first,
    so that what a read returns comes from the mount's process (and its disk cache)."""
    contents = {}
    for key in keys:
        with open(os.path.join(root, key), "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            contents[key] = f.readall()
    return contents


def test_reads_are_byte_exact_and_walk_sees_every_file(mount, bucket):
    _, objects = bucket
    walked = {
        os.path.relpath(os.path.join(directory, name), mount.root)
        for directory, _, files in os.walk(mount.root)
        for name in files
    }
    assert walked == set(objects)
    assert sorted(os.listdir(os.path.join(mount.root, "small/train"))) == [
        "n01440764",
        "n01443537",
    ]
    assert read_tree(mount.root, objects) == objects
    assert os.stat(os.path.join(mount.root, LARGE_KEY)).st_size == len(objects[LARGE_KEY])


def test_disk_cache_serves_rereads_and_drop_cache_empties_it(mount, bucket, proxy):
    _, objects = bucket
    before = object_gets(proxy)
    assert read_tree(mount.root, objects) == objects
    cold = object_gets(proxy) - before
    assert cold >= len(objects)  # every object was fetched at least once

    before = object_gets(proxy)
    assert read_tree(mount.root, objects) == objects
    assert object_gets(proxy) == before  # the disk cache answered every read

    old_pid = mount.pid
    mount.drop_cache()
    assert mount.pid != old_pid and peers.is_mounted(mount.root)
    before = object_gets(proxy)
    assert read_tree(mount.root, objects) == objects
    assert object_gets(proxy) - before >= len(objects)


def test_describe_holds_no_secret(mount, moto_s3):
    secret = moto_s3.env["AWS_SECRET_ACCESS_KEY"]
    described = mount.describe()
    assert secret not in json.dumps(described)
    with open(f"/proc/{mount.pid}/cmdline", "rb") as cmdline:
        assert secret.encode() not in cmdline.read()
    assert described["name"] == mount.name
    assert described["version"][0].isdigit()
    assert described["argv"][0] == mount.binary and mount.root in described["argv"]
    assert all(why for why in described["flags"].values())


def test_s3fs_credentials_file_is_private_and_removed_on_stop(proxy, bucket, moto_s3, tmp_path):
    if peers.available()["s3fs"]:
        pytest.skip(peers.available()["s3fs"])
    mount = peers.S3fsMount(proxy.url, bucket[0], str(tmp_path), env=moto_s3.env)
    with mount:
        assert stat.S_IMODE(os.stat(mount.passwd_path).st_mode) == 0o600
        assert f"passwd_file={mount.passwd_path}" in mount.describe()["flags"]
    assert not os.path.exists(mount.passwd_path)


def test_cache_size_bounds_the_cache(peer_class, proxy, bucket, tmp_path):
    flags = peer_class(proxy.url, bucket[0], str(tmp_path), cache_size=1 << 30).flags()
    if peer_class is peers.RcloneMount:
        assert f"--vfs-cache-max-size {1 << 30}B" in flags  # bytes, not rclone's default KiB
    else:  # about (free space - cache_size) MB kept free
        diskfree = next(int(f.split("=")[1]) for f in flags if f.startswith("ensure_diskfree="))
        expected = (peers.free_bytes(str(tmp_path)) - (1 << 30)) >> 20
        assert abs(diskfree - expected) < 1024


def test_a_mount_that_cannot_list_fails_with_its_log(peer_class, monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "MOUNT_TIMEOUT_S", 3.0)
    monkeypatch.setattr(peers, "EXIT_TIMEOUT_S", 1.0)
    mount = peer_class("http://127.0.0.1:9", "no-such-bucket", str(tmp_path))
    with pytest.raises(BenchmarkFailure, match=f"{mount.name} did not mount") as failure:
        mount.start()
    assert mount.log_tail()[-200:] in str(failure.value)  # s3fs logs its retries, rclone not
    assert not peers.is_mounted(mount.root)
    assert mount.pid is None


def test_available_names_both_peers():
    assert set(peers.available()) == {"s3fs", "rclone"}
