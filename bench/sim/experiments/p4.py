"""P4's result: how often the Roofline prediction picks the allocation that measures fastest.

Setup (the paper's, P4 section 4.1 "實驗環境"): AlexNet (W = 334 MFLOPs, M = 289 MB per sample,
I = 1.16 FLOP/B, its Table 1) on MNIST, one GTX 1080 (π = 6.1 TFLOP/s, β = 352 GB/s) and two
GTX 970 (π = 5.2 TFLOP/s, β = 232 GB/s), a 100 Mbit/s LAN; 7 allocations per trial (3 single
nodes, 3 pairs, all three). The paper ran "1000組相同的實驗" (1000 identical experiments, section
4.2) of 50 epochs each and gives no synchronisation frequency; identical trials would measure
only how often noise flips one near-tie, so per trial (ours) we draw a training run of 1–10
epochs over 10–100 % of MNIST's 60,000 samples, synchronising the model 1–20 times per epoch
(log-uniform), so that single-node and distributed runs both win some trials.

"Measured" times come from a testbed model the predictor does not see: each GPU reaches only a
fraction of its Roofline bound (GTX 1080 85 %, GTX 970 80 %: the 970's slow last 0.5 GB), the
LAN delivers 90 % of its nominal rate, start-up overheads vary ±20 % around the history the
predictor uses, and every run has log-normal noise (σ = 5 % compute, 10 % network).
"""

from __future__ import annotations

import itertools
import math
import random
import statistics

from coordinator.scheduling.roofline import (
    TRAIN_PASSES,
    Allocation,
    ModelCost,
    Worker,
    attainable_flops,
    best_allocation,
    predict,
)

from ..report import VERDICT_RULE, Report, figure, verdict

TRIALS = 1000
ALEXNET = ModelCost(flops=334e6, memory_bytes=289e6)
LAN_BITS = 100e6
#: π and β as P4 (the paper) gives them in section 4.1, after its Table 1: "GeForce GTX1080的π為
#: 6.1TFOLP/s,β為352GB/s ... GeForce GTX970的π為5.2TFOLP/s,β為232GB/s", so that AlexNet is
#: memory-bound on both, at 408.32 and 269.12 GFLOP/s.
GTX1080 = {"peak": 6.1e12, "bandwidth": 352e9, "overhead": 3.0, "efficiency": 0.85}
GTX970 = {"peak": 5.2e12, "bandwidth": 232e9, "overhead": 4.0, "efficiency": 0.80}
NODES = {"gtx1080": GTX1080, "gtx970-a": GTX970, "gtx970-b": GTX970}
#: What this experiment used before it took the paper's figures: NVIDIA's spec sheets (GTX 1080
#: 8.873 TFLOP/s; GTX 970 3.92 TFLOP/s, 224 GB/s). Rerun beside the paper's to show what moved.
PREVIOUS_NODES = {
    "gtx1080": {**GTX1080, "peak": 8.873e12},
    "gtx970-a": {**GTX970, "peak": 3.920e12, "bandwidth": 224e9},
    "gtx970-b": {**GTX970, "peak": 3.920e12, "bandwidth": 224e9},
}
NETWORK_EFFICIENCY = 0.90
#: P4 section 4.2: 1000 identical experiments, "得到91.6%的高準確率".
PAPER_ACCURACY = 0.916
#: P4 section 4.1: I = 1.16 FLOP/B; attainable 408.32 (GTX 1080) and 269.12 (GTX 970) GFLOP/s.
PAPER_INTENSITY = 1.16
PAPER_ATTAINABLE = {"gtx1080": 408.32e9, "gtx970": 269.12e9}


Hardware = dict[str, dict[str, float]]


def _workers(nodes: Hardware) -> list[Worker]:
    return [
        Worker(name, 1, hw["peak"], hw["bandwidth"], LAN_BITS, hw["overhead"])
        for name, hw in nodes.items()
    ]


def _measured(
    allocation: Allocation,
    samples: float,
    syncs: float,
    rng: random.Random,
    noise: float,
    nodes: Hardware,
) -> float:
    """One run of ``allocation`` on the testbed model."""
    speeds = {
        name: nodes[name]["efficiency"]
        * attainable_flops(nodes[name]["peak"], nodes[name]["bandwidth"], ALEXNET.intensity)
        for name in allocation.workers
    }
    flops = TRAIN_PASSES * ALEXNET.flops * samples

    def overhead(name: str) -> float:
        return nodes[name]["overhead"] * rng.uniform(0.8, 1.2)

    def transfer() -> float:
        if allocation.mode == "single":
            return 0.0
        seconds = syncs * 8 * ALEXNET.memory_bytes / (LAN_BITS * NETWORK_EFFICIENCY)
        return seconds * math.exp(rng.gauss(0, 2 * noise))

    def compute(work: float, speed: float) -> float:
        return work / speed * math.exp(rng.gauss(0, noise))

    if allocation.mode == "async":
        shared = compute(flops / sum(speeds.values()), 1.0)
        return max(shared + transfer() + overhead(n) for n in allocation.workers)
    share = flops / len(allocation.workers)
    return max(compute(share, speeds[n]) + transfer() + overhead(n) for n in allocation.workers)


def accuracy(
    trials: int, seed: int, noise: float, nodes: Hardware = NODES
) -> tuple[float, dict[str, int]]:
    """Fraction of trials where the predicted best allocation also measured fastest."""
    rng = random.Random(seed)
    workers = _workers(nodes)
    subsets = [subset for size in (1, 2, 3) for subset in itertools.combinations(workers, size)]
    hits = 0
    picked: dict[str, int] = {}
    for _ in range(trials):
        epochs = rng.randint(1, 10)
        samples = 60_000 * rng.uniform(0.1, 1.0) * epochs
        syncs = epochs * round(math.exp(rng.uniform(0.0, math.log(20.0))))
        predicted = best_allocation(ALEXNET, workers, samples, syncs=syncs)
        candidates = [predict(ALEXNET, subset, samples, syncs=syncs) for subset in subsets]
        measured = {c.workers: _measured(c, samples, syncs, rng, noise, nodes) for c in candidates}
        fastest = min(measured, key=measured.__getitem__)
        hits += fastest == predicted.workers
        label = "+".join(predicted.workers) + f" ({predicted.mode})"
        picked[label] = picked.get(label, 0) + 1
    return hits / trials, picked


def run(trials: int = TRIALS) -> Report:
    noises = (0.0, 0.02, 0.05, 0.10)
    ours, picked = accuracy(trials, seed=4, noise=0.05)
    sweep = {noise: accuracy(trials, seed=4, noise=noise)[0] for noise in noises}
    before, picked_before = accuracy(trials, seed=4, noise=0.05, nodes=PREVIOUS_NODES)
    sweep_before = {
        noise: accuracy(trials, seed=4, noise=noise, nodes=PREVIOUS_NODES)[0] for noise in noises
    }
    report = Report(
        "p4_roofline", "P4 — Roofline allocation accuracy (ours vs the paper)", __doc__ or ""
    )
    intensity = round(ALEXNET.intensity, 2)  # the paper computes with I rounded to 1.16
    gtx1080 = attainable_flops(GTX1080["peak"], GTX1080["bandwidth"], intensity)
    gtx970 = attainable_flops(GTX970["peak"], GTX970["bandwidth"], intensity)
    # (quantity, paper's text, ours shown, ours, the paper's range)
    side = [
        (
            "AlexNet intensity I = W/M",
            "1.16 FLOP/B",
            f"{ALEXNET.intensity:.2f} FLOP/B",
            ALEXNET.intensity,
            figure(PAPER_INTENSITY, 0.01),
        ),
        (
            "GTX 1080 attainable min(π, β·I)",
            "408.32 GFLOP/s",
            f"{gtx1080 / 1e9:.2f} GFLOP/s",
            gtx1080,
            figure(PAPER_ATTAINABLE["gtx1080"], 0.01e9),
        ),
        (
            "GTX 970 attainable min(π, β·I)",
            "269.12 GFLOP/s",
            f"{gtx970 / 1e9:.2f} GFLOP/s",
            gtx970,
            figure(PAPER_ATTAINABLE["gtx970"], 0.01e9),
        ),
        (
            "predicted best = measured best",
            f"{PAPER_ACCURACY * 100:.1f} % of 1000",
            f"{ours * 100:.1f} % of {trials}",
            ours,
            figure(PAPER_ACCURACY, 0.001),
        ),
    ]
    verdicts = {quantity: verdict(value, paper) for quantity, _, _, value, paper in side}
    report.table(
        ["quantity", "paper", "ours", "in the paper's range?"],
        [[quantity, paper, shown, verdicts[quantity]] for quantity, paper, shown, _, _ in side],
        "Side by side (paper: section 4.1 after its Table 1, and section 4.2)",
    )
    report.table(
        ["run-to-run noise σ", "accuracy", "with the previous GPU figures"],
        [
            [f"{noise * 100:.0f} %", f"{value * 100:.1f} %", f"{sweep_before[noise] * 100:.1f} %"]
            for noise, value in sweep.items()
        ],
        "Sensitivity to measurement noise",
    )
    report.table(
        ["predicted allocation", "trials", "with the previous GPU figures"],
        [
            [label, picked.get(label, 0), picked_before.get(label, 0)]
            for label in sorted(
                picked.keys() | picked_before.keys(),
                key=lambda label: (-picked.get(label, 0), -picked_before.get(label, 0), label),
            )
        ],
        "What the predictor chose",
    )
    report.data = {
        "accuracy": ours,
        "paper_accuracy": PAPER_ACCURACY,
        "noise_sweep": {str(k): v for k, v in sweep.items()},
        "picked": picked,
        "mean_predicted_vs_noise": statistics.fmean(sweep.values()),
        "verdicts": verdicts,
        "hardware": NODES,
        "previous_hardware": {
            "nodes": PREVIOUS_NODES,
            "accuracy": before,
            "noise_sweep": {str(k): v for k, v in sweep_before.items()},
            "picked": picked_before,
        },
    }
    report.paragraph("Why ours differs", _why(ours, sweep))
    report.paragraph(
        "GPU figures changed", _changed(gtx970, sweep, sweep_before, picked, picked_before)
    )
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _why(ours: float, sweep: dict[float, float]) -> str:
    return (
        f"Our accuracy is {ours * 100:.1f} % (paper 91.6 %). It is not a property of the "
        "Roofline model alone: it counts how often a trial lands close enough to a decision "
        "boundary (single GTX 1080 vs the three nodes, sync vs async) that what the predictor "
        "ignores — per-GPU efficiency below the Roofline bound, network efficiency, overhead "
        "jitter and run-to-run noise — flips the order. With no run-to-run noise the "
        f"systematic errors alone give {sweep[0.0] * 100:.1f} %; at 10 % noise "
        f"{sweep[0.1] * 100:.1f} %. The paper repeated one experiment 1000 times (section 4.2: "
        "AlexNet, 50 epochs, where its predictor chose the GTX 1080 alone and its figure 6 "
        "measured it 2.3 % shorter than GTX 1080 + GTX 970 asynchronous) and puts its misses "
        "down to, possibly, network instability or GPUs slowing over long runs; it gives no "
        "synchronisation frequency, so we drew varied trials instead, and with a different trial "
        "mix the same predictor scores differently."
    )


def _changed(
    gtx970: float,
    sweep: dict[float, float],
    sweep_before: dict[float, float],
    picked: dict[str, int],
    picked_before: dict[str, int],
) -> str:
    old970 = PREVIOUS_NODES["gtx970-a"]
    old_attainable = attainable_flops(old970["peak"], old970["bandwidth"], 1.16)
    moved = [
        f"{noise * 100:.0f} % noise {sweep_before[noise] * 100:.1f} → {value * 100:.1f} %"
        for noise, value in sweep.items()
        if round(value, 3) != round(sweep_before[noise], 3)
    ]
    same = [
        f"{noise * 100:.0f} % noise ({value * 100:.1f} %)"
        for noise, value in sweep.items()
        if round(value, 3) == round(sweep_before[noise], 3)
    ]
    choices = [
        f"{label} {picked_before.get(label, 0)} → {picked.get(label, 0)}"
        for label in sorted(picked.keys() | picked_before.keys())
        if picked.get(label, 0) != picked_before.get(label, 0)
    ]
    return (
        "This experiment now uses the paper's GPU figures (section 4.1): GTX 970 π = 5.2 "
        "TFLOP/s and β = 232 GB/s (was NVIDIA's 3.92 TFLOP/s and 224 GB/s), GTX 1080 π = 6.1 "
        "TFLOP/s (was 8.873; its β, 352 GB/s, is unchanged). AlexNet is memory-bound on both "
        "GPUs either way, so only the GTX 970's β moves anything: its attainable compute goes "
        f"from {old_attainable / 1e9:.2f} to {gtx970 / 1e9:.2f} GFLOP/s (the paper's 269.12), "
        "in the predictor and in the testbed model alike. Over the same trials, accuracy moved "
        f"at {', '.join(moved) if moved else 'no noise level'}"
        f"{' and is unchanged at ' + ', '.join(same) if same else ''}; the predictor's choices "
        f"moved {', '.join(choices) if choices else 'nowhere'} (the tables give both)."
    )
