"""Shard ownership by rendezvous hashing (:func:`cachefs.protocol.shard_owner`): deterministic,
total, balanced, and minimal movement when a node leaves or joins."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from cachefs.protocol import SHARDS, owner_table, shard_owner

FOUR = ["node-a", "node-b", "node-c", "node-d"]
DATASETS = ["imagenet", "coco", "x", "a-very-long-dataset-name.v2_final"]


@pytest.mark.parametrize("dataset", DATASETS)
def test_deterministic_and_independent_of_node_order(dataset: str) -> None:
    table = owner_table(dataset, FOUR)
    assert len(table) == SHARDS
    assert owner_table(dataset, FOUR) == table
    assert owner_table(dataset, list(reversed(FOUR))) == table
    assert owner_table(dataset, tuple(sorted(FOUR, key=hash))) == table
    assert [shard_owner(dataset, shard, FOUR) for shard in range(SHARDS)] == table


def test_same_answer_in_another_process() -> None:
    """No per-process salt (Python's str hash is randomised per process; xxhash is not)."""
    code = (
        "from cachefs.protocol import owner_table; "
        f"print(','.join(owner_table('imagenet', {FOUR!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().split(",") == owner_table("imagenet", FOUR)


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_shard_has_an_owner_among_the_nodes(dataset: str) -> None:
    for nodes in (["solo"], FOUR[:2], FOUR, [f"n{i}" for i in range(17)]):
        table = owner_table(dataset, nodes)
        assert all(owner in nodes for owner in table)


def test_no_nodes_no_owner() -> None:
    assert shard_owner("imagenet", 0, []) is None
    assert owner_table("imagenet", ()) == [None] * SHARDS


@pytest.mark.parametrize("dataset", DATASETS)
def test_roughly_balanced(dataset: str) -> None:
    counts = Counter(owner_table(dataset, FOUR))
    assert set(counts) == set(FOUR)
    for node in FOUR:
        assert 0.15 * SHARDS <= counts[node] <= 0.35 * SHARDS, counts


def test_datasets_are_placed_independently() -> None:
    a, b = owner_table("imagenet", FOUR), owner_table("coco", FOUR)
    same = sum(x == y for x, y in zip(a, b, strict=True))
    # Independent placements agree on about a quarter of the shards, not all of them.
    assert 0.15 * SHARDS < same < 0.35 * SHARDS


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("leaving", FOUR)
def test_removing_a_node_moves_only_its_shards(dataset: str, leaving: str) -> None:
    before = owner_table(dataset, FOUR)
    after = owner_table(dataset, [n for n in FOUR if n != leaving])
    moved = 0
    for shard, (old, new) in enumerate(zip(before, after, strict=True)):
        if old == leaving:
            assert new != leaving
            moved += 1
        else:
            assert new == old, f"shard {shard} moved from {old} to {new}"
    assert moved == before.count(leaving) > 0
    # The orphaned shards spread over the remaining nodes, not onto one.
    heirs = Counter(new for old, new in zip(before, after, strict=True) if old == leaving)
    assert len(heirs) == 3


@pytest.mark.parametrize("dataset", DATASETS)
def test_adding_a_node_moves_shards_only_to_it(dataset: str) -> None:
    before = owner_table(dataset, FOUR)
    after = owner_table(dataset, [*FOUR, "node-e"])
    moved = 0
    for shard, (old, new) in enumerate(zip(before, after, strict=True)):
        if new != old:
            assert new == "node-e", f"shard {shard} moved from {old} to {new}"
            moved += 1
    # It takes about a fifth of the shards, from every old node.
    assert 0.1 * SHARDS <= moved <= 0.3 * SHARDS
    donors = {old for old, new in zip(before, after, strict=True) if new == "node-e"}
    assert donors == set(FOUR)
