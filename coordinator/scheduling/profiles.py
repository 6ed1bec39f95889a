"""Model profiles the coordinator knows by name, and P3's "borrow the most similar" rule.

Nominal numbers for a V100-class GPU: samples/s per GPU at a typical batch, P3's communication
penalty (γ, λ) and P4's per-sample forward FLOPs (W), memory traffic (M) and gradient bytes
exchanged per synchronisation. They are starting points for jobs that bring no profile of
their own; a job's measured profile always wins.
"""

from __future__ import annotations

import math

from .model import ModelProfile


def _profile(
    name: str,
    samples_per_s: float,
    gamma: float,
    lam: float,
    flops: float,
    memory: float,
    sync: float,
) -> ModelProfile:
    return ModelProfile(
        name,
        (samples_per_s, 0.0, 0.0),
        comm_gamma=gamma,
        comm_lambda=lam,
        forward_flops=flops,
        memory_bytes=memory,
        sync_bytes=sync,
    )


KNOWN_PROFILES: dict[str, ModelProfile] = {
    p.name: p
    for p in (
        _profile("resnet50", 1100.0, 0.012, 4.0, 4.1e9, 0.10e9, 102e6),
        _profile("alexnet", 8000.0, 0.030, 6.0, 0.72e9, 0.24e9, 244e6),
        _profile("googlenet", 2400.0, 0.015, 4.0, 1.5e9, 0.06e9, 28e6),
        _profile("inception3", 820.0, 0.014, 4.0, 5.7e9, 0.11e9, 96e6),
        _profile("vgg16", 640.0, 0.035, 7.0, 15.5e9, 0.55e9, 552e6),
        _profile("lstm", 3600.0, 0.020, 5.0, 0.2e9, 0.08e9, 80e6),
        _profile("seq2seq", 1650.0, 0.025, 5.0, 0.5e9, 0.15e9, 200e6),
    )
}

#: For jobs that say nothing about their model: one sample per second per GPU, no penalty.
#: Only relative times matter to placement, so the scale is arbitrary.
UNKNOWN = ModelProfile("unknown", (1.0, 0.0, 0.0))


def most_similar(forward_flops: float, memory_bytes: float) -> ModelProfile:
    """P3: an unknown model borrows the profile of the known model closest in (log W, log M)."""

    def distance(profile: ModelProfile) -> float:
        assert profile.forward_flops and profile.memory_bytes
        return math.hypot(
            math.log(profile.forward_flops / forward_flops),
            math.log(profile.memory_bytes / memory_bytes),
        )

    return min(KNOWN_PROFILES.values(), key=distance)
