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

    report = Report(
        "p3_qos", "P3 — QoS-aware scheduling vs six baselines (ours vs the paper)", __doc__ or ""
    )
    header = [
        "policy",
        *(f"QoS @ {r:g}/h" for r in RATES),
        *(f"makespan h @ {r:g}/h" for r in RATES),
    ]
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
        gains[str(rate)] = {
            "qos_gain": row[P3]["qos_rate"] / row[best_qos]["qos_rate"] - 1,
            "qos_gain_vs_fifo": row[P3]["qos_rate"] / row["fifo"]["qos_rate"] - 1,
            "makespan_change": row[P3]["makespan_h"] / row[best_makespan]["makespan_h"] - 1,
            "makespan_change_vs_fifo": row[P3]["makespan_h"] / row["fifo"]["makespan_h"] - 1,
        }
        side.append(
            [
                f"{rate:g}/h",
                pct(gains[str(rate)]["qos_gain"]),
                best_qos,
                pct(gains[str(rate)]["qos_gain_vs_fifo"]),
                pct(gains[str(rate)]["makespan_change"]),
                best_makespan,
                pct(gains[str(rate)]["makespan_change_vs_fifo"]),
            ]
        )
    side.append(
        [
            "paper",
            pct(PAPER["qos_rate_gain_vs_best"]),
            "—",
            "—",
            pct(PAPER["makespan_change_vs_best"]),
            "—",
            "—",
        ]
    )
    report.table(
        [
            "arrivals",
            "QoS rate vs best",
            "best baseline",
            "QoS vs FIFO",
            "makespan vs best",
            "best baseline",
            "makespan vs FIFO",
        ],
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
    _light, middle, heavy = (gains[str(rate)] for rate in RATES)
    return (
        "Light load (5/h): every policy meets nearly every ECT, so there is nothing to gain. "
        f"Middle load (10/h): P3 is the best policy, {middle['qos_gain'] * 100:+.1f} % over the "
        f"best baseline and {middle['qos_gain_vs_fifo'] * 100:+.1f} % over FIFO, with makespan "
        f"{middle['makespan_change'] * 100:+.1f} % against the best. The paper's +67.4 % is the "
        "size of our gain over the queue-based baselines (FIFO, Capacity, Weighted Fair); our "
        "strongest baselines, Tetris+CER and Min-Min, already use P3's performance model (and "
        "Tetris+CER its CER), which the paper's baselines may not have had. Overload (20/h): P3 "
        f"falls to {heavy['qos_gain'] * 100:+.1f} % against the best baseline. This follows from "
        "its rule, which we kept: tasks are dispatched by smallest slack, and a task that can no "
        "longer meet its ECT has negative slack, so hopeless tasks go first and push the "
        "feasible ones past their ECTs (the domino effect of earliest-deadline-first under "
        "overload), while Min-Min and Tetris run short tasks first. Our choices where the digest "
        "is silent (Prior = 1x and Normal = 2x the single-GPU time, 16 GPUs, tasks of 10 min to "
        "4 h) set where the overload begins. Makespan is bounded below by the total work and "
        "moves little once placements use the performance model. Min-Min and Tetris+Perf "
        "coincide here: the predicted-time term outweighs Tetris' alignment term."
    )
