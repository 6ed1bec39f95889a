"""A tier's block files on disk: where a block lands, and the fan-out directories it needs
(made before the first block goes into them, and made again if they vanish under the tier)."""

from __future__ import annotations

import os
import shutil

from cachefs.cache.base import KEY_LEN
from cachefs.cache.tier import Tier, TierConfig, prepare_directory


def raw_key(d0: int, d1: int, number: int) -> bytes:
    """A key whose digest starts with the bytes ``d0``, ``d1`` (its fan-out directories)."""
    source_and_shard = bytes(10)
    return source_and_shard + bytes([d0, d1]) + number.to_bytes(KEY_LEN - 12, "big")


def new_tier(path) -> Tier:
    prepare_directory(str(path))
    return Tier(TierConfig("ram", str(path), 1 << 30), tier_id=0)


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_blocks_land_in_fanout_directories_made_as_they_are_needed(tmp_path):
    tier = new_tier(tmp_path)
    fanouts = [(0xAB, 0x01), (0xAB, 0x02), (0xAB, 0x01), (0x00, 0xFF)]
    for file_id, (d0, d1) in enumerate(fanouts, start=1):
        tier.write_block(raw_key(d0, d1, file_id), file_id, b"block %d" % file_id)

    for file_id, (d0, d1) in enumerate(fanouts, start=1):
        path = tier.block_path(raw_key(d0, d1, file_id), file_id)
        assert os.path.dirname(path) == f"{tmp_path}/{d0:02x}/{d1:02x}"
        assert read(path) == b"block %d" % file_id
    assert sorted(os.listdir(tmp_path / "ab")) == ["01", "02"]
    assert os.listdir(tmp_path / "00") == ["ff"]
    assert os.listdir(tmp_path / "tmp") == []  # every block renamed out of it


def test_a_fanout_directory_removed_under_the_tier_is_made_again(tmp_path):
    tier = new_tier(tmp_path)
    first = raw_key(0x12, 0x34, 1)
    tier.write_block(first, 1, b"one")
    tier.remove_block(first, 1)
    shutil.rmtree(tmp_path / "12")  # not cachefs's doing: the tier still thinks it is there

    second = raw_key(0x12, 0x34, 2)
    tier.write_block(second, 2, b"two")

    assert read(tier.block_path(second, 2)) == b"two"
    assert os.listdir(tmp_path / "tmp") == []


def test_a_tier_remembers_the_state_it_wrote_each_block_file_in_until_it_removes_it(
    tmp_path, monkeypatch
):
    """The native READ path splices a block registered with this state without reading it
    first (cachefs_fast_read.c, rule 2), so it must be the written file's own (inode, ctime
    after the rename), only for bytes the tier wrote itself (a file another process wrote came
    with checksums nothing compared with its bytes), gone with the file, and kept for the
    latest blocks only."""
    tier = new_tier(tmp_path)
    written, placed = raw_key(1, 2, 1), raw_key(1, 2, 2)
    tier.write_block(written, 1, b"written here")
    now = os.stat(tier.block_path(written, 1))
    assert tier.written_state(1) == (now.st_ino, now.st_ctime_ns)
    tmp_path_of_placed = tier.tmp_path(placed)
    with open(tmp_path_of_placed, "wb") as f:  # as a preload fetcher writes a reservation
        f.write(b"written by another process")
    tier.place_block(tmp_path_of_placed, placed, 2)
    assert tier.written_state(2) is None

    os.utime(tier.block_path(written, 1))  # a new state: the remembered one no longer matches
    now = os.stat(tier.block_path(written, 1))
    assert tier.written_state(1) != (now.st_ino, now.st_ctime_ns)
    tier.remove_block(written, 1)
    assert tier.written_state(1) is None

    monkeypatch.setattr("cachefs.cache.tier.WRITTEN_STATES_KEPT", 2)
    for file_id in range(3, 6):
        tier.write_block(raw_key(3, 4, file_id), file_id, b"x")
    assert [tier.written_state(n) is not None for n in range(3, 6)] == [False, True, True]


def test_a_block_whose_placed_file_cannot_be_looked_at_is_kept_without_a_state(
    tmp_path, monkeypatch
):
    """The state is an optimisation: a stat that fails after the rename leaves the block in
    place, written whole, and remembers nothing for it."""
    tier = new_tier(tmp_path)
    raw = raw_key(5, 6, 1)

    def failing_stat(fd, *args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr("cachefs.cache.tier.os.fstat", failing_stat)
    tier.write_block(raw, 1, b"kept")
    monkeypatch.undo()
    assert read(tier.block_path(raw, 1)) == b"kept"
    assert tier.written_state(1) is None
