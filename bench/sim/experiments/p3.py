"""P3's table: QoS guarantee rate and makespan of the QoS-aware policy vs six baselines.

Setup: Poisson arrivals over 24 h at 5, 10 and 20 tasks per hour; Urgent:Prior:Normal =
5:35:60; AlexNet, GoogLeNet, ResNet-50, Inception-v3, LSTM, Seq2Seq (the paper's); a cluster of
4 nodes x 4 GPUs, as in the paper: P3 (the paper), its experimental platform ("實驗平臺") and
Table 1, has 4 nodes joined by 56 Gbps InfiniBand, each with 2 NVIDIA Tesla K80, and "由于Tesla
K80是單卡雙核心,即每個結點配備4個GPU核心" (the K80 is one card with two cores, so each node
has 4 GPU cores). Our GPUs are V100-class and the network enters only through each model's
fitted γ and λ (bench/sim/truth.py); the time scale comes from the single-GPU times, which are
log-uniform in [10 min, 4 h]. Each task asks 1/2/4/8 GPUs (what FIFO, Capacity and Weighted
Fair give it) and may use up to 8 (what P3, Min-Min and the Tetris variants may choose). ECT:
Urgent must start on arrival, Prior within 1x its single-GPU time, Normal within 2x. Every
policy sees the same fitted profiles (quadratic throughput, γ and λ from noisy offline
profiling). No data I/O.
"""

from __future__ import annotations

import statistics

from coordinator.scheduling import make_policy
from coordinator.scheduling.model import JobSpec
from coordinator.scheduling.perf import estimated_rate

from ..cluster import uniform_cluster
from ..engine import Simulator
from ..report import VERDICT_RULE, Report, below, figure, pct, verdict
from ..traces import P3_MODELS, p3_workload
from ..truth import CATALOGUE, profiles

RATES = (5.0, 10.0, 20.0)
SEEDS = (0, 1, 2)
P3 = "p3-qos"
BASELINES = ("fifo", "capacity", "min-min", "weighted-fair", "tetris+perf", "tetris+cer")
#: P3 (the paper), its results on figure 5: "提高了67.4%和降低了28.2%" over the best baseline.
PAPER = {"qos_rate_gain_vs_best": 0.674, "makespan_change_vs_best": -0.282}
#: P3 (the paper), on its figure 4: the mean prediction error is "低于5%" (below 5 %).
PAPER_PREDICTION_ERROR = 0.05


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
    verdicts: dict[str, dict[str, str]] = {}
    qos_range = figure(PAPER["qos_rate_gain_vs_best"], 0.001)
    makespan_range = figure(PAPER["makespan_change_vs_best"], 0.001)
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
        verdicts[str(rate)] = {
            "qos_gain": verdict(gains[str(rate)]["qos_gain"], qos_range),
            "makespan_change": verdict(gains[str(rate)]["makespan_change"], makespan_range),
        }
        side.append(
            [
                f"{rate:g}/h",
                pct(gains[str(rate)]["qos_gain"]),
                best_qos,
                verdicts[str(rate)]["qos_gain"],
                pct(gains[str(rate)]["qos_gain_vs_fifo"]),
                pct(gains[str(rate)]["makespan_change"]),
                best_makespan,
                verdicts[str(rate)]["makespan_change"],
                pct(gains[str(rate)]["makespan_change_vs_fifo"]),
            ]
        )
    side.append(
        [
            "paper",
            pct(PAPER["qos_rate_gain_vs_best"]),
            "—",
            "—",
            "—",
            pct(PAPER["makespan_change_vs_best"]),
            "—",
            "—",
            "—",
        ]
    )
    report.table(
        [
            "arrivals",
            "QoS rate vs best",
            "best baseline",
            "in the paper's range?",
            "QoS vs FIFO",
            "makespan vs best",
            "best baseline",
            "in the paper's range?",
            "makespan vs FIFO",
        ],
        side,
        "Side by side (paper: its results on figure 5, against the best baseline)",
    )
    errors = prediction_error()
    error_verdicts = {
        model: verdict(error, below(PAPER_PREDICTION_ERROR)) for model, error in errors.items()
    }
    report.table(
        ["model", "throughput prediction error", "paper", "in the paper's range?"],
        [
            [model, f"{error * 100:.1f} %", "< 5 %", error_verdicts[model]]
            for model, error in errors.items()
        ],
        "Fitted model vs truth (paper, on its figure 4: mean error < 5 %, shown for "
        "Inception-v3 / ResNet-50)",
    )
    report.data = {
        "results": results,
        "gains": gains,
        "verdicts": verdicts,
        "prediction_error": errors,
        "prediction_error_verdicts": error_verdicts,
        "paper": {**PAPER, "prediction_error_below": PAPER_PREDICTION_ERROR},
    }
    report.paragraph("Why ours differs", _why(gains))
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _why(gains: dict[str, dict[str, float]]) -> str:
    _light, middle, heavy = (gains[str(rate)] for rate in RATES)
    return (
        "Light load (5/h): every policy meets nearly every ECT, so there is nothing to gain. "
        f"Middle load (10/h): P3 is the best policy, {middle['qos_gain'] * 100:+.1f} % over the "
        f"best baseline and {middle['qos_gain_vs_fifo'] * 100:+.1f} % over FIFO, with makespan "
        f"{middle['makespan_change'] * 100:+.1f} % against the best. The paper's +67.4 % is the "
        "size of our gain over the queue-based baselines (FIFO, Capacity, Weighted Fair), not "
        "over our strongest baselines, Tetris+CER and Min-Min. The paper's Tetris+Perf and "
        "Tetris+CER used its performance model and CER too (P3, the paper, baselines (5) and "
        "(6)), so that alone does not explain the gap; its Min-Min ordered tasks by their ECT "
        "(baseline (3)), while ours is the classic Min-Min, shortest predicted finish first, and "
        "so also uses the performance model. Overload (20/h): P3 "
        f"falls to {heavy['qos_gain'] * 100:+.1f} % against the best baseline. This follows from "
        "its rule, which we kept: tasks are dispatched by smallest slack, and a task that can no "
        "longer meet its ECT has negative slack, so hopeless tasks go first and push the "
        "feasible ones past their ECTs (the domino effect of earliest-deadline-first under "
        "overload), while Min-Min and Tetris run short tasks first. Our choices where the paper's "
        "text is silent (Prior = 1x the single-GPU time, its equation (9) being an image missing "
        "from the text; tasks of 10 min to 4 h) set where the overload begins on the paper's 16 "
        "GPU cores (4 nodes x 2 K80, its Table 1), with Normal = 2x as the paper says. "
        "Makespan is bounded below by the total work and "
        "moves little once placements use the performance model. Min-Min and Tetris+Perf "
        "coincide here: the predicted-time term outweighs Tetris' alignment term."
    )
