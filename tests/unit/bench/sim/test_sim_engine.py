"""The simulator: conservation of GPUs and bytes, every policy finishing a fixed trace, cache
effects, and refusing what a policy may not do."""

from __future__ import annotations

import dataclasses
import random

import pytest

from bench.sim.cluster import ClusterConfig, DatasetSpec, NodeSpec, Preload, SimulationError, Trace
from bench.sim.engine import Simulator
from bench.sim.traces import job_lasting
from bench.sim.truth import profiles
from coordinator.scheduling import POLICY_NAMES, make_policy
from coordinator.scheduling.model import (
    ClusterState,
    Decision,
    IoBandwidth,
    JobSpec,
    PlacementChoice,
    QosClass,
    Start,
)
from coordinator.scheduling.policy import Policy

GB = 10**9
IO = IoBandwidth(local_per_node=4e9, peer_per_node=1e9, store_per_node=0.4e9, store_total=1e9)
DATASETS = {
    "small": DatasetSpec("small", 20 * GB, 100_000),
    "large": DatasetSpec("large", 60 * GB, 200_000),
}


def nodes(count: int = 3, cache: int = 30 * GB) -> tuple[NodeSpec, ...]:
    return tuple(NodeSpec(f"n{i}", 4, cache, 15.7e12, 900e9, 25e9, 10.0) for i in range(count))


def fixed_trace() -> Trace:
    """Ten short jobs: mixed sizes, QoS classes, with and without data."""
    rng = random.Random(11)
    fitted = profiles(0)
    jobs = []
    for index in range(10):
        dataset = rng.choice(["small", "large", None])
        spe = DATASETS[dataset].samples if dataset else 20_000
        spec = job_lasting(
            f"j{index}",
            index * 120.0,
            rng.uniform(120, 900),
            rng.choice([1, 2, 4]),
            fitted[rng.choice(["resnet50", "alexnet", "googlenet"])],
            per_node=4,
            samples_per_epoch=spe,
            dataset=dataset,
            qos=rng.choice(list(QosClass)),
            max_gpus=4,
        )
        jobs.append(dataclasses.replace(spec, samples=max(spec.samples, 1.5 * spe)))
    return Trace(tuple(jobs), DATASETS)


class Checked(Policy):
    """Wraps a policy and checks, at every decision point, what the simulator shows it."""

    base_name = "checked"

    def __init__(self, inner: Policy) -> None:
        super().__init__()
        self.inner = inner
        self.checks = 0

    def schedule(self, state: ClusterState) -> list[Decision]:
        for name, node in state.nodes.items():
            held = sum(job.placement.get(name, 0) for job in state.running)
            assert node.free_gpus + held == node.gpus, f"GPUs not conserved on {name}"
            assert node.cache_used <= node.cache_capacity, f"cache over capacity on {name}"
        for dataset in state.datasets.values():
            assert sum(dataset.cached.values()) <= dataset.size * max(1, len(dataset.copies))
        self.checks += 1
        return self.inner.schedule(state)

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        return self.inner.place(job, state)

    def next_wakeup(self, state: ClusterState) -> float | None:
        return self.inner.next_wakeup(state)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_finishes_every_job_and_conserves(name: str) -> None:
    trace = fixed_trace()
    checked = Checked(make_policy(name, seed=1))
    result = Simulator(ClusterConfig(nodes(), IO, "follow"), trace, checked).run()
    assert checked.checks > 0
    assert {r.spec.job_id for r in result.jobs} == {j.job_id for j in trace.jobs}
    for record in result.jobs:
        assert record.finish >= record.first_start >= record.spec.arrival
        # Every sample was read once per epoch: local + peer + store = the bytes of the samples.
        if record.spec.dataset:
            sample_bytes = DATASETS[record.spec.dataset].sample_bytes
            read = record.local_bytes + record.peer_bytes + record.store_bytes
            assert read == pytest.approx(record.spec.samples * sample_bytes, rel=1e-6)
        else:
            assert record.local_bytes == record.peer_bytes == record.store_bytes == 0
    assert 0 < result.gpu_utilisation <= 1.0 + 1e-9


def test_runs_are_deterministic() -> None:
    first = Simulator(ClusterConfig(nodes(), IO), fixed_trace(), make_policy("p2-elastic")).run()
    second = Simulator(ClusterConfig(nodes(), IO), fixed_trace(), make_policy("p2-elastic")).run()
    assert first.summary() == second.summary()


def one_job(epochs: int, *, arrival: float = 0.0, dataset: str = "small") -> JobSpec:
    spe = DATASETS[dataset].samples
    return JobSpec(
        "solo", arrival, 4, profiles(0)["resnet50"], epochs * spe, spe, 256, True, dataset
    )


def test_the_cache_makes_later_epochs_cheaper_and_stores_bytes_once() -> None:
    trace = Trace((one_job(3),), DATASETS)
    cold = Simulator(ClusterConfig(nodes(1), IO, "none"), trace, make_policy("fifo")).run()
    cached = Simulator(ClusterConfig(nodes(1), IO, "follow"), trace, make_policy("fifo")).run()
    size = DATASETS["small"].size
    assert cold.store_bytes == pytest.approx(3 * size)
    assert cached.store_bytes == pytest.approx(size)  # only the first epoch misses
    assert cached.jobs[0].jct < cold.jobs[0].jct


def test_a_cache_smaller_than_the_data_avoids_eviction() -> None:
    # 60 GB dataset, one 30 GB node: half is cached by the first epoch and stays; the other
    # half is read through on every epoch (no thrashing, no second copy).
    trace = Trace((one_job(3, dataset="large"),), DATASETS)
    result = Simulator(ClusterConfig(nodes(1), IO, "follow"), trace, make_policy("fifo")).run()
    size = DATASETS["large"].size
    assert result.store_bytes == pytest.approx(size + 2 * size / 2)


def test_preload_turns_the_first_epoch_into_hits() -> None:
    preload = (Preload("small", 0.0, 1.0, frozenset({"n0"})),)
    trace = Trace((one_job(2, arrival=3600.0),), DATASETS, preload)
    result = Simulator(ClusterConfig(nodes(1), IO, "static"), trace, make_policy("fifo")).run()
    assert result.jobs[0].store_bytes == pytest.approx(0.0, abs=1.0)
    assert result.preload_store_bytes == pytest.approx(DATASETS["small"].size)


class Greedy(Policy):
    """A broken policy: starts every waiting job on node n0 whether or not GPUs are free."""

    base_name = "greedy"

    def place(self, job: JobSpec, state: ClusterState) -> PlacementChoice | None:
        return None

    def schedule(self, state: ClusterState) -> list[Decision]:
        return [Start(job.job_id, {"n0": 4}) for job in state.waiting]


class Idle(Greedy):
    """Another broken policy: never starts anything."""

    base_name = "idle"

    def schedule(self, state: ClusterState) -> list[Decision]:
        return []


def test_a_policy_that_overcommits_gpus_is_stopped() -> None:
    trace = Trace((one_job(1), dataclasses.replace(one_job(1), job_id="two")), DATASETS)
    with pytest.raises(SimulationError, match=r"greedy.*GPUs on 'n0' are not free"):
        Simulator(ClusterConfig(nodes(1), IO), trace, Greedy()).run()


def test_a_policy_that_never_starts_jobs_is_stopped() -> None:
    with pytest.raises(SimulationError, match=r"idle left jobs .*never finish"):
        Simulator(ClusterConfig(nodes(1), IO), Trace((one_job(1),), DATASETS), Idle()).run()


def test_bad_inputs_are_named() -> None:
    with pytest.raises(SimulationError, match="cache_mode 'sometimes'"):
        ClusterConfig(nodes(1), IO, "sometimes")
    with pytest.raises(SimulationError, match="asks 4 GPUs; the cluster has 2"):
        tiny = (NodeSpec("n0", 2),)
        Simulator(ClusterConfig(tiny, IO), Trace((one_job(1),), DATASETS), make_policy("fifo"))
    with pytest.raises(SimulationError, match="dataset 'small' is not in the trace"):
        Simulator(ClusterConfig(nodes(1), IO), Trace((one_job(1),)), make_policy("fifo"))
