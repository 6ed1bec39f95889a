"""P4's result: how often the Roofline prediction picks the allocation that measures fastest.

Setup (the paper's): AlexNet (W = 334 MFLOPs, M = 289 MB per sample, I = 1.16 FLOP/B) on
MNIST-sized data, one GTX 1080 and two GTX 970, a 100 Mbit/s LAN, 1000 trials, each over the
7 allocations (3 single nodes, 3 pairs, all three). Per trial (ours, the digest does not say):
a training run of 1–10 epochs over 10–100 % of MNIST's 60,000 samples, synchronising the
model 1–20 times per epoch (log-uniform), so that single-node and distributed runs both win
some trials.

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

from ..report import Report

TRIALS = 1000
ALEXNET = ModelCost(flops=334e6, memory_bytes=289e6)
LAN_BITS = 100e6
GTX1080 = {"peak": 8.873e12, "bandwidth": 352e9, "overhead": 3.0, "efficiency": 0.85}
GTX970 = {"peak": 3.920e12, "bandwidth": 224e9, "overhead": 4.0, "efficiency": 0.80}
NODES = {"gtx1080": GTX1080, "gtx970-a": GTX970, "gtx970-b": GTX970}
NETWORK_EFFICIENCY = 0.90
PAPER_ACCURACY = 0.916


def _workers() -> list[Worker]:
    return [
        Worker(name, 1, hw["peak"], hw["bandwidth"], LAN_BITS, hw["overhead"])
        for name, hw in NODES.items()
    ]


def _measured(
    allocation: Allocation, samples: float, syncs: float, rng: random.Random, noise: float
) -> float:
    """One run of ``allocation`` on the testbed model."""
    speeds = {
        name: NODES[name]["efficiency"]
        * attainable_flops(NODES[name]["peak"], NODES[name]["bandwidth"], ALEXNET.intensity)
        for name in allocation.workers
    }
    flops = TRAIN_PASSES * ALEXNET.flops * samples

    def overhead(name: str) -> float:
        return NODES[name]["overhead"] * rng.uniform(0.8, 1.2)

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


def accuracy(trials: int, seed: int, noise: float) -> tuple[float, dict[str, int]]:
    """Fraction of trials where the predicted best allocation also measured fastest."""
    rng = random.Random(seed)
    workers = _workers()
    subsets = [subset for size in (1, 2, 3) for subset in itertools.combinations(workers, size)]
    hits = 0
    picked: dict[str, int] = {}
    for _ in range(trials):
        epochs = rng.randint(1, 10)
        samples = 60_000 * rng.uniform(0.1, 1.0) * epochs
        syncs = epochs * round(math.exp(rng.uniform(0.0, math.log(20.0))))
        predicted = best_allocation(ALEXNET, workers, samples, syncs=syncs)
        candidates = [predict(ALEXNET, subset, samples, syncs=syncs) for subset in subsets]
        measured = {c.workers: _measured(c, samples, syncs, rng, noise) for c in candidates}
        fastest = min(measured, key=measured.__getitem__)
        hits += fastest == predicted.workers
        label = "+".join(predicted.workers) + f" ({predicted.mode})"
        picked[label] = picked.get(label, 0) + 1
    return hits / trials, picked


def run(trials: int = TRIALS) -> Report:
    ours, picked = accuracy(trials, seed=4, noise=0.05)
    sweep = {noise: accuracy(trials, seed=4, noise=noise)[0] for noise in (0.0, 0.02, 0.05, 0.10)}
    report = Report(
        "p4_roofline", "P4 — Roofline allocation accuracy (ours vs the paper)", __doc__ or ""
    )
    gtx1080 = attainable_flops(GTX1080["peak"], GTX1080["bandwidth"], round(ALEXNET.intensity, 2))
    gtx970 = attainable_flops(GTX970["peak"], GTX970["bandwidth"], round(ALEXNET.intensity, 2))
    report.table(
        ["quantity", "paper", "ours"],
        [
            ["AlexNet intensity I = W/M", "1.16 FLOP/B", f"{ALEXNET.intensity:.2f} FLOP/B"],
            ["GTX 1080 attainable min(π, β·I)", "408.32 GFLOP/s", f"{gtx1080 / 1e9:.2f} GFLOP/s"],
            ["GTX 970 attainable", "—", f"{gtx970 / 1e9:.2f} GFLOP/s"],
            [
                "predicted best = measured best",
                f"{PAPER_ACCURACY * 100:.1f} % of 1000",
                f"{ours * 100:.1f} % of {trials}",
            ],
        ],
        "Side by side",
    )
    report.table(
        ["run-to-run noise σ", "accuracy"],
        [[f"{noise * 100:.0f} %", f"{value * 100:.1f} %"] for noise, value in sweep.items()],
        "Sensitivity to measurement noise",
    )
    report.table(
        ["predicted allocation", "trials"],
        sorted(picked.items(), key=lambda item: -item[1]),
        "What the predictor chose",
    )
    report.data = {
        "accuracy": ours,
        "paper_accuracy": PAPER_ACCURACY,
        "noise_sweep": {str(k): v for k, v in sweep.items()},
        "picked": picked,
        "mean_predicted_vs_noise": statistics.fmean(sweep.values()),
    }
    report.paragraph("Why ours differs", _why(ours, sweep))
    return report


def _why(ours: float, sweep: dict[float, float]) -> str:
    return (
        f"Our accuracy is {ours * 100:.1f} % (paper 91.6 %). It is not a property of the "
        "Roofline model alone: it counts how often a trial lands close enough to a decision "
        "boundary (single GTX 1080 vs the three nodes, sync vs async) that what the predictor "
        "ignores — per-GPU efficiency below the Roofline bound, network efficiency, overhead "
        "jitter and run-to-run noise — flips the order. With no run-to-run noise the "
        f"systematic errors alone give {sweep[0.0] * 100:.1f} %; at 10 % noise "
        f"{sweep[0.1] * 100:.1f} %. The paper's trials (their sizes and how often models were "
        "synchronised) are not in the digest, so we drew our own; with a different trial mix the "
        "same predictor scores differently."
    )
