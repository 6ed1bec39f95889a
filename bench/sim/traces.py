"""Workloads: generators for the papers' traces and a CSV trace format.

Generators are deterministic for a seed. Job sizes are given as a duration on the GPUs the
job asks for (the way traces report them) and turned into samples with the true speed.

CSV format (one job per row, header required; see docs/scheduling.md):
``job_id,arrival_s,gpus,model,epochs`` are required; ``dataset``, ``samples_per_epoch``
(required when there is no dataset), ``batch_size``, ``batch_per_gpu`` (0/1), ``qos``
(urgent/prior/normal), ``max_gpus`` and ``candidates`` (node names separated by spaces) are
optional.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from coordinator.scheduling.model import JobSpec, ModelProfile, QosClass, SchedulingError
from coordinator.scheduling.perf import packed_shape

from .cluster import DatasetSpec, SimulationError, Trace
from .truth import CATALOGUE

T = TypeVar("T")

MINUTE = 60.0
HOUR = 3600.0

#: Gandiva's job-duration statistics (which P2 cites): ~30 % under 10 min, 62 % under 100 min,
#: 82 % under 1000 min. Within a class durations are log-uniform; the open-ended last class
#: is capped at 3000 min (our choice).
GANDIVA_CLASSES: tuple[tuple[float, float, float], ...] = (
    (0.30, 1 * MINUTE, 10 * MINUTE),
    (0.32, 10 * MINUTE, 100 * MINUTE),
    (0.20, 100 * MINUTE, 1000 * MINUTE),
    (0.18, 1000 * MINUTE, 3000 * MINUTE),
)

#: P3's Urgent : Prior : Normal mix.
QOS_MIX: tuple[tuple[QosClass, float], ...] = (
    (QosClass.URGENT, 0.05),
    (QosClass.PRIOR, 0.35),
    (QosClass.NORMAL, 0.60),
)

P3_MODELS = ("alexnet", "googlenet", "resnet50", "inception3", "lstm", "seq2seq")

CSV_REQUIRED = ("job_id", "arrival_s", "gpus", "model", "epochs")
CSV_OPTIONAL = (
    "dataset",
    "samples_per_epoch",
    "batch_size",
    "batch_per_gpu",
    "qos",
    "max_gpus",
    "candidates",
)


def poisson_arrivals(rng: random.Random, count: int, mean_gap_s: float) -> list[float]:
    """``count`` arrival times with exponential gaps (a Poisson process), the first at 0."""
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(1.0 / mean_gap_s)
    return times


def poisson_over(rng: random.Random, per_hour: float, hours: float) -> list[float]:
    """Arrival times of a Poisson process of ``per_hour`` over ``hours``."""
    times, now = [], rng.expovariate(per_hour / HOUR)
    while now < hours * HOUR:
        times.append(now)
        now += rng.expovariate(per_hour / HOUR)
    return times


def gandiva_duration(
    rng: random.Random, classes: Sequence[tuple[float, float, float]] = GANDIVA_CLASSES
) -> float:
    """A job duration in seconds drawn from duration ``classes`` (weight, low s, high s)."""
    low, high = weighted_choice(rng, [((low, high), weight) for weight, low, high in classes])
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def weighted_choice(rng: random.Random, options: Sequence[tuple[T, float]]) -> T:
    """One value of (value, weight) pairs, with probability proportional to its weight."""
    pick = rng.random() * sum(weight for _, weight in options)
    for value, weight in options:
        if pick < weight:
            return value
        pick -= weight
    return options[-1][0]


def job_lasting(
    job_id: str,
    arrival: float,
    duration_s: float,
    gpus: int,
    profile: ModelProfile,
    *,
    per_node: int,
    samples_per_epoch: int,
    batch_size: int = 256,
    batch_per_gpu: bool = True,
    **fields: object,
) -> JobSpec:
    """A job that takes ``duration_s`` at its true speed on ``gpus`` packed GPUs."""
    probe = JobSpec(
        job_id, arrival, gpus, profile, 1.0, samples_per_epoch, batch_size, batch_per_gpu
    )
    rate = CATALOGUE[profile.name].rate(probe, packed_shape(gpus, per_node))
    return JobSpec(
        job_id,
        arrival,
        gpus,
        profile,
        duration_s * rate,
        samples_per_epoch,
        batch_size,
        batch_per_gpu,
        **fields,  # type: ignore[arg-type]
    )


# --- the papers' workloads --------------------------------------------------------------------


def p2_workload(
    seed: int,
    profiles: Mapping[str, ModelProfile],
    *,
    jobs: int = 20,
    mean_gap_s: float = 15 * MINUTE,
    total_gpus: int = 12,
    per_node: int = 4,
) -> Trace:
    """Poisson arrivals (mean gap 15 min), Gandiva durations, 1/2/4-GPU requests: an earlier
    stand-in for P2's workload, kept as a sample trace. P2's own set-up (job classes by one-GPU
    time in four mixes, one GPU per request) is built in ``bench/sim/experiments/p2.py``."""
    rng = random.Random(seed)
    models = ("resnet50", "googlenet", "inception3", "vgg16", "lstm", "seq2seq")
    specs = []
    for index, arrival in enumerate(poisson_arrivals(rng, jobs, mean_gap_s)):
        gpus = weighted_choice(rng, ((1, 0.5), (2, 0.3), (4, 0.2)))
        model = rng.choice(models)
        duration = gandiva_duration(rng)
        specs.append(
            job_lasting(
                f"p2-{index:03d}",
                arrival,
                duration,
                gpus,
                profiles[model],
                per_node=per_node,
                samples_per_epoch=50_000,
                max_gpus=total_gpus,
            )
        )
    return Trace(tuple(specs))


def p3_workload(
    seed: int, profiles: Mapping[str, ModelProfile], *, per_hour: float, hours: float = 24.0
) -> Trace:
    """P3: Poisson arrivals over ``hours``, Urgent:Prior:Normal = 5:35:60, six models.

    Each task asks 1/2/4/8 GPUs (what the queue-based baselines give it) and may use up to 8
    (what the placement-choosing policies may pick); its single-GPU time is log-uniform in
    [10 min, 4 h] (our choice: P3's Table 2, which sets the tasks' hyper-parameters, is an image
    missing from the paper's text; the text says only that they are drawn uniformly).
    """
    rng = random.Random(seed)
    specs = []
    for index, arrival in enumerate(poisson_over(rng, per_hour, hours)):
        model = rng.choice(P3_MODELS)
        qos = weighted_choice(rng, QOS_MIX)
        gpus = weighted_choice(rng, ((1, 0.35), (2, 0.3), (4, 0.25), (8, 0.1)))
        single_gpu_s = math.exp(rng.uniform(math.log(10 * MINUTE), math.log(4 * HOUR)))
        specs.append(
            job_lasting(
                f"p3-{index:03d}",
                arrival,
                single_gpu_s,
                1,
                profiles[model],
                per_node=8,
                samples_per_epoch=100_000,
                batch_size=256,
                batch_per_gpu=False,
                qos=qos,
                max_gpus=8,
            )
        )
        specs[-1] = dataclasses.replace(specs[-1], gpus=gpus)
    return Trace(tuple(specs))


def p5_workload(
    seed: int,
    profiles: Mapping[str, ModelProfile],
    *,
    apps: int = 40,
    mean_gap_s: float = 20 * MINUTE,
    per_node: int = 4,
    long_running: bool = True,
) -> Trace:
    """P5: apps arrive as a Poisson process with 1–16 GPU demands and a mix of
    placement-sensitive (VGG, AlexNet) and insensitive models.

    Durations follow Gandiva's classes; ``long_running`` drops the under-10-minute class (P5's
    apps are long-running: short trials are bundled inside hyper-parameter apps).
    """
    rng = random.Random(seed)
    models = ("vgg16", "alexnet", "resnet50", "inception3", "lstm")
    classes = GANDIVA_CLASSES[1:] if long_running else GANDIVA_CLASSES
    specs = []
    for index, arrival in enumerate(poisson_arrivals(rng, apps, mean_gap_s)):
        demand = weighted_choice(rng, ((1, 0.3), (2, 0.25), (4, 0.25), (8, 0.15), (16, 0.05)))
        specs.append(
            job_lasting(
                f"app-{index:03d}",
                arrival,
                gandiva_duration(rng, classes),
                demand,
                profiles[rng.choice(models)],
                per_node=per_node,
                samples_per_epoch=50_000,
            )
        )
    return Trace(tuple(specs))


# --- CSV --------------------------------------------------------------------------------------


def load_csv(
    path: Path | str,
    profiles: Mapping[str, ModelProfile],
    datasets: Mapping[str, DatasetSpec] | None = None,
) -> Trace:
    """Read a trace from CSV; every error names the line and the column."""
    datasets = dict(datasets or {})
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in CSV_REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise SimulationError(f"{path}: header lacks required column(s) {', '.join(missing)}")
        unknown = set(reader.fieldnames or []) - set(CSV_REQUIRED) - set(CSV_OPTIONAL)
        if unknown:
            raise SimulationError(f"{path}: unknown column(s) {', '.join(sorted(unknown))}")
        jobs = [
            _row_to_job(row, f"{path}:{line}", profiles, datasets)
            for line, row in enumerate(reader, start=2)
        ]
    ids = [job.job_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise SimulationError(f"{path}: job ids are not unique")
    used = {job.dataset for job in jobs if job.dataset}
    return Trace(tuple(jobs), {name: datasets[name] for name in sorted(used)})


def _row_to_job(
    row: Mapping[str, str],
    where: str,
    profiles: Mapping[str, ModelProfile],
    datasets: Mapping[str, DatasetSpec],
) -> JobSpec:
    def number(column: str, kind: type = float, default: object = None) -> object:
        text = (row.get(column) or "").strip()
        if not text:
            if default is None:
                raise SimulationError(f"{where}: column {column!r} is empty")
            return default
        try:
            return kind(text)
        except ValueError:
            raise SimulationError(
                f"{where}: column {column!r}={text!r} is not a {kind.__name__}"
            ) from None

    model = (row.get("model") or "").strip()
    if model not in profiles:
        raise SimulationError(
            f"{where}: unknown model {model!r}; known: {', '.join(sorted(profiles))}"
        )
    dataset = (row.get("dataset") or "").strip() or None
    if dataset is not None and dataset not in datasets:
        raise SimulationError(f"{where}: unknown dataset {dataset!r}")
    default_spe = datasets[dataset].samples if dataset else None
    samples_per_epoch = int(number("samples_per_epoch", int, default_spe))  # type: ignore[call-overload]
    qos_text = (row.get("qos") or "normal").strip().lower()
    try:
        qos = QosClass(qos_text)
    except ValueError:
        raise SimulationError(f"{where}: qos {qos_text!r} is not urgent, prior or normal") from None
    max_gpus_text = (row.get("max_gpus") or "").strip()
    candidates_text = (row.get("candidates") or "").strip()
    try:
        return JobSpec(
            job_id=(row.get("job_id") or "").strip(),
            arrival=float(number("arrival_s")),  # type: ignore[arg-type]
            gpus=int(number("gpus", int)),  # type: ignore[call-overload]
            profile=profiles[model],
            samples=float(number("epochs")) * samples_per_epoch,  # type: ignore[arg-type]
            samples_per_epoch=samples_per_epoch,
            batch_size=int(number("batch_size", int, 256)),  # type: ignore[call-overload]
            batch_per_gpu=bool(int(number("batch_per_gpu", int, 1))),  # type: ignore[call-overload]
            dataset=dataset,
            qos=qos,
            max_gpus=int(max_gpus_text) if max_gpus_text else None,
            candidates=frozenset(candidates_text.split()) if candidates_text else None,
        )
    except (SchedulingError, ValueError) as err:
        raise SimulationError(f"{where}: {err}") from None


def dump_csv(jobs: Iterable[JobSpec], path: Path | str) -> None:
    """Write jobs in the CSV format :func:`load_csv` reads."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*CSV_REQUIRED, *CSV_OPTIONAL])
        writer.writeheader()
        for job in jobs:
            writer.writerow(
                {
                    "job_id": job.job_id,
                    "arrival_s": repr(job.arrival),
                    "gpus": job.gpus,
                    "model": job.profile.name,
                    "epochs": repr(job.epochs),
                    "dataset": job.dataset or "",
                    "samples_per_epoch": job.samples_per_epoch,
                    "batch_size": job.batch_size,
                    "batch_per_gpu": int(job.batch_per_gpu),
                    "qos": job.qos.value,
                    "max_gpus": "" if job.max_gpus is None else job.max_gpus,
                    "candidates": " ".join(sorted(job.candidates or ())),
                }
            )
