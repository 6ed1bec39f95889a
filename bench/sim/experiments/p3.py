"""P3's table: QoS guarantee rate and makespan of the QoS-aware policy vs six baselines.

Setup: Poisson arrivals over 24 h at 5, 10 and 20 tasks per hour; Urgent:Prior:Normal =
5:35:60; AlexNet, GoogLeNet, ResNet-50, Inception-v3, LSTM, Seq2Seq (the paper's); a cluster of
4 nodes x 4 GPUs (ours: the digest gives none). Single-GPU times are log-uniform in
[10 min, 4 h]; each task asks 1/2/4/8 GPUs (what FIFO, Capacity and Weighted Fair give it) and
may use up to 8 (what P3, Min-Min and the Tetris variants may choose). ECT: Urgent must start on
arrival, Prior within 1x its single-GPU time, Normal within 2x. Every policy sees the same
fitted profiles (quadratic throughput, γ and λ from noisy offline profiling). No data I/O.
"""

from __future__ import annotations

import statistics

from coordinator.scheduling import make_policy
from coordinator.scheduling.model import JobSpec
from coordinator.scheduling.perf import estimated_rate

from ..cluster import uniform_cluster
from ..engine import Simulator
from ..report import Report, pct
from ..traces import P3_MODELS, p3_workload
from ..truth import CATALOGUE, profiles

RATES = (5.0, 10.0, 20.0)
SEEDS = (0, 1, 2)
P3 = "p3-qos"
BASELINES = ("fifo", "capacity", "min-min", "weighted-fair", "tetris+perf", "tetris+cer")
PAPER = {"qos_rate_gain_vs_best": 0.674, "makespan_change_vs_best": -0.282}


def prediction_error(seed: int = 0) -> dict[str, float]:
    """Mean |predicted − true| / true throughput of the fitted profiles over P3's shapes."""
    fitted = profiles(seed)
    shapes = [{"a": g} for g in (1, 2, 4)] + [{"a": 4, "b": 4}, {"a": 2, "b": 2}]
    errors = {}
    for model in P3_MODELS:
        job = JobSpec("probe", 0.0, 1, fitted[model], 1.0, 1, batch_size=256)
        gaps = [
            abs(estimated_rate(job, shape) / CATALOGUE[model].rate(job, shape) - 1)
            for shape in shapes
        ]
        errors[model] = statistics.fmean(gaps)
    return errors


def run(seeds: tuple[int, ...] = SEEDS) -> Report:
    cluster = uniform_cluster(4, 4, cache_mode="none")
    policies = (P3, *BASELINES)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for rate in RATES:
        per_policy: dict[str, list[tuple[float, float]]] = {name: [] for name in policies}
        for seed in seeds:
            trace = p3_workload(seed, profiles(seed), per_hour=rate)
            for name in policies:
                result = Simulator(cluster, trace, make_policy(name, seed=seed)).run()
                per_policy[name].append((result.qos_rate, result.makespan))
        results[str(rate)] = {
            name: {
                "qos_rate": statistics.fmean(q for q, _ in rows),
                "makespan_h": statistics.fmean(m for _, m in rows) / 3600,
            }
            for name, rows in per_policy.items()
        }

    report = Report("p3_qos", "P3 — QoS-aware scheduling vs six baselines (ours vs the paper)", __doc__ or "")
    header = ["policy", *(f"QoS @ {r:g}/h" for r in RATES), *(f"makespan h @ {r:g}/h" for r in RATES)]
    rows = [
        [
            name,
            *(f"{results[str(r)][name]['qos_rate'] * 100:.1f} %" for r in RATES),
            *(results[str(r)][name]["makespan_h"] for r in RATES),
        ]
        for name in policies
    ]
    report.table(header, rows, f"Means over {len(seeds)} workloads per arrival rate")

    side = []
    gains = {}
    for rate in RATES:
        row = results[str(rate)]
        best_qos = max(BASELINES, key=lambda n: row[n]["qos_rate"])
        best_makespan = min(BASELINES, key=lambda n: row[n]["makespan_h"])
        qos_gain = row[P3]["qos_rate"] / row[best_qos]["qos_rate"] - 1
        makespan_change = row[P3]["makespan_h"] / row[best_makespan]["makespan_h"] - 1
        gains[str(rate)] = {"qos_gain": qos_gain, "makespan_change": makespan_change}
        side.append(
            [f"{rate:g}/h", pct(qos_gain), best_qos, pct(makespan_change), best_makespan]
        )
    side.append(["paper", pct(PAPER["qos_rate_gain_vs_best"]), "—", pct(PAPER["makespan_change_vs_best"]), "—"])
    report.table(
        ["arrivals", "QoS rate vs best baseline", "best baseline", "makespan vs best", "best baseline"],
        side,
        "Side by side",
    )
    errors = prediction_error()
    report.table(
        ["model", "throughput prediction error"],
        [[model, f"{error * 100:.1f} %"] for model, error in errors.items()],
        "Fitted model vs truth (paper: < 5 % for Inception-v3 / ResNet-50)",
    )
    report.data = {"results": results, "gains": gains, "prediction_error": errors, "paper": PAPER}
    report.paragraph("Why ours differs", _why(gains))
    return report


def _why(gains: dict[str, dict[str, float]]) -> str:
    qos = [g["qos_gain"] for g in gains.values()]
    makespan = [g["makespan_change"] for g in gains.values()]
    return (
        f"Against the best baseline at each load, P3 changes the QoS guarantee rate by "
        f"{min(qos) * 100:+.1f} % to {max(qos) * 100:+.1f} % (paper +67.4 %) and makespan by "
        f"{min(makespan) * 100:+.1f} % to {max(makespan) * 100:+.1f} % (paper −28.2 %). "
        "The QoS gain comes from ordering by slack and sizing each task to just meet its ECT; "
        "how large it is depends on how tight the ECTs are against the load, and the digest "
        "leaves both open (we chose Prior = 1x and Normal = 2x the single-GPU time, a 16-GPU "
        "cluster and tasks of 10 min to 4 h). At light load every policy meets most deadlines, "
        "so there is little to gain; at 20 tasks/h the cluster is overloaded and no order saves "
        "many deadlines. Makespan is bounded below by the total work, so it moves less than the "
        "QoS rate; the baselines that pick placements with the performance model (Min-Min, "
        "Tetris) are strong on makespan because they use GPUs as efficiently as P3 does."
    )
