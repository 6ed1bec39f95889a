"""P4's result: how often the Roofline prediction picks the allocation that measures fastest.

The paper's set-up (section 4.1, "實驗環境"): a head node, a data server and three worker nodes,
one with a GeForce GTX 1080 (π = 6.1 TFLOP/s, β = 352 GB/s) and two with a GTX 970 (π = 5.2
TFLOP/s, β = 232 GB/s), on a 100 Mbit/s LAN; TensorFlow 1.3; AlexNet (its Table 1) trained on
MNIST (60,000 training images) for 50 epochs, the epoch count after which its loss stopped
falling (section 4.2). W ≈ 334 MFLOPs and M ≈ 289 MB per forward pass, so I ≈ 1.16 FLOP/B and
both GPUs are memory-bound: 408.32 and 269.12 GFLOP/s attainable. The allocations measured
(section 4.2): each GPU alone, and the three node sets GTX 1080 + GTX 970, GTX 1080 + 2 x GTX
970 and 2 x GTX 970, each synchronous and asynchronous, the parameter server on the strongest
node of the set. The accuracy experiment repeats the same experiment 1000 times
("1000組相同的實驗") and counts the runs in which the predicted plan measured fastest: 91.6 %.

The predictor is P4's algorithm as the paper orders it (``coordinator.scheduling.roofline``):
node sets compared by equation (16) (work split evenly, the slowest node's τ + T_trans + η),
single vs distributed by equation (18), and only then, for a distributed set, synchronous or
asynchronous by how much its nodes' compute differs (step 7). η = 0: every node's historical
overhead starts at 0 (step 4). The paper gives no batch size or synchronisation frequency for
T_trans; we synchronise once per mini-batch of 128 (our choice; the sweep below shows the
prediction is the same for every frequency from 4 per epoch up).

The ground truth is not the predictor: it is the paper's own measurements. Its figures 3-6 are
images missing from the text, but the text states how their bars compare (section 4.2), which
fixes every allocation's time relative to the GTX 1080 alone (``MEASURED``, each entry derived
beside it). Each of the 1000 trials measures all eleven plans once, each time multiplied by
independent log-normal run-to-run noise of spread σ. The paper gives no run-to-run spread, so σ
is swept; the report gives the σ that the paper's 91.6 % implies. The paper's η learning (step
4) cannot change the prediction here: with η = 0 the best distributed set is predicted far
slower than the GTX 1080 alone for every synchronisation frequency of 4 per epoch or more.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from coordinator.scheduling.roofline import (
    Allocation,
    ModelCost,
    Worker,
    attainable_flops,
    best_allocation,
    layer_flops,
    layer_memory_bytes,
    predict,
    sync_or_async,
)

from ..report import VERDICT_RULE, Report, figure, verdict

TRIALS = 1000
EPOCHS = 50
MNIST_TRAIN_SAMPLES = 60_000
LAN_BITS = 100e6
#: Our choice: one synchronisation per mini-batch of 128 (the paper gives neither).
BATCH = 128
#: W and M as the paper's text states them (section 4.1): "約為334MFLOPS", "約為289MB".
ALEXNET = ModelCost(flops=334e6, memory_bytes=289e6)
#: The paper's Table 1, AlexNet for 28x28x1 MNIST: (layer, kernel side, input channels, output
#: height, output width, output channels); kernel 0 = a layer without weights.
TABLE_1 = (
    ("Input", 0, 0, 28, 28, 1),
    ("Conv1", 11, 1, 28, 28, 96),
    ("Relu", 0, 0, 28, 28, 96),
    ("LRN1", 0, 0, 28, 28, 96),
    ("Maxpool1", 0, 0, 14, 14, 96),
    ("Conv2", 5, 96, 14, 14, 256),
    ("Relu", 0, 0, 14, 14, 256),
    ("LRN2", 0, 0, 14, 14, 256),
    ("Maxpool2", 0, 0, 7, 7, 256),
    ("Conv3", 3, 256, 7, 7, 384),
    ("Conv4", 3, 384, 7, 7, 384),
    ("Conv5", 3, 384, 7, 7, 256),
    ("Dense1", 1, 12544, 1, 1, 4096),
    ("Relu", 0, 0, 1, 1, 4096),
    ("Dense2", 1, 4096, 1, 1, 4096),
    ("Relu", 0, 0, 1, 1, 4096),
    ("Dense3", 1, 4096, 1, 1, 10),
)
#: π and β as the paper gives them (section 4.1, after Table 1): "GeForce GTX1080的π為
#: 6.1TFOLP/s,β為352GB/s ... GeForce GTX970的π為5.2TFOLP/s,β為232GB/s".
GPUS = {
    "gtx1080": (6.1e12, 352e9),
    "gtx970-a": (5.2e12, 232e9),
    "gtx970-b": (5.2e12, 232e9),
}
#: The paper's figures, section 4.1 and 4.2.
PAPER_INTENSITY = 1.16
PAPER_IMAX = {"gtx1080": 17.33, "gtx970": 22.41}
PAPER_ATTAINABLE = {"gtx1080": 408.32e9, "gtx970": 269.12e9}
PAPER_ACCURACY = 0.916


@dataclass(frozen=True, order=True)
class Plan:
    """One allocation the paper measured: a node set and how it trains."""

    nodes: tuple[str, ...]
    mode: str  # "single", "sync" or "async"

    @property
    def label(self) -> str:
        return " + ".join(self.nodes) + f" ({self.mode})"


def _plan(mode: str, *nodes: str) -> Plan:
    return Plan(tuple(sorted(nodes)), mode)


_PAIR_A = ("gtx1080", "gtx970-a")
_PAIR_B = ("gtx1080", "gtx970-b")
_TWO_970 = ("gtx970-a", "gtx970-b")
_ALL = ("gtx1080", "gtx970-a", "gtx970-b")
_ALONE_1080 = 1.0
#: Section 4.2.1 (figure 3): the GTX 1080 alone took 54.5 % less time than a GTX 970 alone.
_ALONE_970 = 1 / (1 - 0.545)
#: Section 4.2.3 (figure 6): the GTX 1080 alone took 8.1 % less than GTX 970 + GTX 970 sync.
_SYNC_TWO_970 = 1 / (1 - 0.081)
#: Section 4.2.2 (figure 4): 970 + 970 sync took about 59.3 % of the other two sync sets, which
#: took "basically the same" time.
_SYNC_WITH_1080 = _SYNC_TWO_970 / 0.593
#: Section 4.2.3: the GTX 1080 alone took 2.3 % less than GTX 1080 + GTX 970 async; section
#: 4.2.2 (figure 5): GTX 1080 + 2 x GTX 970 async took "basically the same".
_ASYNC_WITH_1080 = 1 / (1 - 0.023)
#: Section 4.2.2 (figure 5): 970 + 970 async took about 6.2 % more than the sets with the 1080.
_ASYNC_TWO_970 = 1.062 * _ASYNC_WITH_1080
#: Every measured allocation's time relative to the GTX 1080 alone, from the paper's text.
MEASURED: dict[Plan, float] = {
    _plan("single", "gtx1080"): _ALONE_1080,
    _plan("single", "gtx970-a"): _ALONE_970,
    _plan("single", "gtx970-b"): _ALONE_970,
    _plan("sync", *_PAIR_A): _SYNC_WITH_1080,
    _plan("sync", *_PAIR_B): _SYNC_WITH_1080,
    _plan("sync", *_ALL): _SYNC_WITH_1080,
    _plan("sync", *_TWO_970): _SYNC_TWO_970,
    _plan("async", *_PAIR_A): _ASYNC_WITH_1080,
    _plan("async", *_PAIR_B): _ASYNC_WITH_1080,
    _plan("async", *_ALL): _ASYNC_WITH_1080,
    _plan("async", *_TWO_970): _ASYNC_TWO_970,
}
PLANS = sorted(MEASURED)
NOISES = (0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.10)
SYNCS_PER_EPOCH = (1, 2, 4, 10, 100, math.ceil(MNIST_TRAIN_SAMPLES / BATCH))
#: rows drawn to estimate the expected accuracy and the σ the paper's figure implies.
LARGE_SAMPLE = 40_000


def table_1_totals() -> tuple[float, float]:
    """W and M summed over Table 1 with equations (2)-(5): (FLOPs, bytes) per forward pass."""
    flops = sum(layer_flops(k, c_in, h, w, c_out) for _, k, c_in, h, w, c_out in TABLE_1 if k)
    memory = sum(layer_memory_bytes(k, c_in, h, w, c_out) for _, k, c_in, h, w, c_out in TABLE_1)
    return flops, memory


def workers() -> list[Worker]:
    """The three worker nodes, η = 0 (step 4: no history yet)."""
    return [Worker(name, 1, pi, beta, LAN_BITS, 0.0) for name, (pi, beta) in GPUS.items()]


def predicted_plan(syncs_per_epoch: float) -> tuple[Plan, Allocation]:
    """What P4's algorithm chooses for the paper's job at this synchronisation frequency."""
    chosen = best_allocation(
        ALEXNET,
        workers(),
        EPOCHS * MNIST_TRAIN_SAMPLES,
        syncs=EPOCHS * syncs_per_epoch,
    )
    return _plan(chosen.mode, *chosen.workers), chosen


def _fastest(times: dict[Plan, float]) -> Plan:
    return min(times, key=lambda plan: (times[plan], plan))


def identical_trials(
    predicted: Plan, noise: float, trials: int = TRIALS, seed: int = 4
) -> tuple[float, dict[str, int]]:
    """The paper's accuracy experiment: ``trials`` repetitions of the same experiment, each
    measuring every plan once with log-normal noise ``noise``; the fraction in which
    ``predicted`` measured fastest, and how often each plan did."""
    rng = random.Random(seed)
    hits, fastest_counts = 0, {}
    for _ in range(trials):
        times = {plan: MEASURED[plan] * math.exp(rng.gauss(0.0, noise)) for plan in PLANS}
        fastest = _fastest(times)
        hits += fastest == predicted
        fastest_counts[fastest.label] = fastest_counts.get(fastest.label, 0) + 1
    return hits / trials, fastest_counts


def win_thresholds(predicted: Plan, rows: int = LARGE_SAMPLE, seed: int = 11) -> list[float]:
    """For each of ``rows`` draws of standard-normal noise z (one per plan), the largest σ at
    which ``predicted`` still measures fastest: it wins iff for every other plan q,
    log t_p + σ z_p < log t_q + σ z_q, i.e. σ < (log t_q − log t_p) / (z_p − z_q) whenever
    z_p > z_q. The expected accuracy at σ is the fraction of rows whose threshold exceeds σ."""
    rng = random.Random(seed)
    base = {plan: math.log(MEASURED[plan]) for plan in PLANS}
    thresholds = []
    for _ in range(rows):
        z = {plan: rng.gauss(0.0, 1.0) for plan in PLANS}
        limit = math.inf
        for plan in PLANS:
            if plan == predicted:
                continue
            gap = base[plan] - base[predicted]
            if gap <= 0:
                limit = 0.0  # not the measured best even without noise
                break
            if z[predicted] > z[plan]:
                limit = min(limit, gap / (z[predicted] - z[plan]))
        thresholds.append(limit)
    return sorted(thresholds)


def expected_accuracy(thresholds: list[float], noise: float) -> float:
    return sum(limit > noise for limit in thresholds) / len(thresholds)


def noise_for(thresholds: list[float], accuracy: float) -> float:
    """The σ at which the expected accuracy is ``accuracy`` (a quantile of the thresholds)."""
    index = min(len(thresholds) - 1, max(0, round((1 - accuracy) * len(thresholds))))
    return thresholds[index]


def run(trials: int = TRIALS) -> Report:
    syncs = math.ceil(MNIST_TRAIN_SAMPLES / BATCH)
    predicted, chosen = predicted_plan(syncs)
    measured_best = _fastest(MEASURED)
    thresholds = win_thresholds(predicted)
    sweep = {noise: identical_trials(predicted, noise, trials) for noise in NOISES}
    expected = {noise: expected_accuracy(thresholds, noise) for noise in NOISES}
    implied = noise_for(thresholds, PAPER_ACCURACY)
    # 1000 trials estimate an accuracy to about ±1.7 % (95 %): the σ band that 91.6 % allows.
    half_width = 1.96 * math.sqrt(PAPER_ACCURACY * (1 - PAPER_ACCURACY) / TRIALS)
    band = (
        noise_for(thresholds, PAPER_ACCURACY + half_width),
        noise_for(thresholds, PAPER_ACCURACY - half_width),
    )
    table_w, table_m = table_1_totals()

    report = Report(
        "p4_roofline", "P4 — Roofline allocation accuracy (ours vs the paper)", __doc__ or ""
    )
    intensity = round(ALEXNET.intensity, 2)  # the paper computes with I rounded to 1.16
    gtx1080 = attainable_flops(*GPUS["gtx1080"], intensity)
    gtx970 = attainable_flops(*GPUS["gtx970-a"], intensity)
    accuracies = [value for value, _ in sweep.values()]
    # (quantity, the paper's text, ours shown, ours, the paper's range)
    side: list[tuple[str, str, str, float | list[float], tuple[float, float]]] = [
        (
            "AlexNet intensity I = W/M",
            "1.16 FLOP/B",
            f"{ALEXNET.intensity:.2f} FLOP/B",
            ALEXNET.intensity,
            figure(PAPER_INTENSITY, 0.01),
        ),
        (
            "GTX 1080 I_max = π/β",
            "17.33 FLOP/B",
            f"{GPUS['gtx1080'][0] / GPUS['gtx1080'][1]:.2f} FLOP/B",
            GPUS["gtx1080"][0] / GPUS["gtx1080"][1],
            figure(PAPER_IMAX["gtx1080"], 0.01),
        ),
        (
            "GTX 970 I_max = π/β",
            "22.41 FLOP/B",
            f"{GPUS['gtx970-a'][0] / GPUS['gtx970-a'][1]:.2f} FLOP/B",
            GPUS["gtx970-a"][0] / GPUS["gtx970-a"][1],
            figure(PAPER_IMAX["gtx970"], 0.01),
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
            "Table 1 summed: W (equation (4))",
            "≈ 334 MFLOPs",
            f"{table_w / 1e6:.2f} MFLOPs",
            table_w,
            figure(334e6, 1e6),
        ),
        (
            "Table 1 summed: M (equation (5))",
            "≈ 289 MB",
            f"{table_m / 1e6:.2f} MB",
            table_m,
            figure(289e6, 1e6),
        ),
        (
            "predicted best = measured best, 1000 identical trials",
            "91.6 %",
            ", ".join(
                f"σ {n * 100:g} %: {a * 100:.1f} %" for n, a in zip(NOISES, accuracies, strict=True)
            ),
            accuracies,
            figure(PAPER_ACCURACY, 0.001),
        ),
    ]
    verdicts = {quantity: verdict(value, paper) for quantity, _, _, value, paper in side}
    side_rows = [[q, paper, shown, verdicts[q]] for q, paper, shown, _, _ in side]
    side_rows.insert(
        -1,
        [
            "the predicted plan",
            "GTX 1080 alone (section 4.2)",
            predicted.label,
            "same" if predicted == _plan("single", "gtx1080") else "different",
        ],
    )
    side_rows.insert(
        -1,
        [
            "the measured-fastest plan without noise",
            "GTX 1080 alone (figure 6's text)",
            measured_best.label,
            "same" if measured_best == _plan("single", "gtx1080") else "different",
        ],
    )
    report.table(
        ["quantity", "paper", "ours", "in the paper's range?"],
        side_rows,
        "Side by side (paper: section 4.1 after its Table 1, and section 4.2)",
    )
    report.table(
        [
            "run-to-run noise σ",
            f"accuracy, {trials} identical trials",
            f"expected accuracy ({LARGE_SAMPLE:,} draws)",
            "plans that measured fastest",
        ],
        [
            [
                f"{noise * 100:g} %",
                f"{sweep[noise][0] * 100:.1f} %",
                f"{expected[noise] * 100:.1f} %",
                "; ".join(
                    f"{label} {count}"
                    for label, count in sorted(sweep[noise][1].items(), key=lambda kv: -kv[1])
                ),
            ]
            for noise in NOISES
        ],
        "The accuracy experiment over the run-to-run noise the paper does not give",
    )
    total = EPOCHS * MNIST_TRAIN_SAMPLES
    alone = predict(ALEXNET, [workers()[0]], total).seconds
    comparison_syncs = (1, syncs)
    rows = []
    for plan in PLANS:
        chosen_workers = [w for w in workers() if w.name in plan.nodes]
        row = [plan.label, f"{MEASURED[plan]:.3f}"]
        for per_epoch in comparison_syncs:
            seconds = predict(ALEXNET, chosen_workers, total, syncs=EPOCHS * per_epoch).seconds
            row.append(f"{seconds / alone:.3f}")
        rows.append(row)
    report.table(
        [
            "plan",
            "measured (paper's text), x GTX 1080 alone",
            "predicted, 1 sync per epoch",
            f"predicted, {syncs} syncs per epoch",
        ],
        rows,
        "Each plan's time: the paper's measurement against the Roofline prediction",
    )
    sync_rows, by_frequency = [], {}
    for per_epoch in SYNCS_PER_EPOCH:
        plan, allocation = predicted_plan(per_epoch)
        by_frequency[str(per_epoch)] = {"plan": plan.label, "seconds": allocation.seconds}
        sync_rows.append(
            [
                per_epoch,
                plan.label,
                f"{allocation.seconds / alone:.3f}",
                "yes" if plan == measured_best else "no",
            ]
        )
    report.table(
        [
            "syncs per epoch",
            "predicted plan",
            "its predicted time, x GTX 1080 alone",
            "= the measured best?",
        ],
        sync_rows,
        "The prediction over the synchronisation frequency the paper does not give",
    )
    mode_rows = []
    for nodes in (_PAIR_A, _ALL, _TWO_970):
        speeds = [w.attainable(ALEXNET) for w in workers() if w.name in nodes]
        step7 = sync_or_async(speeds)
        sync_t, async_t = MEASURED[_plan("sync", *nodes)], MEASURED[_plan("async", *nodes)]
        faster = "async" if async_t < sync_t else "sync"
        mode_rows.append(
            [
                " + ".join(nodes),
                f"{statistics.pstdev(speeds) / statistics.fmean(speeds):.3f}",
                step7,
                faster,
                f"{abs(sync_t - async_t) / min(sync_t, async_t) * 100:.1f} %",
            ]
        )
    report.table(
        [
            "node set",
            "CV of attainable compute",
            "step 7 chooses",
            "measured faster (paper)",
            "by",
        ],
        mode_rows,
        "Step 7 (sync vs async, decided after the node set) against the paper's measurements",
    )
    report.data = {
        "predicted_plan": predicted.label,
        "predicted_seconds": chosen.seconds,
        "measured_best": measured_best.label,
        "measured_relative": {plan.label: MEASURED[plan] for plan in PLANS},
        "accuracy_by_noise": {str(noise): sweep[noise][0] for noise in NOISES},
        "expected_accuracy_by_noise": {str(noise): expected[noise] for noise in NOISES},
        "fastest_by_noise": {str(noise): sweep[noise][1] for noise in NOISES},
        "implied_noise": implied,
        "implied_noise_band": list(band),
        "prediction_by_syncs_per_epoch": by_frequency,
        "table_1": {"flops": table_w, "memory_bytes": table_m},
        "paper_accuracy": PAPER_ACCURACY,
        "verdicts": verdicts,
        "hardware": {name: {"peak": pi, "bandwidth": beta} for name, (pi, beta) in GPUS.items()},
    }
    report.paragraph("Why ours differs", _why(predicted, implied, band, expected, table_w))
    report.paragraph("How the verdicts are computed", VERDICT_RULE)
    return report


def _why(
    predicted: Plan,
    implied: float,
    band: tuple[float, float],
    expected: dict[float, float],
    table_w: float,
) -> str:
    runner_up = sorted(MEASURED.values())[1]
    return (
        f"With the paper's own measurements as the ground truth, the predictor and the "
        f"measurements agree on the best plan ({predicted.label}); what the accuracy "
        "experiment then counts is how often run-to-run noise makes another plan measure "
        "faster in one repetition. Two asynchronous sets with the GTX 1080 measured only "
        f"{(runner_up - 1) * 100:.1f} % slower than the GTX 1080 alone, so a spread of "
        f"σ ≈ {implied * 100:.2f} % per run gives the paper's 91.6 % (σ from "
        f"{band[0] * 100:.2f} % to {band[1] * 100:.2f} % is within what 1000 trials resolve); "
        f"at σ = 0.5 % ours is {expected[0.005] * 100:.1f} %, at 2 % "
        f"{expected[0.02] * 100:.1f} %, at 5 % {expected[0.05] * 100:.1f} %. The paper "
        "reports no run-to-run spread, so its 91.6 % cannot be checked further: it measures "
        "that spread, not the Roofline model. The model's times disagree with the measurements "
        "(the table of plans): it predicts a GTX 970 1.52x slower than the GTX 1080 where the "
        "paper measured 2.20x, and it charges every distributed plan the full 289 MB per "
        "synchronisation over 100 Mbit/s (23 s each), so with one synchronisation per "
        "mini-batch it predicts distributed training tens of times slower, where the paper "
        "measured 2.3 % to 83 % slower; with one per epoch it predicts the three nodes faster "
        "than the GTX 1080 alone, which the paper did not measure. Its choice agrees with the "
        "measurements for every frequency of 4 per epoch or more. Step 7 picks asynchronous "
        "training for both sets with the GTX 1080, as measured, and synchronous for the two "
        "GTX 970s, where the paper measured the two modes within 0.1 %. Table 1's FLOPS "
        f"column sums to {table_w / 1e6:.2f} M (the text says ≈ 334 M; {table_w / 2**20:.1f} "
        "if divided by 2^20); its memory sums to 289.58 MB, which the text gives as ≈ 289 MB "
        "(truncated; our verdict rule rounds). The 0.1 % between the two GTX 970 modes comes "
        "from percentages the paper rounds, so that measurement is a tie. We use the "
        "text's W and M, as the paper's own figures (I = 1.16) do; Table 1's sum would make "
        "I = 1.21 FLOP/B, still memory-bound on both GPUs, the choice unchanged."
    )
