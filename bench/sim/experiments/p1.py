"""P1's TDCS table: training speed of configs 1–4 against reading the object store directly.

Setup (ours, following the paper where it says): ResNet-50 on ImageNet (1.28 M images,
144 GB), batch 256 per GPU, V100-class GPUs, 8 per node, 40 GB RAM cache per node. Two jobs of
N GPUs (N = 8, 32, 64, 128) share the dataset, each training 3 epochs, on a 32-node cluster
(enough nodes for both). Speed = samples per second of training (start-up excluded), averaged
over the two jobs.

1. no cache: every read goes to the object store, random placement;
2. default cache: workers on every node pool their RAM into one copy striped over all nodes
   (rendezvous), filled by the first epoch's reads; random placement;
3. config 2 + preload of the whole dataset before the jobs start;
4. config 3 + TDCS: the CacheManager keeps at most one job per copy, so the second job's copy is
   a clone; each copy spans max(4, N/8) nodes (enough RAM for the dataset, as many nodes as a
   job), is preloaded, and TDCS places each job copy nodes first (S3 = S1 ∩ S2).
"""

from __future__ import annotations

import dataclasses

from coordinator.scheduling import Policy, make_policy
from coordinator.scheduling.model import IoBandwidth, JobSpec
from coordinator.scheduling.tdcs import TdcsPolicy

from ..cluster import ClusterConfig, DatasetSpec, NodeSpec, Preload, Trace
from ..engine import Simulator
from ..report import VERDICT_RULE, Report, pct, verdict
from ..truth import profiles

GB = 10**9
SCALES = (8, 32, 64, 128)
EPOCHS = 3
NODES = 32
IMAGENET = DatasetSpec("imagenet", 144 * GB, 1_281_167)
#: a 2019 cloud: ~0.4 GB/s per instance to the object store, 10 GB/s per bucket, ~1.2 GB/s
#: effective reads from a remote cache worker, 4 GB/s from the local cache.
IO = IoBandwidth(local_per_node=4e9, peer_per_node=1.2e9, store_per_node=0.4e9, store_total=10e9)
PAPER = {
    "config2_over_1": (0.25, 2.00),
    "config3_over_2": (0.07, 1.02),
    "config4_over_3": (0.04, 0.07),
    "overall": (2.2, 3.7),
}


def _cluster(
    cache_mode: str, io: IoBandwidth, copies: tuple[frozenset[str], ...] = ()
) -> ClusterConfig:
    nodes = tuple(NodeSpec(f"node{i:02d}", 8, 40 * GB) for i in range(NODES))
    static = {IMAGENET.name: copies} if copies else {}
    return ClusterConfig(nodes, io, cache_mode, static, restart_s=10.0, seed=1)


def _jobs(gpus: int, start: float) -> tuple[JobSpec, ...]:
    profile = profiles(seed=1)["resnet50"]
    return tuple(
        JobSpec(
            f"{name}-{gpus}",
            start,
            gpus,
            profile,
            EPOCHS * IMAGENET.samples,
            IMAGENET.samples,
            batch_size=256,
            batch_per_gpu=True,
            dataset=IMAGENET.name,
        )
        for name in ("a", "b")
    )


def _setup(config: int, gpus: int, io: IoBandwidth) -> tuple[ClusterConfig, Trace, Policy]:
    """The cluster, trace and policy of one config at one scale."""
    datasets = {IMAGENET.name: IMAGENET}
    if config == 1:
        trace = Trace(_jobs(gpus, 0.0), datasets)
        return _cluster("none", io), trace, make_policy("random", seed=7)
    if config == 2:
        trace = Trace(_jobs(gpus, 0.0), datasets)
        return _cluster("static", io), trace, make_policy("random", seed=7)
    # Configs 3 and 4 preload at t=0; the jobs arrive a day later, when it is long done.
    later = _jobs(gpus, 86_400.0)
    if config == 3:
        trace = Trace(later, datasets, (Preload(IMAGENET.name, 0.0, 1.0),))
        return _cluster("static", io), trace, make_policy("random", seed=7)
    # Config 4: the CacheManager keeps one copy per job (at most 1 job per copy), each sized to
    # hold the dataset and to match a job's nodes, both preloaded; TDCS places each job on one.
    width = max(4, gpus // 8)
    copies = tuple(
        frozenset(f"node{i:02d}" for i in range(first, first + width)) for first in (0, width)
    )
    preloads = tuple(Preload(IMAGENET.name, 0.0, 1.0, copy) for copy in copies)
    policy = TdcsPolicy(max_jobs_per_copy=1, overflow="suspend")
    return _cluster("static", io, copies), Trace(later, datasets, preloads), policy


def _speed(config: int, gpus: int, io: IoBandwidth = IO) -> float:
    """Mean training speed (samples/s, start-up excluded) of the two jobs under ``config``."""
    result = Simulator(*_setup(config, gpus, io)).run()
    speeds = [
        record.spec.samples / (record.jct - record.spec.profile.startup_s) for record in result.jobs
    ]
    return sum(speeds) / len(speeds)


#: The paper's steps (section 6, its last results paragraph: "2.2~3.7倍", "25%~200%",
#: "7%~102%", "4%~7%"), as (label, PAPER key, numerator config, denominator config).
STEPS = (
    ("config 2 over 1", "config2_over_1", 2, 1),
    ("config 3 over 2", "config3_over_2", 3, 2),
    ("config 4 over 3", "config4_over_3", 4, 3),
    ("config 4 over 1", "overall", 4, 1),
)


def _step(data: dict, key: str, numerator: int, denominator: int) -> list[float]:
    """Our value of one step at each scale: a gain (0.68 = +68 %), or a ratio for ``overall``."""
    ratios = [
        data[str(g)][f"config{numerator}_samples_per_s"]
        / data[str(g)][f"config{denominator}_samples_per_s"]
        for g in SCALES
    ]
    return ratios if key == "overall" else [ratio - 1 for ratio in ratios]


def run() -> Report:
    rows, data = [], {}
    for gpus in SCALES:
        speeds = {config: _speed(config, gpus) for config in (1, 2, 3, 4)}
        data[str(gpus)] = {f"config{c}_samples_per_s": s for c, s in speeds.items()}
        rows.append(
            [
                gpus,
                *(f"{speeds[c]:,.0f}" for c in (1, 2, 3, 4)),
                pct(speeds[2] / speeds[1] - 1),
                pct(speeds[3] / speeds[2] - 1),
                pct(speeds[4] / speeds[3] - 1),
                f"{speeds[4] / speeds[1]:.2f}x",
            ]
        )
    report = Report("p1_tdcs", "P1 — TDCS configs 1–4 (ours vs the paper)", __doc__ or "")
    report.table(
        [
            "GPUs per job",
            "1 direct store",
            "2 default cache",
            "3 + preload",
            "4 + TDCS",
            "2 vs 1",
            "3 vs 2",
            "4 vs 3",
            "4 vs 1",
        ],
        rows,
        "Training speed, samples/s per job (ours)",
    )
    side, verdicts = [], {}
    for label, key, numerator, denominator in STEPS:
        ours = _step(data, key, numerator, denominator)
        low, high = PAPER[key]
        verdicts[key] = verdict(ours, PAPER[key])
        if key == "overall":
            paper, shown = f"{low:g}x to {high:g}x", [f"{value:.2f}x" for value in ours]
        else:
            paper = f"{low * 100:+.0f} % to {high * 100:+.0f} %"  # as the paper prints them
            shown = [pct(value) for value in ours]
        side.append([label, paper, ", ".join(shown), verdicts[key]])
    report.table(
        ["step", "paper", "ours (8 → 128 GPUs)", "ours in the paper's range?"],
        side,
        "Side by side (paper: section 6, the paragraph after configs 1–4)",
    )
    data["verdicts"] = verdicts
    overall = [
        data[str(g)]["config4_samples_per_s"] / data[str(g)]["config1_samples_per_s"]
        for g in SCALES
    ]
    data["overall_range"] = [min(overall), max(overall)]
    # Sensitivity: TDCS placement pays once remote-cache reads are slower than a node's demand.
    slow_peer = dataclasses.replace(IO, peer_per_node=0.8e9)
    sensitivity = []
    for gpus in SCALES:
        gain = _speed(4, gpus, slow_peer) / _speed(3, gpus, slow_peer) - 1
        sensitivity.append([gpus, pct(gain)])
        data[str(gpus)]["config4_over_3_peer_0.8GBps"] = gain
    report.table(
        ["GPUs per job", "4 vs 3 with 0.8 GB/s peer reads"],
        sensitivity,
        "Sensitivity: TDCS placement when remote-cache reads are slower",
    )
    data["paper"] = PAPER
    report.data = data
    report.paragraph("Why ours differs", _why(data, overall))
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _why(data: dict, overall: list[float]) -> str:
    inside = verdict(overall, PAPER["overall"]).startswith("inside")
    step4 = [
        data[str(g)]["config4_samples_per_s"] / data[str(g)]["config3_samples_per_s"] - 1
        for g in SCALES
    ]
    ordered = all(
        data[str(g)]["config1_samples_per_s"]
        < data[str(g)]["config2_samples_per_s"]
        < data[str(g)]["config3_samples_per_s"]
        <= data[str(g)]["config4_samples_per_s"] * (1 + 1e-9)
        for g in SCALES
    )
    return (
        f"The ordering 1 < 2 < 3 ≤ 4 {'holds' if ordered else 'does NOT hold'} at every scale "
        f"(config 4 is {min(step4) * 100:+.1f} % to {max(step4) * 100:+.1f} % over config 3, "
        "where the paper has +4 % to +7 %). The overall gain, "
        f"{min(overall):.2f}x to {max(overall):.2f}x, is "
        f"{'inside' if inside else 'outside'} the paper's 2.2x–3.7x. In our model the gain is "
        "set by one ratio: the GPUs' data demand (≈1.0 GB/s per 8-V100 node for ResNet-50) over "
        "what the store gives a node (0.4 GB/s, fewer when the bucket's 10 GB/s is shared); it "
        "grows at 128 GPUs because 32 nodes then share the bucket. The paper measured a real "
        "OSS whose per-node throughput also fell with scale, which our equal-share model only "
        "approximates. Config 2's gain depends on how many epochs are measured (the first epoch "
        "is cold); we measure 3. TDCS placement (config 4) turns peer reads into local "
        "reads, which only pays when peer bandwidth is short, and our per-node peer bandwidth "
        "(1.2 GB/s) is just above one node's demand; the paper's network also carried the other "
        "jobs' traffic, which we do not model. With remote-cache reads at 0.8 GB/s per node "
        "(the sensitivity table) placement starts to pay, because a job on its copy reads a "
        "share of its data locally."
    )
