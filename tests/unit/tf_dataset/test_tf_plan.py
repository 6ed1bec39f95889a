"""LocalBlocks, the numpy table of which files are cached here and in which blocks, against a
plain dict model through random learn / forget / forget_all sequences (growth and compaction
included). Pure logic: no worker."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("tensorflow")  # tf_dataset.pipeline imports it; CI installs the [tf] extra

import tf_dataset
from tf_dataset.pipeline import LocalBlocks
from tf_dataset.reader import CachedBlock

FILES = 50


def random_blocks(rng: random.Random, index: int, version: int) -> list[CachedBlock]:
    return [
        CachedBlock(f"/tier/{index}-{version}-{b}", rng.randint(0, 9), rng.getrandbits(64))
        for b in range(rng.choice([0, 1, 1, 1, 2, 7]))
    ]


def assert_gather_matches(table: LocalBlocks, model: dict, indices: list[int]) -> None:
    local, splits, files, lengths, checksums = table.gather(np.array(indices, dtype=np.int64))
    assert local.tolist() == [i in model for i in indices]
    assert splits[0] == 0 and len(splits) == len(indices) + 1
    for position, index in enumerate(indices):
        rows = slice(splits[position], splits[position + 1])
        blocks = model.get(index, [])
        assert [f.decode() for f in files[rows]] == [block.file for block in blocks]
        assert lengths[rows].tolist() == [block.length for block in blocks]
        # Checksums travel as int64 (TensorFlow's type): the same 64 bits.
        assert checksums[rows].view(np.uint64).tolist() == [block.checksum for block in blocks]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slack", [1024, 4])
def test_the_table_answers_as_a_dict_would(seed, slack, monkeypatch):
    monkeypatch.setattr(LocalBlocks, "COMPACT_SLACK", slack)  # 4: compactions happen here
    compactions = []
    compact = LocalBlocks._compact
    monkeypatch.setattr(
        LocalBlocks, "_compact", lambda self: (compactions.append(1), compact(self))
    )
    rng = random.Random(seed)
    table, model = LocalBlocks(FILES), {}
    most_live = 0
    for version in range(400):
        action = rng.random()
        if action < 0.6:
            indices = rng.sample(range(FILES), rng.randint(1, 10))
            layouts = [random_blocks(rng, index, version) for index in indices]
            table.learn(indices, layouts)
            model.update(zip(indices, layouts, strict=True))
        elif action < 0.97:
            forgotten = rng.sample(range(FILES), rng.randint(1, 5))
            table.forget(np.array(forgotten, dtype=np.int64))
            for index in forgotten:
                model.pop(index, None)
        else:
            table.forget_all()
            model.clear()
        assert table.known.tolist() == [i in model for i in range(FILES)]
        assert_gather_matches(table, model, rng.choices(range(FILES), k=rng.randint(0, 20)))
        live = sum(len(blocks) for blocks in model.values())
        assert table._live == live
        # Garbage (rows of relearned or forgotten files) is compacted away before the columns
        # grow: their size stays bounded by the most blocks ever live (learn adds <= 70 rows).
        most_live = max(most_live, live)
        assert len(table._files) <= 4 * most_live + 2 * slack + 2 * 70
    assert compactions if slack == 4 else not compactions


def test_an_empty_query_and_an_empty_table():
    table = LocalBlocks(0)
    local, splits, files, lengths, checksums = table.gather(np.array([], dtype=np.int64))
    assert local.size == files.size == lengths.size == checksums.size == 0
    assert splits.tolist() == [0]
    table.learn([], [])
    assert table._rows == 0


@pytest.mark.parametrize("path", ["a/../b", "../outside", "a//b", "./a", "a/.", "a/b\0c", ""])
def test_paths_that_leave_the_dataset_or_name_nothing_are_refused(path):
    with pytest.raises(ValueError, match="not a path of a file inside dataset 'ds'"):
        tf_dataset.dataset("ds", ["ok/file", path], engine="python")
