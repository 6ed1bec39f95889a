"""Throughput and time predictions shared by the policies.

The throughput model is P3's: a job on placement s processes
``PR(t, s) = (G - Comm(s)) * sPR(local batch)`` samples/s, where ``sPR`` is the per-GPU
throughput (a quadratic fitted offline) and ``Comm(s)`` is the communication penalty in
"GPUs lost". Comm generalises P3's symmetric formula ``γ·((d_g - 1) + λ·(d_node - 1)·d_g)``
to any placement by averaging, over the job's GPUs, γ times the number of same-node peers plus
λ times the number of other-node peers; for a symmetric placement the two formulas agree.
"""

from __future__ import annotations

from .model import JobSpec, ModelProfile, Placement


def comm_penalty(placement: Placement, gamma: float, lam: float) -> float:
    """P3's Comm(s): GPUs' worth of throughput lost to communication on this placement."""
    total = sum(placement.values())
    if total <= 1:
        return 0.0
    peer_cost = sum(g * ((g - 1) + lam * (total - g)) for g in placement.values() if g > 0)
    return gamma * peer_cost / total


def local_batch(spec: JobSpec, total_gpus: int) -> float:
    """The batch each GPU processes per step."""
    return float(spec.batch_size) if spec.batch_per_gpu else spec.batch_size / total_gpus


def per_gpu_throughput(profile: ModelProfile, batch: float) -> float:
    """P3's sPR: the fitted quadratic, clamped to the profiled batch range and kept positive."""
    x = min(max(batch, profile.batch_min), profile.batch_max)
    a, b, c = profile.throughput_coeffs
    return max(a + b * x + c * x * x, 1e-9)


def estimated_rate(spec: JobSpec, placement: Placement) -> float:
    """Predicted samples/s of ``spec`` on ``placement`` (0 when communication eats it all)."""
    total = sum(placement.values())
    if total <= 0:
        return 0.0
    profile = spec.profile
    effective_gpus = total - comm_penalty(placement, profile.comm_gamma, profile.comm_lambda)
    if effective_gpus <= 0:
        return 0.0
    return effective_gpus * per_gpu_throughput(profile, local_batch(spec, total))


def compute_seconds(spec: JobSpec, placement: Placement, samples: float) -> float:
    """P3's L(t, s) = samples / PR(t, s) + v, ignoring I/O; infinite if the rate is 0."""
    rate = estimated_rate(spec, placement)
    if rate <= 0:
        return float("inf")
    return samples / rate + spec.profile.startup_s


def packed_shape(gpus: int, per_node: int) -> dict[str, int]:
    """A compact placement shape (full nodes, then the remainder) for predictions by count."""
    shape: dict[str, int] = {}
    while gpus > 0:
        shape[f"node{len(shape)}"] = min(per_node, gpus)
        gpus -= per_node
    return shape
