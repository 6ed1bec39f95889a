"""P2's table: elastic scaling vs FCFS and earliest-finish (EF), JCT and makespan.

Setup (the paper's): 3 servers x 4 GPUs, 20-job workloads with Poisson arrivals (mean gap
15 min), job durations from Gandiva's classes (30 % < 10 min, 62 % < 100 min, 82 % < 1000 min),
each job asking 1, 2 or 4 GPUs. FCFS gives each job what it asks, in arrival order; EF gives
every GPU to one job at a time; P2 rescales jobs (10 s checkpoint-restart each time) by its
knapsacks, fitting each job's epoch-time model from the epoch times it reports. No data I/O
(the paper's data sits on the training nodes). Averages over ``SEEDS`` workloads.
"""

from __future__ import annotations

import statistics

from coordinator.scheduling import make_policy

from ..cluster import uniform_cluster
from ..engine import Simulator
from ..report import VERDICT_RULE, Report, figure, pct, verdict
from ..traces import p2_workload
from ..truth import profiles

SEEDS = tuple(range(10))
POLICIES = ("fifo", "p2-earliest-finish", "p2-elastic")
LABELS = {"fifo": "FCFS", "p2-earliest-finish": "EF", "p2-elastic": "P2 elastic"}
PAPER = {
    "jct_vs_fcfs": -0.40,
    "jct_vs_ef": -0.58,
    "makespan_vs_fcfs": -0.30,
    "makespan_vs_ef": -0.35,
}


def run(seeds: tuple[int, ...] = SEEDS) -> Report:
    cluster = uniform_cluster(3, 4, cache_mode="none", restart_s=10.0)
    per_seed: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    for seed in seeds:
        trace = p2_workload(seed, profiles(seed))
        for name in POLICIES:
            result = Simulator(cluster, trace, make_policy(name, seed=seed)).run()
            per_seed[name].append({"jct": result.mean_jct, "makespan": result.makespan})

    def mean(name: str, metric: str) -> float:
        return statistics.fmean(row[metric] for row in per_seed[name])

    def change(metric: str, baseline: str) -> float:
        """Mean over workloads of P2's relative change against ``baseline``."""
        return statistics.fmean(
            p2[metric] / base[metric] - 1
            for p2, base in zip(per_seed["p2-elastic"], per_seed[baseline], strict=True)
        )

    ours = {
        "jct_vs_fcfs": change("jct", "fifo"),
        "jct_vs_ef": change("jct", "p2-earliest-finish"),
        "makespan_vs_fcfs": change("makespan", "fifo"),
        "makespan_vs_ef": change("makespan", "p2-earliest-finish"),
    }
    report = Report(
        "p2_elastic", "P2 — elastic scaling vs FCFS and EF (ours vs the paper)", __doc__ or ""
    )
    report.table(
        ["policy", "mean JCT (min)", "makespan (min)"],
        [[LABELS[n], mean(n, "jct") / 60, mean(n, "makespan") / 60] for n in POLICIES],
        f"Means over {len(seeds)} workloads",
    )
    # The paper prints whole percents ("減少約40%"), so each figure's range is ±0.5 %.
    verdicts = {key: verdict(ours[key], figure(PAPER[key], 0.01)) for key in PAPER}
    report.table(
        ["P2 elastic", "paper", "ours", "ours in the paper's range?"],
        [
            [label, pct(PAPER[key]), pct(ours[key]), verdicts[key]]
            for label, key in (
                ("JCT vs FCFS", "jct_vs_fcfs"),
                ("JCT vs EF", "jct_vs_ef"),
                ("makespan vs FCFS", "makespan_vs_fcfs"),
                ("makespan vs EF", "makespan_vs_ef"),
            )
        ],
        "Side by side (mean relative change per workload; paper: section 4, on its figures 2 "
        "and 3)",
    )
    report.data = {
        "paper": PAPER,
        "ours": ours,
        "verdicts": verdicts,
        "per_seed": per_seed,
        "seeds": list(seeds),
    }
    report.paragraph("Why ours differs", _why(ours))
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _why(ours: dict[str, float]) -> str:
    return (
        f"P2 cuts JCT by {-ours['jct_vs_fcfs'] * 100:.0f} % against FCFS (paper 40 %) and by "
        f"{-ours['jct_vs_ef'] * 100:.0f} % against EF (paper 58 %); makespan by "
        f"{-ours['makespan_vs_fcfs'] * 100:.0f} % and {-ours['makespan_vs_ef'] * 100:.0f} % "
        "(paper 30 % and 35 %). The direction matches: elastic jobs soak up idle GPUs while the "
        "queue is empty and give them back when requests arrive, and EF pays for running one job "
        "at a time. The sizes differ because they follow from choices the paper does not pin "
        "down: the tail of the duration mix (we cap the longest class at 3000 min, and one such "
        "job sets the makespan of a 20-job workload), the GPUs each job asks under FCFS "
        "(1/2/4 with 50/30/20 %), and the scaling curves (our models lose 1–4 % per extra GPU "
        "inside a server and more across servers, so EF's 12-GPU jobs waste little and EF stays "
        "competitive on makespan)."
    )
