"""P1's TDCS table: training speed of cache configs 1–4 at 8, 32, 64 and 128 GPUs.

The paper's set-up (sections 4.1 and 6): Alibaba Cloud Kubernetes, servers of 8 NVIDIA Tesla
V100 each giving Alluxio 40 GB of RAM; ResNet-50 on ImageNet (1.28 M images, about 144 GB) with
TensorFlow and Horovod, batch 256 per GPU, the standard TensorFlow benchmark, stopped after a
preset number of epochs "with the model's accuracy at the industry standard"; the data on OSS
(section 4.4: the section-6 experiments read OSS). Section 6 trains with 8, 32, 64 and 128 GPUs
under four cache configs and reports the training speed (images/s):

1. no cache: the job reads OSS directly;
2. Alluxio as deployed by default (section 4.1: a static deployment on the 4 servers, 160 GB);
3. config 2 + TDCS's Preloader, with its CacheScaler (configs 3 and 4 both use it);
4. config 3 + TDCS's multi-task cache sharing: the job is placed on the nodes that already
   cache its dataset (section 5.2: S3 = S1 ∩ S2 first, greedily).

Figure 5 (the speeds) is an image missing from the text; the text gives the ranges compared
below. What the text does not give is our assumption, stated here and swept in the tables:

- Cluster: 32 nodes of 8 V100 (the paper names no size for section 6; 16 nodes would leave
  placement no choice at 128 GPUs). Each node's network link is 20 Gbit/s each way, the
  bandwidth Alibaba Cloud lists for its 8 x V100 16 GB instance (ecs.gn6v-c8g1.16xlarge, 256 GiB
  of RAM: room for the 40 GB cache). Reads of shards cached on another node cross the reader's
  and the holder's links, OSS reads the reader's link, and Horovod's ring all-reduce of
  ResNet-50's 102 MB of gradients per step takes its share of every link of a multi-node job
  (``ClusterConfig.nic_bytes_per_s``): locality is modelled, not assumed.
- OSS: 100 Gbit/s per account (Alibaba's documented download limit in Beijing, Shanghai,
  Hangzhou and Shenzhen; 10 Gbit/s was the default elsewhere, swept) and 0.4 GB/s to one node.
  The per-node figure is our choice: the paper gives none, and it sets the overall speed-up
  almost alone (swept below, with the range the paper's own results imply).
- Epochs: 90, ResNet-50's usual schedule to reference accuracy in the TensorFlow benchmark;
  the epoch count sets how much config 2's cold first epoch weighs (swept).
- The measured job is section 5.2's T2: a job on ImageNet submitted when a copy D1' of the
  dataset is already cached. Config 2's copy is Alluxio's 4 static workers, filled by the job's
  own first epoch. In configs 3 and 4 the CacheScaler has sized the copy to the job (max(4, N/8)
  nodes: 4 are needed to hold 144 GB) and the Preloader has filled it before the job arrives;
  Alluxio does not move cached blocks when workers are added, so the copy stays on the nodes it
  was loaded on. Configs 1–3 place the job as Kubernetes' default scheduler would on an idle
  cluster: on random nodes (seeded); config 4 places it with TDCS. The copy's nodes are random
  too (where the runtime's workers landed).
- Not modelled: the defaults section 4.2 blames for Alluxio's poor scaling (LocalFirstPolicy
  and passive caching duplicating and evicting blocks, CACHE_PROMOTE, RPCs per file, FUSE
  settings). Our config 2 admits each missed shard once, to its owner (what section 4.3's tuning
  achieves), so config 2 is, if anything, faster than the paper's.
- Repetitions: 5 per config and scale (seeds 1–5: where the copy and the job land); the tables
  give the mean and the spread. The paper gives no repetition count.
- The speed is the job's images/s from its start to its end, its start-up excluded.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from dataclasses import dataclass

from coordinator.scheduling import Policy, make_policy
from coordinator.scheduling.model import IoBandwidth, JobSpec
from coordinator.scheduling.tdcs import TdcsPolicy

from ..cluster import ClusterConfig, DatasetSpec, NodeSpec, Preload, Trace
from ..engine import Simulator
from ..report import VERDICT_RULE, Report, pct, verdict
from ..truth import CATALOGUE, profiles

GB = 10**9
SCALES = (8, 32, 64, 128)
CONFIGS = (1, 2, 3, 4)
NODES = 32
GPUS_PER_NODE = 8
#: Section 4.1: "每臺服務器可為Alluxio提供40 GB內存存儲".
CACHE_PER_NODE = 40 * GB
#: Section 4.1: Alluxio ran on the 4 servers (160 GB): the default, static deployment.
DEFAULT_WORKERS = 4
IMAGENET = DatasetSpec("imagenet", 144 * GB, 1_281_167)
BATCH_PER_GPU = 256
SEEDS = (1, 2, 3, 4, 5)
#: reads from the node's own RAM cache through FUSE (our choice; never the bottleneck here).
LOCAL_BYTES_PER_S = 4e9
#: the night the Preloader has: the job arrives a day after the preload starts.
JOB_ARRIVAL_S = 86_400.0


@dataclass(frozen=True)
class Setting:
    """The constants the paper does not give; each is swept in the report."""

    #: what one node reads from OSS, bytes/s (our choice).
    store_per_node: float = 0.4e9
    #: OSS's limit for the whole account, bytes/s (Alibaba's documented 100 Gbit/s).
    store_total: float = 100e9 / 8
    #: each node's network link, bytes/s each way (ecs.gn6v-c8g1.16xlarge: 20 Gbit/s).
    nic: float = 20e9 / 8
    epochs: int = 90


BASE = Setting()
#: The paper's ranges (section 6, the paragraph after configs 1–4: "2.2~3.7倍", "25%~200%",
#: "7%~102%", "4%~7%").
PAPER = {
    "config2_over_1": (0.25, 2.00),
    "config3_over_2": (0.07, 1.02),
    "config4_over_3": (0.04, 0.07),
    "overall": (2.2, 3.7),
}
#: (label, PAPER key, numerator config, denominator config)
STEPS = (
    ("config 2 over 1", "config2_over_1", 2, 1),
    ("config 3 over 2", "config3_over_2", 3, 2),
    ("config 4 over 3", "config4_over_3", 4, 3),
    ("config 4 over 1", "overall", 4, 1),
)
STORE_SWEEP = tuple(round(0.1 + 0.025 * i, 3) for i in range(37))  # 0.1 … 1.0 GB/s
STORE_SHOWN = (0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
NIC_SWEEP_GBIT = (10, 20, 35)
EPOCH_SWEEP = (1, 3, 10, 90)


@dataclass(frozen=True)
class Outcome:
    """One run: the job's speed and where its bytes came from (fractions of all it read)."""

    speed: float
    local: float
    remote: float
    store: float


def copy_width(gpus: int) -> int:
    """Nodes of the CacheScaler's copy: as many as the job, at least enough for 144 GB."""
    return max(math.ceil(IMAGENET.size / CACHE_PER_NODE), gpus // GPUS_PER_NODE)


def _node_names() -> list[str]:
    return [f"node{i:02d}" for i in range(NODES)]


def _copy_nodes(width: int, seed: int) -> frozenset[str]:
    """Where the cache runtime's workers landed: ``width`` random nodes (a stream of its own:
    the placement's seeded shuffle must not be correlated with it)."""
    return frozenset(random.Random(f"cache-workers-{seed}").sample(_node_names(), width))


def _job(gpus: int, epochs: int) -> JobSpec:
    profile = profiles(seed=1)["resnet50"]
    return JobSpec(
        f"t2-{gpus}",
        JOB_ARRIVAL_S,
        gpus,
        profile,
        epochs * IMAGENET.samples,
        IMAGENET.samples,
        batch_size=BATCH_PER_GPU,
        batch_per_gpu=True,
        dataset=IMAGENET.name,
    )


def setup(
    config: int, gpus: int, seed: int, setting: Setting = BASE
) -> tuple[ClusterConfig, Trace, Policy]:
    """The cluster, trace and policy of one config at one scale and seed."""
    nodes = tuple(NodeSpec(name, GPUS_PER_NODE, CACHE_PER_NODE) for name in _node_names())
    io = IoBandwidth(
        local_per_node=LOCAL_BYTES_PER_S,
        peer_per_node=setting.nic,  # unused: the links below carry peer reads
        store_per_node=setting.store_per_node,
        store_total=setting.store_total,
    )
    datasets = {IMAGENET.name: IMAGENET}
    job = (_job(gpus, setting.epochs),)
    random_placement = make_policy("random", seed=seed)

    def cluster(mode: str, copy: frozenset[str] | None = None) -> ClusterConfig:
        static = {IMAGENET.name: (copy,)} if copy else {}
        return ClusterConfig(
            nodes, io, mode, static, restart_s=10.0, seed=seed, nic_bytes_per_s=setting.nic
        )

    if config == 1:
        return cluster("none"), Trace(job, datasets), random_placement
    if config == 2:
        workers = _copy_nodes(DEFAULT_WORKERS, seed)
        return cluster("static", workers), Trace(job, datasets), random_placement
    copy = _copy_nodes(copy_width(gpus), seed)
    preloaded = Trace(job, datasets, (Preload(IMAGENET.name, 0.0, 1.0),))
    if config == 3:
        return cluster("static", copy), preloaded, random_placement
    return cluster("static", copy), preloaded, TdcsPolicy()


def measure(config: int, gpus: int, seed: int, setting: Setting = BASE) -> Outcome:
    """Run one config once: the job's training speed and the sources of its bytes."""
    result = Simulator(*setup(config, gpus, seed, setting)).run()
    (record,) = result.jobs
    startup = CATALOGUE["resnet50"].startup_s
    speed = record.spec.samples / (record.finish - record.first_start - startup)
    read = record.local_bytes + record.peer_bytes + record.store_bytes
    return Outcome(
        speed, record.local_bytes / read, record.peer_bytes / read, record.store_bytes / read
    )


def _mean(outcomes: list[Outcome]) -> Outcome:
    return Outcome(
        *(
            statistics.fmean(getattr(o, f.name) for o in outcomes)
            for f in dataclasses.fields(Outcome)
        )
    )


def measure_all(setting: Setting = BASE, seeds: tuple[int, ...] = SEEDS) -> dict:
    """{gpus: {config: [Outcome per seed]}}."""
    return {
        gpus: {
            config: [measure(config, gpus, seed, setting) for seed in seeds] for config in CONFIGS
        }
        for gpus in SCALES
    }


def step_values(runs: dict, numerator: int, denominator: int, overall: bool) -> list[float]:
    """One step per scale from the mean speeds: a ratio (overall) or a gain (0.5 = +50 %)."""
    values = []
    for gpus in SCALES:
        top = _mean(runs[gpus][numerator]).speed
        bottom = _mean(runs[gpus][denominator]).speed
        values.append(top / bottom if overall else top / bottom - 1)
    return values


def _paired(runs: dict, gpus: int, numerator: int, denominator: int) -> list[float]:
    """The step's gain in each repetition (same seed: same copy nodes)."""
    return [
        top.speed / bottom.speed - 1
        for top, bottom in zip(runs[gpus][numerator], runs[gpus][denominator], strict=True)
    ]


def run() -> Report:
    runs = measure_all()
    report = Report("p1_tdcs", "P1 — TDCS configs 1–4 (ours vs the paper)", __doc__ or "")
    data: dict[str, object] = {"paper": PAPER, "setting": dataclasses.asdict(BASE)}

    rows = []
    for gpus in SCALES:
        means = {config: _mean(runs[gpus][config]) for config in CONFIGS}
        spreads = {
            config: (
                min(o.speed for o in runs[gpus][config]),
                max(o.speed for o in runs[gpus][config]),
            )
            for config in CONFIGS
        }
        data[str(gpus)] = {
            **{f"config{c}_samples_per_s": means[c].speed for c in CONFIGS},
            **{f"config{c}_range": list(spreads[c]) for c in CONFIGS},
            **{
                f"config{c}_bytes": {
                    "local": means[c].local,
                    "remote": means[c].remote,
                    "store": means[c].store,
                }
                for c in CONFIGS
            },
        }
        rows.append(
            [
                gpus,
                *(_speed_cell(means[c].speed, spreads[c]) for c in CONFIGS),
                pct(means[2].speed / means[1].speed - 1),
                pct(means[3].speed / means[2].speed - 1),
                pct(means[4].speed / means[3].speed - 1),
                f"{means[4].speed / means[1].speed:.2f}x",
            ]
        )
    report.table(
        [
            "GPUs",
            "1 direct OSS",
            "2 default Alluxio",
            "3 + preload, scaler",
            "4 + TDCS placement",
            "2 vs 1",
            "3 vs 2",
            "4 vs 3",
            "4 vs 1",
        ],
        rows,
        f"Training speed, images/s (mean of {len(SEEDS)} repetitions, lowest–highest in brackets)",
    )

    side, verdicts = [], {}
    for label, key, numerator, denominator in STEPS:
        overall = key == "overall"
        ours = step_values(runs, numerator, denominator, overall)
        verdicts[key] = verdict(ours, PAPER[key])
        low, high = PAPER[key]
        if overall:
            paper, shown = f"{low:g}x to {high:g}x", [f"{v:.2f}x" for v in ours]
        else:
            paper = f"{low * 100:+.0f} % to {high * 100:+.0f} %"
            shown = [pct(v) for v in ours]
        side.append([label, paper, ", ".join(shown), verdicts[key]])
        data[key] = ours
    report.table(
        ["step", "paper", "ours (8 → 128 GPUs)", "ours in the paper's range?"],
        side,
        "Side by side (paper: section 6, the paragraph after configs 1–4)",
    )
    data["verdicts"] = verdicts
    overall = data["overall"]
    data["overall_range"] = [min(overall), max(overall)]

    locality_rows = []
    for gpus in SCALES:
        row: list[object] = [gpus, copy_width(gpus)]
        for config in (2, 3, 4):
            mean = _mean(runs[gpus][config])
            row.append(f"{mean.local * 100:.1f} / {mean.remote * 100:.1f} / {mean.store * 100:.1f}")
        gains = _paired(runs, gpus, 4, 3)
        row.append(f"{min(gains) * 100:+.1f} % to {max(gains) * 100:+.1f} %")
        locality_rows.append(row)
    report.table(
        [
            "GPUs",
            "copy nodes (3, 4)",
            "2: local / other nodes / OSS, % of bytes",
            "3: local / other nodes / OSS",
            "4: local / other nodes / OSS",
            "4 vs 3 per repetition",
        ],
        locality_rows,
        "Where the bytes came from: the locality effect of TDCS placement",
    )

    nic_rows, nic_data = [], {}
    for gbit in NIC_SWEEP_GBIT:
        setting = dataclasses.replace(BASE, nic=gbit * 1e9 / 8)
        swept = {
            gpus: {c: [measure(c, gpus, s, setting) for s in SEEDS] for c in (2, 3, 4)}
            for gpus in SCALES
        }
        gains3 = [_mean(swept[g][3]).speed / _mean(swept[g][2]).speed - 1 for g in SCALES]
        gains4 = [_mean(swept[g][4]).speed / _mean(swept[g][3]).speed - 1 for g in SCALES]
        nic_data[str(gbit)] = {"config3_over_2": gains3, "config4_over_3": gains4}
        nic_rows.append(
            [
                f"{gbit} Gbit/s",
                ", ".join(pct(v) for v in gains3),
                ", ".join(pct(v) for v in gains4),
                verdict(gains4, PAPER["config4_over_3"]),
            ]
        )
    data["nic_sweep"] = nic_data
    report.table(
        ["node link", "3 vs 2 (8 → 128 GPUs)", "4 vs 3 (8 → 128 GPUs)", "4 vs 3 in +4 %…+7 %?"],
        nic_rows,
        "Sweep: each node's network link (20 Gbit/s: the instance's; 35 Gbit/s: the larger "
        "8 x V100 instance's)",
    )

    store = _store_sweep(runs)
    data["store_sweep"] = store
    report.table(
        ["OSS per node", *(f"4 vs 1 at {g} GPUs" for g in SCALES), "in 2.2x–3.7x at every scale?"],
        [
            [
                f"{value:g} GB/s",
                *(f"{r:.2f}x" for r in store["overall"][str(value)]),
                store["inside"][str(value)],
            ]
            for value in STORE_SHOWN
        ],
        "Sweep: what one node reads from OSS (the constant that sets the overall speed-up)",
    )
    implied = store["implied_range_gb_per_s"]
    report.paragraph(
        "Which OSS bandwidth the paper's set-up implies",
        (
            "The paper gives no OSS throughput. Its set-up bounds it from above only: a node "
            f"cannot read faster than its {BASE.nic * 8 / 1e9:g} Gbit/s link "
            f"({BASE.nic / 1e9:.1f} GB/s), "
            f"and 16 nodes share the account's 100 Gbit/s ({BASE.store_total / 1e9:.1f} GB/s). At "
            "those bounds config 1 would not be starved at all at 8 GPUs. Its results bound it "
            "from both sides: config 4 over config 1 falls inside the paper's 2.2x–3.7x at all "
            + (
                f"four scales for {implied[0]:g} to {implied[1]:g} GB/s per node (0.025 GB/s steps)"
                if implied
                else "four scales for no value we swept"
            )
            + f"; ours, {BASE.store_per_node / 1e9:g} GB/s, "
            + (
                "lies inside"
                if implied and implied[0] <= BASE.store_per_node / 1e9 <= implied[1]
                else "lies outside"
            )
            + " that range. That range is an inference from the result, not a measurement: an "
            "OSS client reading 1.28 M small JPEG files is limited by per-request latency and "
            "concurrency, which the paper does not report. With the 10 Gbit/s account limit that "
            "was the default outside the largest regions, 16 nodes would share 1.25 GB/s and "
            f"config 4 over 1 at 128 GPUs would be {store['account_10gbit_128']:.1f}x."
        ),
    )

    epoch_rows, epoch_data = [], {}
    for epochs in EPOCH_SWEEP:
        setting = dataclasses.replace(BASE, epochs=epochs)
        gains = []
        for gpus in SCALES:
            two = statistics.fmean(measure(2, gpus, s, setting).speed for s in SEEDS)
            three = statistics.fmean(measure(3, gpus, s, setting).speed for s in SEEDS)
            gains.append(three / two - 1)
        epoch_data[str(epochs)] = gains
        epoch_rows.append(
            [epochs, ", ".join(pct(v) for v in gains), verdict(gains, PAPER["config3_over_2"])]
        )
    data["epoch_sweep"] = epoch_data
    report.table(
        ["epochs", "3 vs 2 (8 → 128 GPUs)", "in +7 %…+102 %?"],
        epoch_rows,
        "Sweep: epochs per job (config 2's cold first epoch weighs 1/epochs)",
    )
    report.data = data
    report.paragraph("Why ours differs", _why(data, runs))
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _speed_cell(mean: float, spread: tuple[float, float]) -> str:
    low, high = spread
    if high - low < 0.5:
        return f"{mean:,.0f}"
    return f"{mean:,.0f} ({low:,.0f}–{high:,.0f})"


def _store_sweep(runs: dict) -> dict:
    """Config 4 over config 1 for each OSS bandwidth per node. Config 4 reads nothing from OSS
    (its copy is preloaded), so only config 1 is rerun."""
    config4 = {gpus: _mean(runs[gpus][4]).speed for gpus in SCALES}
    overall: dict[str, list[float]] = {}
    inside: dict[str, str] = {}
    for value in STORE_SWEEP:
        setting = dataclasses.replace(BASE, store_per_node=value * 1e9)
        ratios = [config4[g] / measure(1, g, SEEDS[0], setting).speed for g in SCALES]
        overall[str(value)] = ratios
        inside[str(value)] = verdict(ratios, PAPER["overall"])
    fitting = [v for v in STORE_SWEEP if inside[str(v)].startswith("inside")]
    limited = dataclasses.replace(BASE, store_total=10e9 / 8)
    account = config4[128] / measure(1, 128, SEEDS[0], limited).speed
    return {
        "overall": overall,
        "inside": inside,
        "implied_range_gb_per_s": [min(fitting), max(fitting)] if fitting else [],
        "account_10gbit_128": account,
    }


def _why(data: dict, runs: dict) -> str:
    step4 = data["config4_over_3"]
    step3 = data["config3_over_2"]
    overall = data["overall"]
    remote3 = [_mean(runs[g][3]).remote for g in SCALES]
    remote4 = [_mean(runs[g][4]).remote for g in SCALES]
    nic10 = data["nic_sweep"]["10"]["config4_over_3"]
    ordered = all(
        _mean(runs[g][1]).speed < _mean(runs[g][2]).speed <= _mean(runs[g][3]).speed * (1 + 1e-9)
        and _mean(runs[g][3]).speed <= _mean(runs[g][4]).speed * (1 + 1e-9)
        for g in SCALES
    )
    # Config 3 removes config 2's cold first epoch everywhere; a larger gain means config 2's
    # 4 static workers were the bottleneck at that scale.
    cold_only = min(step3)
    starved = [g for g, gain in zip(SCALES, step3, strict=True) if gain > cold_only + 0.02]
    inside = verdict(overall, PAPER["overall"]).startswith("inside")
    placement_pays = max(step4) >= 0.005
    return (
        f"The order 1 < 2 ≤ 3 ≤ 4 {'holds' if ordered else 'does NOT hold'} at every scale. "
        "TDCS placement (config 4) does to the bytes what the paper says it does: the job "
        f"reads {', '.join(f'{r * 100:.0f} %' for r in remote4)} of its data from other nodes "
        f"(8 → 128 GPUs), against {', '.join(f'{r * 100:.0f} %' for r in remote3)} when placed "
        "at random (config 3). Each node of a co-located job holds 1/K of the K-node copy and "
        "reads that share locally; data-parallel training reads every sample from anywhere, so "
        "it still reads (K−1)/K over the network. Synchronous training runs at its slowest "
        "node's pace, and placed at random some node is almost always off the copy, so config "
        "3's speed is that of a node reading everything remotely. The speed gain of config 4 is "
        f"{', '.join(pct(v) for v in step4)}"
        + (
            ": with 20 Gbit/s links a node's remote reads (≈1 GB/s at full speed) and its "
            "gradient exchange both fit, so reading less over the link saves no time. "
            if not placement_pays
            else ". "
        )
        + "Placement pays where the link is the bottleneck: with 10 Gbit/s links config 4 "
        f"gains {', '.join(pct(v) for v in nic10)}"
        + (
            " (at 8 GPUs the job has one node and no gradient exchange, and its link suffices, "
            "as the paper found no clear gain at 8 GPUs; the gain falls with scale as 1/K does)"
            if abs(nic10[0]) < 0.005
            else ""
        )
        + ". The paper's +4 % to +7 % would need a network that binds by about that much; "
        "whatever else "
        "co-location saved on the paper's cluster (Alluxio's remote-read RPCs, FUSE, CPU, "
        "section 4.2) is not modelled. Config 3 over 2 is "
        f"{', '.join(pct(v) for v in step3)}: everywhere it removes config 2's cold first epoch "
        f"(1/{BASE.epochs} of the run; the epoch sweep shows that share growing as runs get "
        "shorter)"
        + (
            f"; at {' and '.join(str(g) for g in starved)} GPUs config 2's {DEFAULT_WORKERS} "
            "static workers must also serve every node through their own links, and the "
            "scaler's wider copy spreads that load: section 5's scaling bottleneck, from the "
            "link model."
            if starved
            else "."
        )
        + f" The overall speed-up, {min(overall):.2f}x to {max(overall):.2f}x, is "
        f"{'inside' if inside else 'outside'} the paper's 2.2x–3.7x because of the OSS "
        f"bandwidth per node we chose ({BASE.store_per_node / 1e9:g} GB/s, kept from the "
        "earlier version of this experiment, not fitted): it sets that ratio almost alone "
        "(the sweep)."
    )
