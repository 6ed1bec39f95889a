"""The coordinator's shared model (:class:`coordinator.model.ClusterModel`) on its own, over a real
LMDB store with a fake clock: what its public methods decide that the service-level tests
(test_cluster_model.py, test_manager.py) do not reach, and the settings every part is built from
(:mod:`coordinator.settings`), as the CLI reads them."""

from __future__ import annotations

import pytest

from cachefs.cli import build_parser
from cachefs.errors import ConfigError, DatasetExists, DatasetNotFound
from cachefs.preload_jobs import PreloadJob, Selection
from coordinator.model import ClusterModel, DatasetState, NodeState
from coordinator.settings import DOWN_AFTER_HEARTBEATS, CoordinatorSettings, options
from coordinator.state import LmdbStateStore
from tests.coordinator_model import DOWN_AFTER_S, T0, FakeClock, spec


@pytest.fixture
def model(store: LmdbStateStore, clock: FakeClock) -> ClusterModel:
    return ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock)


def register(model: ClusterModel, node: str, *, last_seen: float, datasets=None) -> NodeState:
    state = NodeState(node, f"{node}:7070", T0, last_seen, datasets=datasets or {})
    model.nodes[node] = state
    return state


# --- datasets ----------------------------------------------------------------------------------


def test_a_dataset_added_through_another_model_on_the_store_is_refused(
    model: ClusterModel, store: LmdbStateStore, clock: FakeClock
) -> None:
    """Two coordinators sharing one store (etcd): the second add of a name fails on the store's
    atomic create, even though its own memory has never seen the dataset."""
    other = ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock)
    other.add_dataset(spec("imagenet"))
    assert "imagenet" not in model.datasets
    with pytest.raises(DatasetExists, match="'imagenet' already exists"):
        model.add_dataset(spec("imagenet", uri="s3://elsewhere/"))
    assert "imagenet" not in model.datasets  # nothing half-added
    assert ClusterModel(store, down_after_s=1, clock=clock).dataset("imagenet").spec.uri == (
        "s3://bucket/imagenet/"
    )


def test_a_first_copy_names_its_nodes_once_and_never_none(model: ClusterModel) -> None:
    with pytest.raises(ConfigError, match="at least one node"):
        model.add_dataset(spec("imagenet"), nodes=[])
    state = model.add_dataset(spec("imagenet"), nodes=["n3", "n1", "n3"])
    assert state.copies["A"].nodes == ["n1", "n3"]
    assert model.add_dataset(spec("coco")).copies["A"].nodes is None  # every node, also later


def test_update_policy_changes_only_the_policy_and_validates_the_whole_spec(
    model: ClusterModel, store: LmdbStateStore, clock: FakeClock
) -> None:
    model.add_dataset(spec("imagenet"))
    with pytest.raises(ConfigError, match="cannot change block_size, uri of a dataset"):
        model.update_policy("imagenet", {"uri": "s3://x/", "block_size": 1, "cleanup": "lru"})
    with pytest.raises(ConfigError):
        model.update_policy("imagenet", {"max_jobs_per_copy": 0})
    assert model.dataset("imagenet").spec.cleanup == "lock"  # a refused change changes nothing
    with pytest.raises(DatasetNotFound):
        model.update_policy("coco", {"cleanup": "lru"})
    model.update_policy("imagenet", {"cleanup": "ttl:6h", "overflow": "clone"})
    reread = ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock).dataset("imagenet")
    assert (reread.spec.cleanup, reread.spec.overflow) == ("ttl:6h", "clone")


def test_removing_a_dataset_takes_only_its_preload_jobs_out_of_the_store(
    model: ClusterModel, store: LmdbStateStore
) -> None:
    for name in ("imagenet", "coco"):
        model.add_dataset(spec(name))
        job = PreloadJob(f"{name}-1", name, "A", Selection(), created_at=T0)
        model.save_preload(job)
        model.preloads[job.id] = job
    model.remove_dataset("imagenet")
    assert list(model.preloads) == ["coco-1"]
    assert [key for key, _ in store.list("preloads/")] == ["preloads/coco-1"]
    assert [key for key, _ in store.list("datasets/")] == ["datasets/coco"]
    with pytest.raises(DatasetNotFound):
        model.remove_dataset("imagenet")


def test_fill_ids_are_numbered_per_dataset_and_survive_a_restart(
    model: ClusterModel, store: LmdbStateStore, clock: FakeClock
) -> None:
    imagenet = model.add_dataset(spec("imagenet"))
    coco = model.add_dataset(spec("coco"))
    assert [imagenet.next_fill_id("A"), imagenet.next_fill_id("B"), coco.next_fill_id("A")] == [
        "A-1",
        "B-2",
        "A-1",
    ]
    model.save_dataset(imagenet)
    reread = ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock).dataset("imagenet")
    assert reread.next_fill_id("A") == "A-3"
    assert DatasetState.from_json(reread.to_json()).fill_seq == 3


# --- nodes -------------------------------------------------------------------------------------


def test_liveness_membership_and_shard_bytes(model: ClusterModel, clock: FakeClock) -> None:
    model.add_dataset(spec("imagenet"), nodes=["n1", "n2", "n9"])
    register(model, "n1", last_seen=T0)
    register(model, "n2", last_seen=T0 - DOWN_AFTER_S - 1)  # silent too long: down
    register(model, "n3", last_seen=T0, datasets={"imagenet": {"shards": {"7": 100, "1023": 5}}})
    assert model.live_nodes() == ["n1", "n3"]
    assert [model.node_is_up(n) for n in ("n1", "n2", "n9")] == [True, False, False]
    assert model.copy_nodes("imagenet", "A") == ["n1", "n2", "n9"]  # up or down, known or not
    assert model.live_copy_nodes("imagenet", "A") == ["n1"]
    assert model.shard_bytes("n3", "imagenet") == {7: 100, 1023: 5}
    assert model.shard_bytes("n3", "coco") == {} and model.shard_bytes("n9", "imagenet") == {}
    clock.advance(DOWN_AFTER_S + 1)
    assert model.live_nodes() == []


def test_nodes_known_at_start_count_as_up_for_one_grace_period(
    store: LmdbStateStore, clock: FakeClock
) -> None:
    first = ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock)
    first.save("nodes/n1", NodeState("n1", "n1:7070", T0 - 3600, T0 - 3600).durable())
    clock.advance(3600)
    restarted = ClusterModel(store, down_after_s=DOWN_AFTER_S, clock=clock)
    assert restarted.cluster_id == first.cluster_id
    assert restarted.live_nodes() == ["n1"]
    clock.advance(DOWN_AFTER_S + 1)
    assert restarted.live_nodes() == []


# --- settings ----------------------------------------------------------------------------------


def coordinator_args(*given: str) -> dict[str, object]:
    args = build_parser().parse_args(["--state", "/tmp/s", "coordinator", *given])
    return vars(args)


def test_the_cli_writes_no_default_of_its_own() -> None:
    assert CoordinatorSettings.from_options(coordinator_args()) == CoordinatorSettings()
    defaults = CoordinatorSettings()
    assert (defaults.heartbeat_interval_s, defaults.job_lease_s, defaults.fill_timeout_s) == (
        2.0,
        600.0,
        3600.0,
    )
    assert defaults.node_down_after_s == DOWN_AFTER_HEARTBEATS * 2.0
    flags = [found.flag for _, found in options()]
    assert flags == [
        "--listen",
        "--store",
        "--heartbeat-interval",
        "--down-after",
        "--job-lease",
        "--lru-high-watermark",
        "--fill-timeout",
    ]


def test_each_option_given_reaches_its_setting() -> None:
    given = coordinator_args(
        "--listen", "0.0.0.0:9", "--store", "etcd://e:2379", "--heartbeat-interval", "500ms",
        "--down-after", "1m", "--job-lease", "0", "--lru-high-watermark", "1",
        "--fill-timeout", "2h",
    )  # fmt: skip
    assert CoordinatorSettings.from_options(given) == CoordinatorSettings(
        listen="0.0.0.0:9",
        store="etcd://e:2379",
        heartbeat_interval_s=0.5,
        down_after_s=60.0,
        job_lease_s=0.0,
        lru_high_watermark=1.0,
        fill_timeout_s=7200.0,
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (("--job-lease", "soon"), "--job-lease: invalid duration 'soon'"),
        (("--lru-high-watermark", "full"), "--lru-high-watermark: 'full' is not a number"),
        (("--lru-high-watermark", "1.5"), r"--lru-high-watermark must be in \(0, 1\], got 1.5"),
        (("--heartbeat-interval", "0s"), "--heartbeat-interval must be more than 0"),
        (("--down-after", "0"), "--down-after must be more than 0"),
    ],
)
def test_a_setting_it_cannot_use_is_one_line_naming_the_option(
    given: tuple[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        CoordinatorSettings.from_options(coordinator_args(*given))
