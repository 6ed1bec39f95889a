"""The simulator's ground truth: how fast each model really trains, and offline profiling.

Policies never see these numbers directly. They see a :class:`ModelProfile` made by
:func:`profile_offline`, which measures the truth with noise and fits P3's models to it (a
quadratic per-GPU throughput and γ, λ) — the way P3 profiles models before scheduling them.

True per-GPU throughput saturates with the local batch, ``peak · b / (b + half_batch)``, which a
quadratic can only approximate; the communication penalty has P3's form with the model's own
γ and λ. Numbers are for a V100-class GPU in samples/s, rounded from public benchmarks; they set
the scale of the workloads, not any result's direction.

P3's experiment does not use this catalogue: its truth, :func:`k80_catalogue` below, models the
paper's Tesla K80 platform with the gradient exchange timed, a form independent of P3's
predictor.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.scheduling.model import JobSpec, ModelProfile, Placement
from coordinator.scheduling.perf import comm_penalty, local_batch
from coordinator.scheduling.profiles import KNOWN_PROFILES
from coordinator.scheduling.qos import fit_comm_penalty, fit_quadratic_throughput

PROFILED_BATCHES = (16, 24, 32, 48, 64, 96, 128, 192, 256)
PROFILED_PLACEMENTS: tuple[dict[str, int], ...] = (
    {"a": 2},
    {"a": 4},
    {"a": 8},
    {"a": 1, "b": 1},
    {"a": 2, "b": 2},
    {"a": 4, "b": 4},
    {"a": 2, "b": 2, "c": 2, "d": 2},
)


@dataclass(frozen=True)
class TrueModel:
    """How a model really behaves in the simulator."""

    name: str
    #: samples/s of one GPU at a very large batch.
    peak_per_gpu: float
    #: local batch at which one GPU reaches half its peak.
    half_batch: float
    gamma: float
    lam: float
    #: seconds to start or restart a job (P3's v).
    startup_s: float = 20.0
    #: P4's W (forward FLOPs per sample) and M (bytes of memory traffic).
    forward_flops: float | None = None
    memory_bytes: float | None = None
    #: bytes of gradients exchanged per synchronisation.
    sync_bytes: float | None = None

    def per_gpu(self, batch: float) -> float:
        return self.peak_per_gpu * batch / (batch + self.half_batch)

    def rate(self, spec: JobSpec, placement: Placement) -> float:
        """True samples/s of ``spec`` on ``placement`` when data is never the bottleneck."""
        total = sum(placement.values())
        if total == 0:
            return 0.0
        effective = total - comm_penalty(placement, self.gamma, self.lam)
        return max(effective, 0.0) * self.per_gpu(local_batch(spec, total))


# ResNet-50 and friends on V100-class GPUs (fp16), one catalogue for every experiment. W, M and
# the gradient bytes are the coordinator's published profiles: the cost of a model is a fact,
# only its speed and scaling are hidden from the policies.
_SPEEDS = {
    # name: (peak samples/s per GPU, half-speed batch, γ, λ, start-up s)
    "resnet50": (1250.0, 24.0, 0.012, 4.0, 20.0),
    "alexnet": (9000.0, 48.0, 0.030, 6.0, 10.0),
    "googlenet": (2600.0, 24.0, 0.015, 4.0, 15.0),
    "inception3": (900.0, 24.0, 0.014, 4.0, 25.0),
    "vgg16": (700.0, 16.0, 0.035, 7.0, 20.0),
    "lstm": (4000.0, 32.0, 0.020, 5.0, 10.0),
    "seq2seq": (1800.0, 32.0, 0.025, 5.0, 15.0),
}
CATALOGUE: dict[str, TrueModel] = {
    name: TrueModel(
        name,
        peak,
        half_batch,
        gamma,
        lam,
        startup,
        KNOWN_PROFILES[name].forward_flops,
        KNOWN_PROFILES[name].memory_bytes,
        KNOWN_PROFILES[name].sync_bytes,
    )
    for name, (peak, half_batch, gamma, lam, startup) in _SPEEDS.items()
}


def profile_offline(model: TrueModel, rng: random.Random, noise: float = 0.01) -> ModelProfile:
    """Measure ``model`` with multiplicative noise and fit P3's models, as a profiler would."""

    def measure(value: float) -> float:
        return value * (1.0 + rng.gauss(0.0, noise))

    batches = [(b, measure(model.per_gpu(b))) for b in PROFILED_BATCHES]
    coeffs = fit_quadratic_throughput(batches)
    probe = JobSpec("probe", 0.0, 1, _placeholder_profile(model), 1.0, 1, 64, batch_per_gpu=True)
    comm_samples = [
        (placement, measure(model.rate(probe, placement)), model.per_gpu(64))
        for placement in PROFILED_PLACEMENTS
    ]
    gamma, lam = fit_comm_penalty(comm_samples)
    return ModelProfile(
        name=model.name,
        throughput_coeffs=coeffs,
        batch_min=float(PROFILED_BATCHES[0]),
        batch_max=float(PROFILED_BATCHES[-1]),
        comm_gamma=gamma,
        comm_lambda=lam,
        forward_flops=model.forward_flops,
        memory_bytes=model.memory_bytes,
        sync_bytes=model.sync_bytes,
        startup_s=model.startup_s,
    )


def _placeholder_profile(model: TrueModel) -> ModelProfile:
    """A profile for building probe jobs; only its name is used by the truth."""
    return ModelProfile(model.name, (1.0, 0.0, 0.0))


def profiles(seed: int, noise: float = 0.01) -> dict[str, ModelProfile]:
    """Offline profiles of the whole catalogue (deterministic for a seed)."""
    rng = random.Random(seed)
    return {name: profile_offline(model, rng, noise) for name, model in sorted(CATALOGUE.items())}


# --- P3's platform: Tesla K80 cores, the gradient exchange timed (not P3's penalty) -----------
#
# P3 ran on 4 nodes, each with 2 Tesla K80 boards (4 GK210 GPU cores), joined by 56 Gb/s
# InfiniBand, under TensorFlow 1.7 (the paper, its experimental platform and Table 1). Its
# predictor is PR = (G − Comm(s))·sPR with sPR a quadratic in the local batch and Comm linear in
# the peer counts; the truth that scores it must not be that predictor. Here
# one synchronous data-parallel step on G cores takes
#     t_step = t_compute(b) + t_sync(placement),      b = the local batch,
#     t_compute(b) = step_overhead + b · sample_seconds,
#     t_sync = 2(g−1)/g · S / B_intra + 2(k−1)/k · S / B_inter,
# so a core's rate b / t_compute(b) saturates with the batch (a fixed cost per step: kernel
# launches, the session's bookkeeping), and t_sync is a two-level all-reduce of the model's S
# gradient bytes: inside each node over its g busiest cores, then across the k nodes. The rate
# lost to it, G·t_sync/t_step, grows with the bytes, saturates with the peer counts and shrinks
# as the local batch grows: P3's constant γ, λ can only approximate it. Inference tasks run the
# forward pass only, a third of a training step (the backward pass costs about two forward
# passes), and do not synchronise.
#
# Numbers. For ResNet-50 and Inception-v3 the published tf_cnn_benchmarks results for the
# Tesla K80 (TensorFlow's benchmarks page, "Details for Google Compute Engine (NVIDIA Tesla
# K80)", synthetic data, one GK210 per "GPU") give one-core rates at batches 32 and 64, hence
# step_overhead and sample_seconds; AlexNet was measured at batch 512 only, so its
# sample_seconds is solved through that point with the two models' mean step_overhead. The
# 4-core rate of the same server gives the time lost per step, hence B_intra, for all three.
# GoogLeNet, the LSTM and Seq2Seq have no such measurement: their sample_seconds is their
# forward FLOPs (KNOWN_PROFILES, 3 passes per training sample) at the mean effective FLOP rate
# of ResNet-50 and Inception-v3, with the mean step_overhead and the mean B_intra. S is each
# model's parameter bytes (fp32; KNOWN_PROFILES.sync_bytes). B_inter is 56 Gb/s times an
# efficiency of our choosing (TensorFlow 1.7's gRPC transport uses a fraction of the link),
# which the P3 report sweeps. Tasks do not share links with each other (P3's model assumes the
# same).

#: tf_cnn_benchmarks on Tesla K80 GK210 cores: model -> ({per-core batch: images/s on 1 core},
#: (per-core batch, images/s on 4 cores of one server)).
K80_MEASURED: dict[str, tuple[dict[int, float], tuple[int, float]]] = {
    "resnet50": ({32: 53.9, 64: 56.7}, (64, 211.0)),
    "inception3": ({32: 29.3, 64: 30.5}, (64, 115.0)),
    "alexnet": ({512: 639.0}, (512, 2067.0)),
}
#: P3's Table 1: 56 Gb/s InfiniBand between nodes, in bytes/s.
INFINIBAND_BYTES_PER_S = 56e9 / 8
#: the share of the InfiniBand link a gradient exchange gets (our choice; swept by the report).
INTER_NODE_EFFICIENCY = 0.25
#: P3's v, seconds to start a task (our choice: the paper names v but gives no value).
K80_STARTUP_S = 30.0
P3_MODEL_NAMES = ("alexnet", "googlenet", "resnet50", "inception3", "lstm", "seq2seq")
INFERENCE_SUFFIX = ":inference"


@dataclass(frozen=True)
class SyncTrainingModel:
    """Ground truth of one (model, compute type) on P3's K80 platform.

    It has what the simulator uses of a :class:`TrueModel`: ``rate`` and ``startup_s``."""

    name: str
    #: fixed seconds of one step on one core, whatever the batch.
    step_overhead_s: float
    #: seconds per sample of one step on one core.
    sample_s: float
    #: bytes of gradients all-reduced per step (0 for inference).
    gradient_bytes: float
    #: effective all-reduce bandwidth inside a node and between nodes, bytes/s.
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    startup_s: float = K80_STARTUP_S

    def per_gpu(self, batch: float) -> float:
        """Samples/s of one core at local batch ``batch``."""
        return batch / (self.step_overhead_s + batch * self.sample_s)

    def sync_seconds(self, placement: Placement) -> float:
        """The two-level all-reduce of one step on ``placement``."""
        counts = [g for g in placement.values() if g > 0]
        if self.gradient_bytes <= 0 or sum(counts) <= 1:
            return 0.0
        busiest, nodes = max(counts), len(counts)
        intra = 2 * (busiest - 1) / busiest * self.gradient_bytes / self.intra_bytes_per_s
        inter = 2 * (nodes - 1) / nodes * self.gradient_bytes / self.inter_bytes_per_s
        return intra + inter

    def rate(self, spec: JobSpec, placement: Placement) -> float:
        """True samples/s of ``spec`` on ``placement``."""
        total = sum(placement.values())
        if total == 0:
            return 0.0
        batch = local_batch(spec, total)
        step = self.step_overhead_s + batch * self.sample_s + self.sync_seconds(placement)
        return total * batch / step


def k80_catalogue(
    inter_node_efficiency: float = INTER_NODE_EFFICIENCY,
) -> dict[str, SyncTrainingModel]:
    """Training and inference truths of P3's six models on its K80 platform."""
    # Two measured batches: t(b) = b / rate(b) is a line in b, overhead + b·sample_s.
    lines: dict[str, tuple[float, float]] = {}
    for name, (one_core, _four) in K80_MEASURED.items():
        if len(one_core) >= 2:
            (b1, r1), (b2, r2) = sorted(one_core.items())[:2]
            sample_s = (b2 / r2 - b1 / r1) / (b2 - b1)
            lines[name] = (b1 / r1 - b1 * sample_s, sample_s)
    mean_overhead = sum(overhead for overhead, _ in lines.values()) / len(lines)
    #: effective FLOP/s of a training sample (3 forward passes), ResNet-50 and Inception-v3.
    flop_rate = sum(
        3 * (KNOWN_PROFILES[name].forward_flops or 0.0) / sample_s
        for name, (_overhead, sample_s) in lines.items()
    ) / len(lines)

    def line_of(name: str) -> tuple[float, float]:
        if name in lines:
            return lines[name]
        if name in K80_MEASURED:  # one batch measured: the mean overhead through that point
            (batch, rate), *_ = K80_MEASURED[name][0].items()
            return mean_overhead, (batch / rate - mean_overhead) / batch
        return mean_overhead, 3 * (KNOWN_PROFILES[name].forward_flops or 0.0) / flop_rate

    intra: dict[str, float] = {}
    for name, (_one, (batch, four_rate)) in K80_MEASURED.items():
        overhead, sample_s = line_of(name)
        step = overhead + batch * sample_s  # one core's step at ``batch``
        lost = 4 * batch / four_rate - step  # seconds of all-reduce per step on 4 cores
        intra[name] = 2 * 3 / 4 * (KNOWN_PROFILES[name].sync_bytes or 0.0) / lost
    mean_intra = sum(intra.values()) / len(intra)
    inter = INFINIBAND_BYTES_PER_S * inter_node_efficiency
    models: dict[str, SyncTrainingModel] = {}
    for name in P3_MODEL_NAMES:
        overhead, sample_s = line_of(name)
        bandwidth = intra.get(name, mean_intra)
        grads = KNOWN_PROFILES[name].sync_bytes or 0.0
        models[name] = SyncTrainingModel(name, overhead, sample_s, grads, bandwidth, inter)
        inference = name + INFERENCE_SUFFIX
        models[inference] = SyncTrainingModel(
            inference, overhead / 3, sample_s / 3, 0.0, bandwidth, inter
        )
    return models


#: local batches P3's offline profiler measures one core at; the placements it measures
#: communication on (every symmetric ⟨d_node, d_g⟩ of more than one core on 4 x 4 cores) and the
#: global batches it runs them with (labelled like the paper's figure 4: "64B2N4G").
K80_PROFILED_BATCHES = (2, 4, 8, 16, 32, 64, 128, 256)
K80_PROFILED_PLACEMENTS: tuple[dict[str, int], ...] = tuple(
    {f"n{i}": per_node for i in range(nodes)}
    for nodes in (1, 2, 3, 4)
    for per_node in (1, 2, 3, 4)
    if nodes * per_node > 1
)
K80_PROBE_BATCHES = (32, 64, 128, 256)


def profile_k80(model: SyncTrainingModel, rng: random.Random, noise: float = 0.01) -> ModelProfile:
    """P3's offline profiling of ``model``: noisy one-core rates at several batches (the
    quadratic fit, least relative squares) and noisy rates of every probe batch on every
    multi-core placement, each against a noisy one-core run at its local batch (the γ, λ
    regression)."""

    def measure(value: float) -> float:
        return value * (1.0 + rng.gauss(0.0, noise))

    batches = [(b, measure(model.per_gpu(b))) for b in K80_PROFILED_BATCHES]
    coeffs = fit_quadratic_throughput(batches, relative=True)
    name_only = ModelProfile(model.name, (1.0, 0.0, 0.0))
    comm_samples = []
    for batch in K80_PROBE_BATCHES:
        probe = JobSpec("probe", 0.0, 1, name_only, 1.0, 1, batch)
        for placement in K80_PROFILED_PLACEMENTS:
            one_core = measure(model.per_gpu(local_batch(probe, sum(placement.values()))))
            comm_samples.append((placement, measure(model.rate(probe, placement)), one_core))
    gamma, lam = fit_comm_penalty(comm_samples)
    base = KNOWN_PROFILES[model.name.removesuffix(INFERENCE_SUFFIX)]
    return ModelProfile(
        name=model.name,
        throughput_coeffs=coeffs,
        batch_min=float(K80_PROFILED_BATCHES[0]),
        batch_max=float(K80_PROFILED_BATCHES[-1]),
        comm_gamma=gamma,
        comm_lambda=lam,
        forward_flops=base.forward_flops,
        memory_bytes=base.memory_bytes,
        sync_bytes=model.gradient_bytes,
        startup_s=model.startup_s,
    )


def k80_profiles(
    seed: int, truth: Mapping[str, SyncTrainingModel], noise: float = 0.01
) -> dict[str, ModelProfile]:
    """P3's offline profiles of every model in ``truth`` (deterministic for a seed)."""
    rng = random.Random(seed)
    return {name: profile_k80(model, rng, noise) for name, model in sorted(truth.items())}
