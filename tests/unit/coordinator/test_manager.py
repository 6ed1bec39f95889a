"""The CacheManager on a real LMDB store with a fake clock: TDCS placement, Suspend (FIFO, also
across a restart), Clone, leases, ttl / lock / lru cleanup, scaling with hand-off.

Workers are heartbeat calls here; the same behaviour with real worker processes is in
``tests/e2e/cluster/test_cache_manager.py``.
"""

from __future__ import annotations

import pytest

from cachefs.errors import ConfigError, DatasetNotFound
from cachefs.preload_jobs import Selection
from cachefs.protocol import SHARDS, owner_table
from coordinator.copies import Locality, clone_nodes, next_copy_id, rank_nodes
from coordinator.errors import CopyBusy, JobExists, JobNotFound, NodeNotFound
from coordinator.service import Coordinator
from coordinator.state import LmdbStateStore
from tests.coordinator_model import DOWN_AFTER_S, SETTINGS, FakeClock, beat, spec

GB = 1 << 30


def report(cached: dict[str, int], size: int = 300, last_read: dict[str, float] | None = None):
    """Per node: its heartbeat's datasets section for one dataset named "imagenet"."""

    def of(node: str) -> dict:
        return {
            "imagenet": {
                "bytes": size,
                "files": 3,
                "cached_bytes": cached.get(node, 0),
                "last_read_at": (last_read or {}).get(node, 0.0),
            }
        }

    return of


def beat_all(coordinator: Coordinator, nodes, **kwargs) -> None:
    for node in nodes:
        beat(coordinator, node, **kwargs)


def wait(
    coordinator: Coordinator, clock: FakeClock, seconds: float, nodes, datasets_of=None
) -> None:
    """Let ``seconds`` pass with every node heartbeating (reporting ``datasets_of(node)``),
    the coordinator ticking."""
    for _ in range(int(seconds)):
        clock.advance(1)
        for node in nodes:
            beat(coordinator, node, datasets=datasets_of(node) if datasets_of else {})
        coordinator.tick()


NODES = ["n1", "n2", "n3", "n4", "n5"]


# --- TDCS placement ------------------------------------------------------------------------------


def test_the_copys_nodes_among_the_candidates_come_first(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"), nodes=["n1", "n2", "n3"])
    datasets = report({"n1": 100, "n2": 90, "n3": 110, "n4": 30})
    for node in NODES:
        beat(coordinator, node, datasets=datasets(node))
    job = coordinator.manager.jobs.submit("train-42", "imagenet", 3, ["n2", "n3", "n4", "n5"])
    assert job["state"] == "running" and job["copy"] == "A" and not job["cloned"]
    # S3 = {n2, n3} by cached bytes, then the rest of S2 by cached fraction.
    assert job["nodes"] == ["n3", "n2", "n4"]
    assert [row["node"] for row in job["ranking"]] == ["n3", "n2", "n4", "n5"]
    assert [row["in_copy"] for row in job["ranking"]] == [True, True, False, False]
    assert "in copy A" in job["ranking"][0]["why"]
    assert "outside copy A" in job["ranking"][2]["why"] and "10%" in job["ranking"][2]["why"]
    assert job["explanation"] == "running on copy A: 2 of 3 nodes hold the copy"


def test_without_candidates_every_live_node_is_one(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"), nodes=["n2"])
    beat_all(coordinator, ["n1", "n2", "n3"])
    clock.advance(DOWN_AFTER_S + 1)
    beat_all(coordinator, ["n1", "n2"])  # n3 went down
    job = coordinator.manager.jobs.submit("j", "imagenet", 2)
    assert job["nodes"] == ["n2", "n1"]
    with pytest.raises(ConfigError, match="wants 3 nodes but only 2 candidate nodes are up"):
        coordinator.manager.jobs.submit("k", "imagenet", 3)
    with pytest.raises(ConfigError, match="only 1 candidate"):
        coordinator.manager.jobs.submit("k", "imagenet", 2, ["n1", "n3", "gpu-unknown"])


def test_submitting_again_is_idempotent_and_names_are_unique(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"))
    coordinator.add_dataset(spec("coco"))
    beat_all(coordinator, ["n1", "n2"])
    first = coordinator.manager.jobs.submit("j", "imagenet", 1)
    assert coordinator.manager.jobs.submit("j", "imagenet", 1)["seq"] == first["seq"]
    with pytest.raises(JobExists, match="already exists"):
        coordinator.manager.jobs.submit("j", "coco", 1)
    with pytest.raises(DatasetNotFound):
        coordinator.manager.jobs.submit("k", "nope", 1)
    coordinator.remove_dataset("imagenet")
    with pytest.raises(JobNotFound):
        coordinator.manager.jobs.job("j")


def test_pure_ranking_helpers() -> None:
    locality = Locality(1000, {"a": 500, "b": 900, "c": 100})
    ranked = rank_nodes(["c", "b", "a", "d"], "A", ["a", "d"], locality)
    assert [r.node for r in ranked] == ["a", "d", "b", "c"]
    assert clone_nodes(["a", "b", "c"], {"a"}, {"b": 5, "c": 9}, 2) == ["c", "b"]
    assert clone_nodes(["a", "b"], {"a"}, {}, 2) is None
    assert next_copy_id(["A", "B"]) == "C"
    assert next_copy_id([chr(c) for c in range(ord("A"), ord("Z") + 1)]) == "A2"


# --- Suspend -------------------------------------------------------------------------------------


def test_suspend_queues_fifo_and_promotes_on_release(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=2))
    beat_all(coordinator, ["n1", "n2", "n3"])
    manager = coordinator.manager
    assert manager.jobs.submit("j1", "imagenet", 1)["state"] == "running"
    assert manager.jobs.submit("j2", "imagenet", 1)["state"] == "running"
    j3 = manager.jobs.submit("j3", "imagenet", 1)
    j4 = manager.jobs.submit("j4", "imagenet", 1)
    assert (j3["state"], j3["position"]) == ("suspended", 1)
    assert (j4["state"], j4["position"]) == ("suspended", 2)
    assert "runs 2 jobs" in j3["explanation"]
    version = manager.jobs.version
    released = manager.jobs.release("j1")
    assert released["promoted"] == ["j3"]
    assert manager.jobs.version > version  # long-polls wake up
    assert manager.jobs.job("j3")["state"] == "running"
    assert manager.jobs.job("j4")["position"] == 1
    assert coordinator.dataset_status("imagenet")["jobs"] == {"running": 2, "suspended": 1}


def test_the_suspend_queue_survives_a_restart_in_order(
    coordinator: Coordinator, store: LmdbStateStore, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1))
    beat_all(coordinator, ["n1"])
    for name in ("j1", "j2", "j3", "j4"):
        coordinator.manager.jobs.submit(name, "imagenet", 1)
    restarted = Coordinator(store, SETTINGS, clock=clock)
    beat_all(restarted, ["n1"])
    assert [j["id"] for j in restarted.manager.jobs.list_jobs()] == ["j1", "j2", "j3", "j4"]
    assert restarted.manager.jobs.submit("j5", "imagenet", 1)["position"] == 4
    assert restarted.manager.jobs.release("j1")["promoted"] == ["j2"]
    assert restarted.manager.jobs.release("j2")["promoted"] == ["j3"]
    assert [j["position"] for j in restarted.manager.jobs.list_jobs()] == [None, 1, 2]


def test_a_job_whose_lease_lapses_is_released(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1))
    beat_all(coordinator, ["n1"])
    coordinator.manager.jobs.submit("j1", "imagenet", 1, lease_s=10)
    # No lease: it waits as long as needed.
    coordinator.manager.jobs.submit("j2", "imagenet", 1, lease_s=0)
    wait(coordinator, clock, 6, ["n1"])
    assert coordinator.manager.jobs.renew("j1")["lease_expires_in_s"] == 10
    wait(coordinator, clock, 9, ["n1"])
    assert coordinator.manager.jobs.job("j1")["state"] == "running"
    wait(coordinator, clock, 2, ["n1"])
    with pytest.raises(JobNotFound):
        coordinator.manager.jobs.job("j1")
    assert coordinator.manager.jobs.job("j2")["state"] == "running"
    messages = [e["message"] for e in coordinator.manager.journal.list_events("imagenet")]
    assert "job j1 released: lease of 10 s expired" in messages


# --- Clone ---------------------------------------------------------------------------------------


def test_clone_makes_a_copy_on_the_freest_outside_nodes(coordinator: Coordinator) -> None:
    coordinator.add_dataset(
        spec("imagenet", max_jobs_per_copy=1, overflow="clone"), nodes=["n1", "n2"]
    )
    for node, used in [("n1", 0), ("n2", 0), ("n3", 9 * GB), ("n4", 2 * GB)]:
        beat(coordinator, node, tiers=[{"name": "ram", "capacity": 10 * GB, "used": used}])
    manager = coordinator.manager
    assert manager.jobs.submit("j1", "imagenet", 2)["nodes"] == ["n1", "n2"]
    j2 = manager.jobs.submit("j2", "imagenet", 1)
    assert (j2["state"], j2["copy"], j2["cloned"], j2["nodes"]) == ("running", "B", True, ["n4"])
    view = beat(coordinator, "n4")
    imagenet = view["datasets"][0]
    assert imagenet["copies"] == {"A": ["n1", "n2"], "B": ["n4"]}
    assert imagenet["fills"] == {"B": {"id": "B-1", "from": ["n1", "n2"]}}
    assert manager.jobs.submit("j3", "imagenet", 1)["copy"] == "C"  # onto n3, the last outside
    j4 = manager.jobs.submit("j4", "imagenet", 1)
    assert j4["state"] == "suspended" and "outside its copies to clone onto" in j4["explanation"]

    # The clone's fill finishes when its nodes report it done; a clone trims nobody.
    fill = {"copy": "B", "id": "B-1", "done": True, "copied_bytes": 500, "copied_blocks": 5}
    beat(coordinator, "n4", fills={"imagenet": fill})
    coordinator.tick()
    copies = {c["id"]: c for c in coordinator.dataset_status("imagenet")["copies"]}
    assert copies["B"]["fill"] is None and copies["C"]["fill"]["id"] == "C-2"
    assert copies["B"]["origin"] == "clone of A for job j2"
    assert not any(beat(coordinator, node)["tasks"] for node in ("n1", "n2", "n3", "n4"))
    assert any(
        e["kind"] == "fill" and "500 bytes copied from peers" in e["message"]
        for e in manager.journal.list_events("imagenet")
    )


def test_clone_is_impossible_when_the_first_copy_spans_every_node(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1, overflow="clone"))
    beat_all(coordinator, ["n1", "n2"])
    coordinator.manager.jobs.submit("j1", "imagenet", 1)
    assert coordinator.manager.jobs.submit("j2", "imagenet", 1)["state"] == "suspended"


# --- cleanup -------------------------------------------------------------------------------------


def test_ttl_frees_an_idle_clone_then_the_last_copy(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(
        spec("imagenet", max_jobs_per_copy=1, overflow="clone", cleanup="ttl:60s"), nodes=["n1"]
    )
    nodes = ["n1", "n2"]
    beat_all(coordinator, nodes)
    manager = coordinator.manager
    manager.jobs.submit("j1", "imagenet", 1)
    manager.jobs.submit("j2", "imagenet", 1)  # clone B on n2
    beat(coordinator, "n2", fills={"imagenet": {"copy": "B", "id": "B-1", "done": True}})
    wait(coordinator, clock, 120, nodes)
    assert not beat(coordinator, "n1")["tasks"]  # jobs use both copies: nothing idles
    manager.jobs.release("j1")
    manager.jobs.release("j2")
    wait(coordinator, clock, 59, nodes)
    assert not beat(coordinator, "n1")["tasks"]
    wait(coordinator, clock, 2, nodes)
    tasks = {node: beat(coordinator, node)["tasks"] for node in nodes}
    assert [t["kind"] for t in tasks["n1"]] == ["free"]
    assert [t["kind"] for t in tasks["n2"]] == ["free"]
    assert "copy B idle" in tasks["n2"][0]["reason"]
    assert "copy A idle" in tasks["n1"][0]["reason"]
    status = coordinator.dataset_status("imagenet")
    assert [c["id"] for c in status["copies"]] == ["A"]  # the clone is gone, A kept (empty)
    assert status["copies"][0]["freed_at"] is not None

    beat(coordinator, "n1", tasks_done={tasks["n1"][0]["id"]: {"freed_bytes": 1000}})
    beat(coordinator, "n2", tasks_done={tasks["n2"][0]["id"]: {"freed_bytes": 234}})
    assert coordinator.dataset_status("imagenet")["freed_bytes"] == 1234
    wait(coordinator, clock, 600, nodes)
    assert not beat(coordinator, "n1")["tasks"]  # freed, and nobody used it since

    # A read makes the copy used again; after another ttl it is freed again.
    wait(coordinator, clock, 61, nodes, datasets_of=report({}, last_read={"n1": clock()}))
    assert [t["kind"] for t in beat(coordinator, "n1")["tasks"]] == ["free"]


def test_lock_never_frees(coordinator: Coordinator, clock: FakeClock) -> None:
    coordinator.add_dataset(spec("imagenet", cleanup="lock"))
    for node in ("n1",):
        beat(
            coordinator,
            node,
            datasets=report({"n1": 300})(node),
            tiers=[{"name": "ram", "capacity": 300, "used": 300}],
        )
    wait(coordinator, clock, 1000, ["n1"])
    assert not beat(coordinator, "n1")["tasks"]


def lru_beat(coordinator: Coordinator, used: int, cached: dict[str, int], read_at: dict, **extra):
    datasets = {
        name: {"bytes": 1000, "cached_bytes": cached[name], "last_read_at": read_at[name]}
        for name in cached
    }
    tiers = [{"name": "ram", "capacity": 1000, "used": used}]
    return beat(coordinator, "n1", datasets=datasets, tiers=tiers, **extra)


def test_lru_frees_the_least_recently_used_dataset_under_pressure(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    for name, policy in [("old", "lru"), ("new", "lru"), ("hot", "lock"), ("busy", "lru")]:
        coordinator.add_dataset(spec(name, cleanup=policy))
    clock.advance(100)
    now = clock()
    cached = {"old": 300, "new": 300, "hot": 300, "busy": 50}
    read_at = {"old": now - 50, "new": now - 20, "hot": now, "busy": now - 90}
    lru_beat(coordinator, 800, cached, read_at)  # 80 %: no pressure
    coordinator.manager.jobs.submit("reader", "busy", 1)  # a job uses "busy": never freed under it
    coordinator.tick()
    assert not beat(coordinator, "n1")["tasks"]

    lru_beat(coordinator, 950, cached, read_at)
    coordinator.tick()
    tasks = lru_beat(coordinator, 950, cached, read_at)["tasks"]
    assert [(t["kind"], t["dataset"]) for t in tasks] == [("free", "old")]
    assert "least recently used" in tasks[0]["reason"]
    coordinator.tick()  # one free at a time per node
    assert len(lru_beat(coordinator, 950, cached, read_at)["tasks"]) == 1

    # The worker freed all but its reserve (100 bytes stay); still under pressure: "new" next,
    # not "old" again (freed and not read since), and never "hot" (the newest, and locked).
    cached = {**cached, "old": 100}
    lru_beat(coordinator, 950, cached, read_at, tasks_done={tasks[0]["id"]: {"freed_bytes": 200}})
    coordinator.tick()
    tasks = lru_beat(coordinator, 950, cached, read_at)["tasks"]
    assert [(t["kind"], t["dataset"]) for t in tasks] == [("free", "new")]


# --- scaling -------------------------------------------------------------------------------------


def moved(dataset: str, before: list[str], after: list[str]) -> int:
    old, new = owner_table(dataset, before), owner_table(dataset, after)
    return sum(old[s] != new[s] for s in range(SHARDS))


def holding(shards: dict[int, int] | set[int], dataset: str = "imagenet", size: int = 100) -> dict:
    """A heartbeat's datasets section: ``dataset`` with ``size`` bytes in each of ``shards``
    (or the given bytes per shard)."""
    per_shard = shards if isinstance(shards, dict) else dict.fromkeys(shards, size)
    return {
        dataset: {
            "bytes": SHARDS * size,
            "cached_bytes": sum(per_shard.values()),
            "shards": {str(shard): nbytes for shard, nbytes in per_shard.items()},
        }
    }


def fill_done(dataset: str, copy_id: str, fill_id: str) -> dict:
    return {dataset: {"copy": copy_id, "id": fill_id, "done": True}}


def owned_by(node: str, nodes: list[str], dataset: str = "imagenet") -> set[int]:
    return {shard for shard, owner in enumerate(owner_table(dataset, nodes)) if owner == node}


def trims(coordinator: Coordinator, node: str, **report) -> list[dict]:
    return [t for t in beat(coordinator, node, **report)["tasks"] if t["kind"] == "trim"]


def test_scale_out_then_in_hands_shards_off(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet"), nodes=["n1", "n2"])
    before = ["n1", "n2"]
    held = {node: owned_by(node, before) for node in before}  # copy A holds every shard
    for node in ("n1", "n2", "n3"):
        beat(coordinator, node, datasets=holding(held.get(node, set())))
    manager = coordinator.manager
    out = coordinator.scale_copy("imagenet", "A", ["n3"], [])
    assert out["moved_shards"] == moved("imagenet", ["n1", "n2"], ["n1", "n2", "n3"])
    assert 0 < out["moved_shards"] < SHARDS // 2
    view = beat(coordinator, "n3")["datasets"][0]
    assert view["copies"] == {"A": ["n1", "n2", "n3"]}
    assert view["fills"] == {"A": {"id": "A-1", "from": ["n1", "n2"]}}
    with pytest.raises(CopyBusy, match="still being filled"):
        coordinator.scale_copy("imagenet", "A", [], ["n1"])

    for node in ("n1", "n2"):
        beat(
            coordinator, node, datasets=holding(held[node]), fills=fill_done("imagenet", "A", "A-1")
        )
    coordinator.tick()
    assert coordinator.dataset_status("imagenet")["copies"][0]["fill"] is not None  # n3 not done
    # n3 copied every shard it gained but two: one it got nothing of, one only half of.
    gained = owned_by("n3", ["n1", "n2", "n3"])
    missing, half = sorted(gained)[:2]
    copied = {shard: 100 for shard in gained - {missing}} | {half: 50}
    beat(coordinator, "n3", datasets=holding(copied), fills=fill_done("imagenet", "A", "A-1"))
    coordinator.tick()
    status = coordinator.dataset_status("imagenet")["copies"][0]
    assert status["fill"] is None

    # The old owners drop exactly the shards n3 holds; they keep the two it does not hold.
    sent = {}
    for node in ("n1", "n2"):
        (trim,) = sent[node] = trims(coordinator, node, datasets=holding(held[node]))
        assert set(trim["shards"]) == (held[node] & gained) - {missing, half}
        assert trim["reason"] == "hand-off A-1 finished"
    assert trims(coordinator, "n3", datasets=holding(copied)) == []
    kept_by = {node for node in ("n1", "n2") if held[node] & {missing, half}}
    assert status["handed_off"] == {node: len(held[node] & {missing, half}) for node in kept_by}
    (event,) = [e for e in manager.journal.list_events("imagenet") if e["kind"] == "fill"]
    assert (event["trimmed_shards"], event["kept_shards"]) == (len(gained) - 2, 2)
    assert "2 kept until their new owner holds them" in event["message"]

    # The workers trim; later n3 reads the two shards through: the holders drop them then.
    for node in ("n1", "n2"):
        held[node] -= gained - {missing, half}
        done = {sent[node][0]["id"]: {"freed_bytes": 1}}
        beat(coordinator, node, datasets=holding(held[node]), tasks_done=done)
    coordinator.tick()
    assert all(not trims(coordinator, node, datasets=holding(held[node])) for node in kept_by)
    copied = dict.fromkeys(gained, 100)
    beat(coordinator, "n3", datasets=holding(copied))
    coordinator.tick()
    for node in kept_by:
        (late,) = trims(coordinator, node)
        assert set(late["shards"]) == held[node] & {missing, half}
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"] == {}
    assert any(e["kind"] == "trim" for e in manager.journal.list_events("imagenet"))

    inward = coordinator.scale_copy("imagenet", "A", [], ["n1"])
    assert inward["moved_shards"] == moved("imagenet", ["n1", "n2", "n3"], ["n2", "n3"])
    view = beat(coordinator, "n1")["datasets"][0]
    assert view["copies"] == {"A": ["n2", "n3"]}
    assert view["fills"] == {"A": {"id": "A-2", "from": ["n1", "n2", "n3"]}}
    events = [e for e in manager.journal.list_events("imagenet") if e["kind"] == "scale"]
    assert events[-1]["removed"] == ["n1"] and events[-1]["moved_shards"] == inward["moved_shards"]


def test_a_fill_is_named_by_dataset_copy_and_id(coordinator: Coordinator) -> None:
    """Fill ids are numbered per dataset: both datasets' first scale is "A-1". A node's "done"
    for one dataset's A-1 (or for another copy's) must not end the other's."""
    for name in ("imagenet", "coco"):
        coordinator.add_dataset(spec(name), nodes=["n1"])
    beat_all(coordinator, ["n1", "n2"])
    for name in ("imagenet", "coco"):
        coordinator.scale_copy(name, "A", ["n2"], [])
    view = beat(coordinator, "n2")
    assert [d["fills"] for d in view["datasets"]] == [{"A": {"id": "A-1", "from": ["n1"]}}] * 2
    beat(coordinator, "n1", fills={"coco": {"copy": "A", "id": "A-1", "done": True}})
    beat(coordinator, "n2", fills={"coco": {"copy": "B", "id": "A-1", "done": True}})
    beat(coordinator, "n2", fills={"imagenet": {"copy": "A", "id": "A-1", "done": True}})
    beat(coordinator, "n1", fills={"imagenet": {"copy": "A", "id": "A-1", "done": True}})
    coordinator.tick()
    fills = {d["name"]: d["copies"][0]["fill"] for d in coordinator.list_datasets()}
    assert fills["imagenet"] is None
    assert fills["coco"] is not None and fills["coco"]["nodes_done"] == 1  # n1 only
    beat(coordinator, "n2", fills={"coco": {"copy": "A", "id": "A-1", "done": True}})
    coordinator.tick()
    assert coordinator.dataset_status("coco")["copies"][0]["fill"] is None

    # Removed and added again, a dataset numbers its fills from 1 again: the reports of the
    # old dataset's A-1 are gone with it.
    coordinator.remove_dataset("coco")
    coordinator.add_dataset(spec("coco"), nodes=["n1"])
    coordinator.scale_copy("coco", "A", ["n2"], [])
    coordinator.tick()
    assert coordinator.dataset_status("coco")["copies"][0]["fill"]["id"] == "A-1"


def test_a_fill_done_without_copying_trims_nothing(coordinator: Coordinator) -> None:
    """The bug this guards: a new owner says "done" but holds nothing of what moved (its fill
    was marked done without running). The old owner keeps every shard: 100 % stays cached."""
    coordinator.add_dataset(spec("imagenet"), nodes=["n1"])
    everything = set(range(SHARDS))
    beat(coordinator, "n1", datasets=holding(everything))
    beat(coordinator, "n2")
    coordinator.scale_copy("imagenet", "A", ["n2"], [])
    beat(coordinator, "n1", datasets=holding(everything), fills=fill_done("imagenet", "A", "A-1"))
    beat(coordinator, "n2", datasets=holding(set()), fills=fill_done("imagenet", "A", "A-1"))
    coordinator.tick()
    status = coordinator.dataset_status("imagenet")["copies"][0]
    assert status["fill"] is None
    assert trims(coordinator, "n1") == []
    assert status["handed_off"] == {"n1": len(owned_by("n2", ["n1", "n2"]))}

    # Back to back: n2 is removed again before it held anything. Nothing is trimmed, and n1,
    # owning everything again, has nothing waiting either.
    coordinator.scale_copy("imagenet", "A", [], ["n2"])
    beat(coordinator, "n1", datasets=holding(everything), fills=fill_done("imagenet", "A", "A-2"))
    coordinator.tick()
    assert trims(coordinator, "n1") == [] and trims(coordinator, "n2") == []
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"] == {}


def test_back_to_back_scales_never_trim_what_the_next_one_needs(coordinator: Coordinator) -> None:
    """A trim decided at the end of one hand-off and still pending when the next scale starts
    is not carried out: it goes back to waiting and is judged again at the end of the next."""
    coordinator.add_dataset(spec("imagenet"), nodes=["n1", "n2"])
    first, second = ["n1", "n2"], ["n1", "n2", "n3"]
    held = {node: owned_by(node, first) for node in first} | {"n3": set()}
    beat_all(coordinator, ["n3"])
    for node in first:
        beat(coordinator, node, datasets=holding(held[node]))
    coordinator.scale_copy("imagenet", "A", ["n3"], [])
    held["n3"] = owned_by("n3", second)
    for node in second:
        beat(
            coordinator, node, datasets=holding(held[node]), fills=fill_done("imagenet", "A", "A-1")
        )
    coordinator.tick()
    pending = {node: trims(coordinator, node) for node in first}
    assert all(len(tasks) == 1 for tasks in pending.values())

    # Scaled again before n1 and n2 ran (or acknowledged) their trims: n3 leaves.
    coordinator.scale_copy("imagenet", "A", [], ["n3"])
    assert all(trims(coordinator, node) == [] for node in second)  # withdrawn
    status = coordinator.dataset_status("imagenet")["copies"][0]
    withdrawn = {node: len(tasks[0]["shards"]) for node, tasks in pending.items()}
    assert status["handed_off"] == withdrawn

    # n1 and n2 copy back from n3 the shards they own again and report done; n3 reports done.
    for node in first:
        held[node] = owned_by(node, first)
        beat(
            coordinator, node, datasets=holding(held[node]), fills=fill_done("imagenet", "A", "A-2")
        )
    beat(coordinator, "n3", datasets=holding(held["n3"]), fills=fill_done("imagenet", "A", "A-2"))
    coordinator.tick()
    # They own everything they hold: nothing of theirs is trimmed; n3 drops all it held.
    assert trims(coordinator, "n1") == [] and trims(coordinator, "n2") == []
    (leaving,) = trims(coordinator, "n3")
    assert set(leaving["shards"]) == held["n3"]
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"] == {}


def test_a_shard_with_failed_blocks_is_kept_whatever_the_bytes_say(
    coordinator: Coordinator,
) -> None:
    """A block of shard ``x`` failed to copy to n2; n2 then read other blocks of ``x`` through
    and holds as many bytes as n1. The bytes match, the blocks do not: n1 keeps ``x`` (the
    failed block is cached nowhere else) until a later fill walks ``x`` without a failure."""
    coordinator.add_dataset(spec("imagenet"), nodes=["n1"])
    everything = set(range(SHARDS))
    beat_all(coordinator, ["n2", "n3"])
    beat(coordinator, "n1", datasets=holding(everything))
    coordinator.scale_copy("imagenet", "A", ["n2"], [])
    gained = owned_by("n2", ["n1", "n2"])
    # x: n2's now, and n3's after the next scale (so that scale's fill walks it again).
    x = min(gained & owned_by("n3", ["n1", "n2", "n3"]))
    failed = {"failed_blocks": 1, "failed_shards": {str(x): 1}}
    beat(coordinator, "n1", datasets=holding(everything), fills=fill_done("imagenet", "A", "A-1"))
    n2_fill = {"imagenet": {"copy": "A", "id": "A-1", "done": True, **failed}}
    beat(coordinator, "n2", datasets=holding(gained), fills=n2_fill)
    coordinator.tick()
    status = coordinator.dataset_status("imagenet")["copies"][0]
    assert status["fill"] is None
    (trim,) = trims(coordinator, "n1", datasets=holding(everything))
    assert set(trim["shards"]) == gained - {x}
    assert status["handed_off"] == {"n1": 1}
    events = coordinator.manager.journal.list_events("imagenet")
    (event,) = [e for e in events if e["kind"] == "fill"]
    assert (event["failed_blocks"], event["kept_shards"]) == (1, 1)

    # Ticks judge the kept shard again: n2's bytes of x still do not prove its blocks.
    n1_holds = (everything - gained) | {x}
    beat(coordinator, "n1", datasets=holding(n1_holds), tasks_done={trim["id"]: {"freed_bytes": 1}})
    beat(coordinator, "n2", datasets=holding(gained))
    coordinator.tick()
    assert trims(coordinator, "n1", datasets=holding(n1_holds)) == []
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"] == {"n1": 1}

    # n3 joins and takes x: its fill walks x with no failed (and no absent) block. Then n1
    # drops x, n2 the shards n3 took.
    coordinator.scale_copy("imagenet", "A", ["n3"], [])
    now_n3 = owned_by("n3", ["n1", "n2", "n3"])
    beat(coordinator, "n1", datasets=holding(n1_holds), fills=fill_done("imagenet", "A", "A-2"))
    beat(coordinator, "n2", datasets=holding(gained), fills=fill_done("imagenet", "A", "A-2"))
    beat(coordinator, "n3", datasets=holding(now_n3), fills=fill_done("imagenet", "A", "A-2"))
    coordinator.tick()
    (late,) = trims(coordinator, "n1", datasets=holding(n1_holds))
    assert x in late["shards"]
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"] == {}


def test_a_later_fill_with_absent_blocks_does_not_confirm_a_failed_shard(
    coordinator: Coordinator,
) -> None:
    """The later fill copies x from its previous owner (n2), which may lack the very block
    that failed: blocks absent there prove nothing about what n1 still holds alone."""
    coordinator.add_dataset(spec("imagenet"), nodes=["n1"])
    everything = set(range(SHARDS))
    beat_all(coordinator, ["n2", "n3"])
    beat(coordinator, "n1", datasets=holding(everything))
    coordinator.scale_copy("imagenet", "A", ["n2"], [])
    gained = owned_by("n2", ["n1", "n2"])
    x = min(gained & owned_by("n3", ["n1", "n2", "n3"]))
    beat(coordinator, "n1", datasets=holding(everything), fills=fill_done("imagenet", "A", "A-1"))
    n2_fill = {"copy": "A", "id": "A-1", "done": True, "failed_shards": {str(x): 2}}
    beat(coordinator, "n2", datasets=holding(gained), fills={"imagenet": n2_fill})
    coordinator.tick()
    coordinator.scale_copy("imagenet", "A", ["n3"], [])
    n3_fill = {"copy": "A", "id": "A-2", "done": True, "absent_blocks": 1}
    for node in ("n1", "n2"):
        beat(coordinator, node, datasets=holding(everything if node == "n1" else gained),
             fills=fill_done("imagenet", "A", "A-2"))  # fmt: skip
    n3_holds = owned_by("n3", ["n1", "n2", "n3"])
    beat(coordinator, "n3", datasets=holding(n3_holds), fills={"imagenet": n3_fill})
    coordinator.tick()
    (trim,) = trims(coordinator, "n1", datasets=holding(everything))
    assert x not in trim["shards"]
    assert coordinator.dataset_status("imagenet")["copies"][0]["handed_off"]["n1"] == 1


def test_reports_of_a_finished_fill_or_a_node_gone_are_not_kept(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    """A heartbeat sent before the node saw the fill end reports it again: ignored (it would
    stay forever). A node that went down keeps no report either."""
    coordinator.add_dataset(spec("imagenet"), nodes=["n1"])
    beat_all(coordinator, ["n1", "n2", "n3"])
    manager = coordinator.manager
    coordinator.scale_copy("imagenet", "A", ["n2"], [])
    for node in ("n1", "n2"):
        beat(coordinator, node, fills=fill_done("imagenet", "A", "A-1"))
    coordinator.tick()
    assert coordinator.dataset_status("imagenet")["copies"][0]["fill"] is None

    def kept() -> dict[str, set]:
        return {node: set(reports) for node, reports in manager.fills.reports.items() if reports}

    assert kept() == {}
    beat(coordinator, "n2", fills=fill_done("imagenet", "A", "A-1"))  # late: sent before the view
    beat(coordinator, "n1", fills=fill_done("coco", "A", "A-1"))  # no such dataset (or fill)
    assert kept() == {}

    coordinator.scale_copy("imagenet", "A", ["n3"], [])
    beat(coordinator, "n3", fills={"imagenet": {"copy": "A", "id": "A-2", "done": False}})
    assert kept() == {"n3": {("imagenet", "A", "A-2")}}
    clock.advance(DOWN_AFTER_S + 1)  # n3 stops heartbeating: it is down
    beat_all(coordinator, ["n1", "n2"])
    coordinator.tick()
    assert kept() == {}


def test_a_job_does_not_list_a_node_that_is_down(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    """n2 dies (no more heartbeats) just before j1's release promotes j2 onto n1 and n2: once
    n2 counts as down, j2 lists it under ``down_nodes``, not ``nodes``; back up, it is listed
    again."""
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1))
    beat_all(coordinator, ["n1", "n2"])
    manager = coordinator.manager
    manager.jobs.submit("j1", "imagenet", 2)
    manager.jobs.submit("j2", "imagenet", 2)  # suspended behind j1
    assert manager.jobs.release("j1")["promoted"] == ["j2"]  # n2's last beat is recent: "up"
    assert sorted(manager.jobs.job("j2")["nodes"]) == ["n1", "n2"]
    clock.advance(DOWN_AFTER_S + 1)
    beat(coordinator, "n1")
    job = manager.jobs.job("j2")
    assert (job["nodes"], job["down_nodes"]) == (["n1"], ["n2"])
    assert "(n2 down now)" in job["explanation"]
    assert [row["why"].endswith("(down now)") for row in job["ranking"]] == [
        row["node"] == "n2" for row in job["ranking"]
    ]
    assert [j["nodes"] for j in manager.jobs.list_jobs()] == [["n1"]]
    beat(coordinator, "n2")  # back: listed again
    job = manager.jobs.job("j2")
    assert (sorted(job["nodes"]), job["down_nodes"]) == (["n1", "n2"], [])


def test_scale_refuses_what_cannot_be(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1, overflow="clone"), nodes=["n1"])
    beat_all(coordinator, ["n1", "n2", "n3"])
    coordinator.manager.jobs.submit("j1", "imagenet", 1)
    coordinator.manager.jobs.submit("j2", "imagenet", 1, ["n2"])  # clone B on n2
    with pytest.raises(NodeNotFound):
        coordinator.scale_copy("imagenet", "A", ["n9"], [])
    with pytest.raises(ConfigError, match="already belong to another copy"):
        coordinator.scale_copy("imagenet", "A", ["n2"], [])
    with pytest.raises(ConfigError, match="not in copy A"):
        coordinator.scale_copy("imagenet", "A", [], ["n3"])
    with pytest.raises(ConfigError, match="at least one node"):
        coordinator.scale_copy("imagenet", "A", [], ["n1"])
    with pytest.raises(ConfigError, match="has no copy 'Q'"):
        coordinator.scale_copy("imagenet", "Q", ["n3"], [])


def test_a_scale_that_a_node_never_reports_times_out(
    coordinator: Coordinator, clock: FakeClock
) -> None:
    coordinator.add_dataset(spec("imagenet"), nodes=["n1"])
    beat_all(coordinator, ["n1", "n2"])
    coordinator.scale_copy("imagenet", "A", ["n2"], [])
    wait(coordinator, clock, 3601, ["n1", "n2"])
    assert coordinator.dataset_status("imagenet")["copies"][0]["fill"] is None
    events = coordinator.manager.journal.list_events("imagenet")
    assert any("timed out" in e["message"] for e in events)


def test_raising_the_limit_promotes_and_policies_are_validated(coordinator: Coordinator) -> None:
    coordinator.add_dataset(spec("imagenet", max_jobs_per_copy=1))
    beat_all(coordinator, ["n1"])
    coordinator.manager.jobs.submit("j1", "imagenet", 1)
    coordinator.manager.jobs.submit("j2", "imagenet", 1)
    coordinator.manager.jobs.submit("j3", "imagenet", 1)
    status = coordinator.update_policy("imagenet", {"max_jobs_per_copy": 2, "cleanup": "lru"})
    assert (status["max_jobs_per_copy"], status["cleanup"]) == (2, "lru")
    assert status["jobs"] == {"running": 2, "suspended": 1}
    coordinator.update_policy("imagenet", {"max_jobs_per_copy": None})  # no limit
    assert coordinator.dataset_status("imagenet")["jobs"] == {"running": 3, "suspended": 0}
    with pytest.raises(ConfigError, match="cleanup must be"):
        coordinator.update_policy("imagenet", {"cleanup": "ttl:0s"})
    with pytest.raises(ConfigError, match="cannot change uri"):
        coordinator.update_policy("imagenet", {"uri": "s3://elsewhere/"})
    assert coordinator.dataset_status("imagenet")["cleanup"] == "lru"
    assert any(e["kind"] == "policy" for e in coordinator.manager.journal.list_events("imagenet"))


def test_a_preload_counts_as_use_for_ttl(coordinator: Coordinator, clock: FakeClock) -> None:
    """A copy freed while idle and then preloaded must not count as "freed, unused since"."""
    coordinator.add_dataset(spec("imagenet", cleanup="ttl:60s"))
    beat_all(coordinator, ["n1"])
    wait(coordinator, clock, 61, ["n1"])
    first = beat(coordinator, "n1")["tasks"]
    assert [t["kind"] for t in first] == ["free"]  # idle since it was added
    beat(coordinator, "n1", tasks_done={first[0]["id"]: {"freed_bytes": 0}})
    job = coordinator.cluster.start_preload("imagenet", Selection())
    (
        coordinator.model.preloads[job["id"]].state,
        coordinator.model.preloads[job["id"]].finished_at,
    ) = (
        "completed",
        clock(),
    )
    wait(coordinator, clock, 30, ["n1"])
    assert not beat(coordinator, "n1")["tasks"]  # preloaded 30 s ago: in use
    wait(coordinator, clock, 31, ["n1"])
    assert [t["kind"] for t in beat(coordinator, "n1")["tasks"]] == ["free"]
