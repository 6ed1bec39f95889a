"""What a simulation run produced: per-job records and the metrics the papers report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from coordinator.scheduling.model import JobSpec, QosClass
from coordinator.scheduling.qos import expected_completion

_EPS = 1e-6


@dataclass(frozen=True)
class JobRecord:
    spec: JobSpec
    first_start: float
    finish: float
    #: T_independent for finish-time fairness.
    independent_s: float
    store_bytes: float
    peer_bytes: float
    local_bytes: float
    restarts: int

    @property
    def jct(self) -> float:
        return self.finish - self.spec.arrival

    @property
    def wait(self) -> float:
        return self.first_start - self.spec.arrival

    @property
    def rho(self) -> float:
        """Finish-time fairness ρ = T_shared / T_independent."""
        return self.jct / self.independent_s

    @property
    def qos_met(self) -> bool:
        """P3: Urgent tasks must start on arrival; the others must finish by their ECT."""
        if self.spec.qos is QosClass.URGENT:
            return self.wait <= _EPS
        return self.finish <= expected_completion(self.spec) + _EPS


@dataclass(frozen=True)
class SimResult:
    policy: str
    total_gpus: int
    jobs: tuple[JobRecord, ...]
    allocated_gpu_s: float
    preload_store_bytes: float
    events: int

    @property
    def makespan(self) -> float:
        return max(r.finish for r in self.jobs) - min(r.spec.arrival for r in self.jobs)

    @property
    def mean_jct(self) -> float:
        return statistics.fmean(r.jct for r in self.jobs)

    @property
    def qos_rate(self) -> float:
        return sum(r.qos_met for r in self.jobs) / len(self.jobs)

    @property
    def max_rho(self) -> float:
        return max(r.rho for r in self.jobs)

    @property
    def gpu_utilisation(self) -> float:
        """GPU-seconds held by jobs / (cluster GPUs x makespan)."""
        return self.allocated_gpu_s / (self.total_gpus * self.makespan)

    @property
    def store_bytes(self) -> float:
        """Bytes read from the object store, by jobs and by preloads."""
        return sum(r.store_bytes for r in self.jobs) + self.preload_store_bytes

    def summary(self) -> dict[str, float | str | int]:
        return {
            "policy": self.policy,
            "jobs": len(self.jobs),
            "mean_jct_s": self.mean_jct,
            "makespan_s": self.makespan,
            "qos_rate": self.qos_rate,
            "max_rho": self.max_rho,
            "mean_rho": statistics.fmean(r.rho for r in self.jobs),
            "gpu_utilisation": self.gpu_utilisation,
            "store_bytes": self.store_bytes,
            "peer_bytes": sum(r.peer_bytes for r in self.jobs),
            "local_bytes": sum(r.local_bytes for r in self.jobs),
            "restarts": sum(r.restarts for r in self.jobs),
            "events": self.events,
        }
