"""The worker's side of the cluster: :class:`Membership` (shard owners from the coordinator's
view) and :func:`plan` (which blocks a preload selection picks, per shard) on real snapshots
built with :func:`cachefs.meta.build_snapshot`."""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachefs.cache.base import key_hash_of, shard_of
from cachefs.cluster.membership import Membership
from cachefs.cluster.planning import PlannedObject, _ShardBudget, path_matches, plan
from cachefs.meta import Snapshot, build_snapshot
from cachefs.protocol import SHARDS, DatasetSpec, owner_table
from cachefs.store.base import ObjectInfo
from coordinator.service import Coordinator
from coordinator.settings import CoordinatorSettings
from coordinator.state import LmdbStateStore

BS = 4096  # block size for planning

# --- Membership ----------------------------------------------------------------------------------


def address(node: str) -> str:
    return f"127.0.0.{int(node.removeprefix('n')) + 1}:7070"


def make_view(
    live: dict[str, list[str]] | list[str], down=(), dataset="imagenet", fills=None
) -> dict:
    copies = {"A": live} if isinstance(live, list) else live
    sources = {n for fill in (fills or {}).values() for n in fill["from"]}
    everyone = sorted({n for nodes in copies.values() for n in nodes} | set(down) | sources)
    entry = {"spec": {"name": dataset}, "refresh_epoch": 0, "copies": copies}
    if fills is not None:
        entry["fills"] = fills
    return {
        "cluster_id": "c0ffee",
        "heartbeat_interval_s": 1.0,
        "nodes": {n: {"address": address(n), "up": n not in down} for n in everyone},
        "datasets": [entry],
        "preloads": [],
    }


def test_no_view_means_no_peer_and_owning_everything() -> None:
    membership = Membership("n1")
    assert all(membership.owner_address("imagenet", s) is None for s in range(SHARDS))
    assert membership.owned_shards("imagenet", "A", ["n1"]) == set(range(SHARDS))
    expected = {s for s, o in enumerate(owner_table("imagenet", ["n1", "n2"])) if o == "n1"}
    assert membership.owned_shards("imagenet", "A", ["n2", "n1"]) == expected


def test_owner_address_and_owned_shards() -> None:
    nodes = ["n1", "n2", "n3"]
    membership = Membership("n2")
    assert membership.update(make_view(nodes)) is True
    assert membership.addresses == {"n1": address("n1"), "n3": address("n3")}
    table = owner_table("imagenet", nodes)
    for shard, owner in enumerate(table):
        expected = None if owner == "n2" else address(owner)
        assert membership.owner_address("imagenet", shard) == expected
    own = membership.owned_shards("imagenet", "A", nodes)
    assert own == {s for s, o in enumerate(table) if o == "n2"}
    assert 0 < len(own) < SHARDS
    # Self is never returned as a peer address.
    assert address("n2") not in {membership.owner_address("imagenet", s) for s in range(SHARDS)}
    # A dataset not in the view: no peer.
    assert membership.owner_address("coco", 0) is None


def test_update_reports_changes_only() -> None:
    membership = Membership("n1")
    assert membership.update(make_view(["n1", "n2"])) is True
    assert membership.update(make_view(["n2", "n1"])) is False  # same set, any order
    # n2 is down: its shards come to n1, which fetches them itself.
    assert membership.update(make_view(["n1"], down=["n2"])) is True
    assert membership.addresses == {"n2": address("n2")}
    assert all(membership.owner_address("imagenet", s) is None for s in range(SHARDS))
    assert membership.owned_shards("imagenet", "A", ["n1"]) == set(range(SHARDS))
    # The dataset disappears from the view.
    empty = {**make_view(["n1"]), "datasets": []}
    assert membership.update(empty) is True
    assert membership.update(empty) is False


def test_a_node_reads_through_its_own_copy() -> None:
    copies = {"A": ["n1", "n2"], "B": ["n3", "n4"]}
    in_b = Membership("n3")
    in_b.update(make_view(copies))
    table_b = owner_table("imagenet", ["n3", "n4"])
    for shard, owner in enumerate(table_b):
        expected = None if owner == "n3" else address(owner)
        assert in_b.owner_address("imagenet", shard) == expected
    # A node in no copy reads through the first one.
    outsider = Membership("n9")
    outsider.update(make_view(copies))
    table_a = owner_table("imagenet", ["n1", "n2"])
    assert [outsider.owner_address("imagenet", s) for s in range(SHARDS)] == [
        address(o) for o in table_a
    ]
    # owned_shards for another copy than its own: computed from the live nodes given.
    assert in_b.owned_shards("imagenet", "A", ["n1", "n3"]) == {
        s for s, o in enumerate(owner_table("imagenet", ["n1", "n3"])) if o == "n3"
    }
    assert in_b.owned_shards("imagenet", "B", ["ignored"]) == {
        s for s, o in enumerate(table_b) if o == "n3"
    }


def test_an_owner_without_a_known_address_is_no_peer() -> None:
    view = make_view(["n1", "n2"])
    del view["nodes"]["n2"]
    membership = Membership("n1")
    membership.update(view)
    assert all(membership.owner_address("imagenet", s) is None for s in range(SHARDS))


def test_fill_address_and_assignments_of_a_clone() -> None:
    """Copy B (n3, n4) is filled from copy A (n1, n2): each shard's fill source is its owner in
    A, and a node of B copies the shards it owns in B."""
    copies = {"A": ["n1", "n2"], "B": ["n3", "n4"]}
    fills = {"B": {"id": "B-1", "from": ["n2", "n1"]}}
    view = make_view(copies, fills=fills)
    table_a = owner_table("imagenet", ["n1", "n2"])
    table_b = owner_table("imagenet", ["n3", "n4"])
    n3 = Membership("n3")
    assert n3.update(view) is True
    for shard in range(SHARDS):
        assert n3.fill_address("imagenet", shard) == address(table_a[shard])
    assignment = n3.fill_assignments()["imagenet"]
    assert (assignment.dataset, assignment.copy, assignment.fill_id) == ("imagenet", "B", "B-1")
    assert assignment.shards == {s for s, o in enumerate(table_b) if o == "n3"}
    assert n3.own_copy_shards("imagenet") == set(assignment.shards)
    # The nodes of copy A are not filled: no fill source, nothing to copy.
    n1 = Membership("n1")
    n1.update(view)
    assert n1.fill_assignments() == {}
    assert all(n1.fill_address("imagenet", s) is None for s in range(SHARDS))
    assert n3.fill_address("coco", 0) is None


def test_fill_of_a_scaled_copy_skips_shards_this_node_held() -> None:
    """Copy A grew from (n1, n2) to (n1, n2, n3): the shards n3 took over are filled from
    their previous owner; a shard whose fill source is this node itself needs no copy."""
    view = make_view(["n1", "n2", "n3"], fills={"A": {"id": "A-2", "from": ["n1", "n2"]}})
    before = owner_table("imagenet", ["n1", "n2"])
    after = owner_table("imagenet", ["n1", "n2", "n3"])
    for node in ("n1", "n2", "n3"):
        membership = Membership(node)
        membership.update(view)
        for shard in range(SHARDS):
            expected = None if before[shard] == node else address(before[shard])
            assert membership.fill_address("imagenet", shard) == expected
        shards = membership.fill_assignments()["imagenet"].shards
        # Rendezvous moves shards only to the new node: the others keep what they held.
        expected = {s for s in range(SHARDS) if after[s] == node and before[s] != node}
        assert shards == expected
        assert bool(shards) == (node == "n3")


def test_update_reports_fill_changes() -> None:
    copies = {"A": ["n1"], "B": ["n2"]}
    membership = Membership("n2")
    assert membership.update(make_view(copies)) is True
    assert membership.fill_assignments() == {}
    fill = {"B": {"id": "B-1", "from": ["n1"]}}
    assert membership.update(make_view(copies, fills=fill)) is True
    assert membership.update(make_view(copies, fills=fill)) is False
    assert membership.fill_assignments()["imagenet"].shards == frozenset(range(SHARDS))
    # A new fill id, or other source nodes, is a change.
    assert membership.update(make_view(copies, fills={"B": {"id": "B-2", "from": ["n1"]}}))
    other = {"B": {"id": "B-2", "from": ["n1", "n3"]}}
    assert membership.update(make_view(copies, fills=other)) is True
    # A fill of another copy is not this node's.
    assert membership.update(make_view(copies, fills={"A": {"id": "A-1", "from": ["n2"]}}))
    assert membership.fill_assignments() == {}
    assert membership.fill_address("imagenet", 0) is None
    # No sources left: a fill with nothing to copy.
    assert membership.update(make_view(copies, fills={"B": {"id": "B-2", "from": []}}))
    assert membership.fill_assignments()["imagenet"].shards == frozenset()
    assert membership.update(make_view(copies, fills={})) is True


def test_own_copy_shards_of_a_node_in_no_copy_is_empty() -> None:
    membership = Membership("n9")
    membership.update(make_view(["n1", "n2"]))
    assert membership.own_copy_shards("imagenet") == set()
    assert membership.own_copy_shards("coco") == set()
    n1 = Membership("n1")
    n1.update(make_view(["n1", "n2"]))
    table = owner_table("imagenet", ["n1", "n2"])
    assert n1.own_copy_shards("imagenet") == {s for s, o in enumerate(table) if o == "n1"}


def test_membership_agrees_with_the_coordinator(tmp_path: Path) -> None:
    store = LmdbStateStore(tmp_path / "state")
    try:
        coordinator = Coordinator(store, CoordinatorSettings(heartbeat_interval_s=1.0))
        coordinator.add_dataset(DatasetSpec(name="imagenet", uri="s3://b/imagenet/"))
        for node in ("n1", "n2", "n3"):
            view = coordinator.heartbeat(node, {"address": address(node)})
        members = {node: Membership(node) for node in ("n1", "n2", "n3")}
        for membership in members.values():
            membership.update(view)
        live = coordinator.model.live_copy_nodes("imagenet", "A")
        for shard, owner in enumerate(owner_table("imagenet", live)):
            for node, membership in members.items():
                got = membership.owner_address("imagenet", shard)
                assert got == (None if owner == node else address(owner))
        owned = [m.owned_shards("imagenet", "A", live) for m in members.values()]
        assert set().union(*owned) == set(range(SHARDS))
        assert sum(len(s) for s in owned) == SHARDS
    finally:
        store.close()


# --- plan ----------------------------------------------------------------------------------------


def listing(seed: int = 7) -> list[ObjectInfo]:
    rng = random.Random(seed)
    sizes = [0, 1, BS - 1, BS, BS + 1, 2 * BS, 5 * BS + 17]
    objects = []

    def add(key: str) -> None:
        size = rng.choice(sizes) if rng.random() < 0.2 else rng.randrange(1, 6 * BS)
        objects.append(ObjectInfo(key, size, f"etag-{len(objects)}", 1_000_000 + len(objects)))

    for i in range(3000):
        add(f"train/c{i % 25:02d}/img{i:05d}.jpg")
    for i in range(400):
        add(f"training/x{i:04d}.bin")
    for i in range(400):
        add(f"val/v{i:04d}.jpg")
    add("trainer.txt")
    objects.sort(key=lambda o: o.key.encode())
    return objects


@pytest.fixture(scope="module")
def objects() -> list[ObjectInfo]:
    return listing()


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory, objects) -> Iterator[Snapshot]:
    dest = tmp_path_factory.mktemp("plan") / "snap"
    build_snapshot(objects, dest)
    opened = Snapshot.open(dest)
    yield opened
    opened.close()


def bytes_per_shard(objects: list[ObjectInfo], prefixes=()) -> dict[int, int]:
    per_shard: dict[int, int] = defaultdict(int)
    for obj in objects:
        if path_matches(obj.key, prefixes):
            per_shard[shard_of(obj.key)] += obj.size
    return per_shard


def selected_bytes(planned: dict[int, list[PlannedObject]]) -> dict[int, int]:
    return {shard: sum(o.selected_bytes for o in objs) for shard, objs in planned.items()}


def check_shape(planned: dict[int, list[PlannedObject]], objects: list[ObjectInfo]) -> None:
    """Each object in its own shard, its blocks a prefix, its bytes right; within a shard the
    objects are taken in key-hash order and only the last may be partial."""
    by_key = {o.key: o for o in objects}
    for shard, objs in planned.items():
        for position, obj in enumerate(objs):
            info = by_key[obj.key]
            assert shard_of(obj.key) == shard
            assert (obj.size, obj.etag) == (info.size, info.etag)
            nblocks = max(1, -(-info.size // BS))
            assert obj.blocks == tuple(range(len(obj.blocks)))
            assert 1 <= len(obj.blocks) <= nblocks
            assert obj.selected_bytes == min(info.size, len(obj.blocks) * BS)
            if position < len(objs) - 1:
                assert len(obj.blocks) == nblocks
        hashes = [key_hash_of(o.key) for o in objs]
        assert hashes == sorted(hashes)


def test_path_matches_whole_components() -> None:
    assert path_matches("train/x", ("train",))
    assert path_matches("train", ("train",))
    assert path_matches("a/b/c", ("a/b",))
    assert not path_matches("training/x", ("train",))
    assert not path_matches("trainer.txt", ("train",))
    assert not path_matches("a/bc/d", ("a/b",))
    assert path_matches("anything", ())
    assert path_matches("val/v", ("train", "val"))


def test_everything_without_fraction(snapshot: Snapshot, objects: list[ObjectInfo]) -> None:
    planned = plan(snapshot, {"paths": [], "fraction": None, "bytes": None}, BS)
    check_shape(planned, objects)
    keys = [o.key for objs in planned.values() for o in objs]
    assert sorted(keys) == sorted(o.key for o in objects)
    assert sum(selected_bytes(planned).values()) == sum(o.size for o in objects)
    assert all(len(o.blocks) == max(1, -(-o.size // BS)) for objs in planned.values() for o in objs)
    # Only shards that hold files are listed.
    assert set(planned) == {shard_of(o.key) for o in objects}
    assert plan(snapshot, {}, BS) == planned


@pytest.mark.parametrize(
    ("paths", "prefix"),
    [
        (["train"], "train/"),
        (["/train/"], "train/"),
        (["train/c03"], "train/c03/"),
        (["val", "training"], None),
    ],
)
def test_paths_select_whole_components(
    snapshot: Snapshot, objects: list[ObjectInfo], paths, prefix
) -> None:
    planned = plan(snapshot, {"paths": paths}, BS)
    keys = sorted(o.key for objs in planned.values() for o in objs)
    if prefix is None:
        expected = [o.key for o in objects if o.key.startswith(("val/", "training/"))]
    else:
        expected = [o.key for o in objects if o.key.startswith(prefix)]
    assert expected  # the listing has something there
    assert keys == sorted(expected)
    assert "trainer.txt" not in keys


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.25, 0.5, 0.77, 1.0])
@pytest.mark.parametrize("paths", [[], ["train"]])
def test_fraction_total_and_per_shard(
    snapshot: Snapshot, objects: list[ObjectInfo], fraction: float, paths
) -> None:
    planned = plan(snapshot, {"paths": paths, "fraction": fraction}, BS)
    check_shape(planned, objects)
    per_shard = bytes_per_shard(objects, tuple(paths))
    total = sum(per_shard.values())
    got = selected_bytes(planned)
    assert abs(sum(got.values()) - fraction * total) <= BS / 2
    for shard in range(SHARDS):
        shard_bytes = per_shard.get(shard, 0)
        assert abs(got.get(shard, 0) - fraction * shard_bytes) <= BS, shard
    if paths:
        assert all(o.key.startswith("train/") for objs in planned.values() for o in objs)
    if fraction == 1.0:
        assert sum(got.values()) == total


def test_fraction_with_few_files_per_shard(tmp_path: Path) -> None:
    """Most shards hold zero or one file: the error carried between shards keeps the total
    within half a block even though no shard can take a fraction of its one file."""
    rng = random.Random(3)
    objects = [ObjectInfo(f"f{i:04d}", rng.randrange(1, 3 * BS), "e", 1) for i in range(300)]
    build_snapshot(objects, tmp_path / "snap")
    snapshot = Snapshot.open(tmp_path / "snap")
    try:
        for fraction in (0.1, 0.3, 0.5, 0.9):
            planned = plan(snapshot, {"fraction": fraction}, BS)
            got = selected_bytes(planned)
            total = sum(o.size for o in objects)
            assert abs(sum(got.values()) - fraction * total) <= BS / 2
            per_shard = bytes_per_shard(objects)
            for shard in range(SHARDS):
                assert abs(got.get(shard, 0) - fraction * per_shard.get(shard, 0)) <= BS
    finally:
        snapshot.close()


@pytest.mark.parametrize(
    "selection",
    [
        {},
        {"fraction": 0.3},
        {"fraction": 0.3, "paths": ["train"]},
        {"bytes": 5_000_000},
        {"bytes": 700_000, "paths": ["val"]},
    ],
)
def test_planning_some_shards_matches_planning_all(snapshot: Snapshot, selection) -> None:
    full = plan(snapshot, selection, BS)
    for subset in ({0}, set(range(0, SHARDS, 7)), set(range(SHARDS // 2, SHARDS))):
        part = plan(snapshot, selection, BS, subset)
        assert part == {shard: objs for shard, objs in full.items() if shard in subset}


def test_the_same_walk_names_the_files_of_the_other_shards(
    snapshot: Snapshot, objects: list[ObjectInfo]
) -> None:
    """``elsewhere`` gets every file under the paths that the shards planned do not hold,
    whatever the fraction (a LOOKUP reply is the same for a file not cached), up to its max."""
    subset = set(range(0, SHARDS, 3))
    elsewhere: list[str] = []
    part = plan(snapshot, {"paths": ["train"], "fraction": 0.3}, BS, subset, elsewhere=elsewhere,
                elsewhere_max=len(objects))  # fmt: skip
    assert part == plan(snapshot, {"paths": ["train"], "fraction": 0.3}, BS, subset)
    expected = {
        o.key for o in objects if o.key.startswith("train/") and shard_of(o.key) not in subset
    }
    assert expected and set(elsewhere) == expected and len(elsewhere) == len(expected)
    capped: list[str] = []
    plan(snapshot, {}, BS, subset, elsewhere=capped, elsewhere_max=5)
    assert len(capped) == 5


def test_byte_budget(snapshot: Snapshot, objects: list[ObjectInfo]) -> None:
    total = sum(o.size for o in objects)
    for budget in (1, 123_457, 5_000_000, total // 3):
        planned = plan(snapshot, {"bytes": budget}, BS)
        check_shape(planned, objects)
        assert abs(sum(selected_bytes(planned).values()) - budget) <= BS / 2
    # Within the paths: the budget is spread over the selected files only.
    train_total = sum(bytes_per_shard(objects, ("train",)).values())
    planned = plan(snapshot, {"bytes": train_total // 2, "paths": ["train"]}, BS)
    assert abs(sum(selected_bytes(planned).values()) - train_total // 2) <= BS / 2
    assert all(o.key.startswith("train/") for objs in planned.values() for o in objs)
    # A budget beyond the total takes everything.
    assert plan(snapshot, {"bytes": 10 * total}, BS) == plan(snapshot, {}, BS)


def test_deterministic_across_snapshots_of_the_same_listing(
    tmp_path: Path, snapshot: Snapshot, objects: list[ObjectInfo]
) -> None:
    shuffled = list(objects)
    random.Random(11).shuffle(shuffled)
    build_snapshot(shuffled, tmp_path / "again")
    again = Snapshot.open(tmp_path / "again")
    try:
        for selection in ({}, {"fraction": 0.4}, {"bytes": 2_000_000, "paths": ["train"]}):
            first = plan(snapshot, selection, BS)
            assert plan(again, selection, BS) == first
            assert plan(snapshot, selection, BS) == first
    finally:
        again.close()


def test_shard_budget_takes_blocks_while_nearer_to_target() -> None:
    budget = _ShardBudget(2.4 * BS)
    assert budget.blocks_taken(10 * BS, BS) == 2  # a third block would be 0.6 block over
    assert budget.stopped
    assert budget.blocks_taken(BS, BS) == 0  # stopped for good: a prefix
    budget = _ShardBudget(2.6 * BS)
    assert budget.take_file(BS, BS) is True
    assert budget.take_file(BS, BS) is True
    assert budget.take_file(BS, BS) is True  # 3 blocks: 0.4 over beats 0.6 under
    assert budget.take_file(BS, BS) is False
    assert budget.taken == 3 * BS


def test_owned_shards_partition_a_plan(snapshot: Snapshot) -> None:
    """What the nodes of a copy plan for their owned shards adds up to the whole plan."""
    nodes = ["n1", "n2", "n3"]
    selection = {"fraction": 0.5}
    full = plan(snapshot, selection, BS)
    counts: Counter[str] = Counter()
    merged: dict[int, list[PlannedObject]] = {}
    for node in nodes:
        membership = Membership(node)
        membership.update(make_view(nodes))
        owned = membership.owned_shards("imagenet", "A", nodes)
        part = plan(snapshot, selection, BS, owned)
        assert not set(part) & set(merged)
        merged.update(part)
        counts[node] = len(owned)
    assert merged == full
    assert sum(counts.values()) == SHARDS
