"""P1's reproduction: the network-link model behind co-location, and the experiment's configs.

The link cases are small enough to compute by hand: 1e8-byte samples, 1 GB/s links, a job
that computes thousands of samples/s, so every job here is bound by where its bytes come from.
"""

from __future__ import annotations

import dataclasses

import pytest

from bench.sim.cluster import ClusterConfig, DatasetSpec, NodeSpec, Preload, Trace
from bench.sim.engine import Simulator
from bench.sim.experiments import p1
from bench.sim.truth import CATALOGUE
from coordinator.scheduling import make_policy
from coordinator.scheduling.model import IoBandwidth, JobSpec, ModelProfile

GB = 10**9
DATA = DatasetSpec("d", GB, 10)  # 10 samples of 1e8 bytes
LINK = 1e9  # bytes/s each way
STARTUP = CATALOGUE["alexnet"].startup_s  # 10 s


def _job(job_id: str, nodes: set[str], gpus: int = 1, sync_bytes: float | None = None) -> JobSpec:
    """100 samples (10 epochs) of AlexNet, which computes ~7,600 samples/s per GPU: data-bound."""
    profile = ModelProfile("alexnet", (1.0, 0.0, 0.0), sync_bytes=sync_bytes)
    return JobSpec(
        job_id, 100.0, gpus, profile, 100.0, 10, dataset="d", candidates=frozenset(nodes)
    )


def _run(jobs: list[JobSpec], copy: set[str], nodes: str = "abcd") -> dict[str, object]:
    """Run ``jobs`` (FIFO, on their candidate nodes) with the dataset preloaded on the nodes
    ``copy``, an equal share on each."""
    specs = tuple(NodeSpec(name, 1, 2 * GB) for name in nodes)
    io = IoBandwidth(local_per_node=4e9, peer_per_node=1e12, store_per_node=1e9, store_total=1e9)
    cluster = ClusterConfig(
        specs, io, "static", {"d": (frozenset(copy),)}, nic_bytes_per_s=LINK, seed=1
    )
    trace = Trace(tuple(jobs), {"d": DATA}, (Preload("d", 0.0, 1.0),))
    result = Simulator(cluster, trace, make_policy("fifo")).run()
    return {record.spec.job_id: record for record in result.jobs}


def test_a_remote_read_runs_at_the_link_rate() -> None:
    # Job on a, every shard on b: 1e9 B/s over a's inbound and b's outbound link = 10
    # samples/s, so 100 samples take 10 s after the 10 s start-up.
    (record,) = _run([_job("j", {"a"})], {"b"}).values()
    assert record.jct == pytest.approx(STARTUP + 10.0)
    assert record.peer_bytes == pytest.approx(100 * 1e8) and record.local_bytes == 0


def test_two_readers_share_the_holders_outbound_link() -> None:
    # Jobs on a and c both read from b: b's outbound link gives each 0.5e9 B/s = 5 samples/s.
    records = _run([_job("j1", {"a"}), _job("j2", {"c"})], {"b"})
    assert [r.jct for r in records.values()] == pytest.approx([STARTUP + 20.0] * 2)


def test_a_co_located_reader_crosses_no_link() -> None:
    # Job on b, which holds everything: local reads at 4e9 B/s = 40 samples/s.
    (record,) = _run([_job("j", {"b"})], {"b"}).values()
    assert record.jct == pytest.approx(STARTUP + 2.5)
    assert record.local_bytes == pytest.approx(100 * 1e8) and record.peer_bytes == 0


def test_the_gradient_exchange_takes_its_fair_share_of_the_link() -> None:
    """A 2-node job (a and c) reading a copy on b and d, half each.

    Without gradients: a's inbound link gives its one peer flow 1e9 B/s; b and d each serve two
    flows (from a and c) at 0.5e9 B/s, and a reads half its bytes from each, so 1e9 B/s: 10
    samples/s on each node's half of the samples, 20 samples/s for the job: 5 s.
    With 1e8 gradient bytes per step (2·(2−1)/2·1e8·46 steps/s ≈ 4.7e9 B/s wanted), max-min
    fairness gives the exchange half of a's link: 0.5e9 B/s for data, 10 samples/s: 10 s.
    """
    plain = _run([_job("j", {"a", "c"}, gpus=2)], {"b", "d"})["j"]
    assert plain.jct == pytest.approx(STARTUP + 5.0)
    exchanging = _run([_job("j", {"a", "c"}, gpus=2, sync_bytes=1e8)], {"b", "d"})["j"]
    assert exchanging.jct == pytest.approx(STARTUP + 10.0)


def test_copy_width_follows_section_4_1_capacity() -> None:
    # 144 GB over 40 GB per node needs 4 nodes; a larger job's copy spans its nodes.
    assert [p1.copy_width(g) for g in p1.SCALES] == [4, 4, 8, 16]


def test_configs_differ_only_as_the_paper_defines_them() -> None:
    one, _, _ = p1.setup(1, 32, seed=1)
    two, _, _ = p1.setup(2, 32, seed=1)
    three, preloaded, random_placement = p1.setup(3, 32, seed=1)
    four, preloaded4, tdcs = p1.setup(4, 32, seed=1)
    assert one.cache_mode == "none"
    assert [len(c) for c in two.static_copies["imagenet"]] == [4]
    assert three.static_copies == four.static_copies and preloaded == preloaded4
    assert preloaded.preloads and random_placement.name == "random" and tdcs.name == "tdcs"


def test_tdcs_placement_reads_less_over_the_network() -> None:
    """The locality effect: at 32 GPUs (4 nodes on a 4-node copy) the co-located job reads a
    quarter of its bytes locally; placed at random it reads (almost) none."""
    random_placed = p1.measure(3, 32, seed=1)
    co_located = p1.measure(4, 32, seed=1)
    assert co_located.local == pytest.approx(0.25)
    assert co_located.remote < random_placed.remote
    # With 10 Gbit/s links the network is the bottleneck and reading less over it is faster.
    short = dataclasses.replace(p1.BASE, nic=10e9 / 8)
    assert p1.measure(4, 32, 1, short).speed > 1.1 * p1.measure(3, 32, 1, short).speed
