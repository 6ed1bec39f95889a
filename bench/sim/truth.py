"""The simulator's ground truth: how fast each model really trains, and offline profiling.

Policies never see these numbers directly. They see a :class:`ModelProfile` made by
:func:`profile_offline`, which measures the truth with noise and fits P3's models to it (a
quadratic per-GPU throughput and γ, λ) — the way P3 profiles models before scheduling them.

True per-GPU throughput saturates with the local batch, ``peak · b / (b + half_batch)``, which a
quadratic can only approximate; the communication penalty has P3's form with the model's own
γ and λ. Numbers are for a V100-class GPU in samples/s, rounded from public benchmarks; they set
the scale of the workloads, not any result's direction.
"""

from __future__ import annotations

import random
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
