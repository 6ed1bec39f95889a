"""Small builders for jobs and cluster states used by the scheduling tests (a helper module,
imported by name: not a conftest, so it cannot be confused with the suite's root conftest)."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.scheduling.model import (
    ClusterState,
    Dataset,
    JobSpec,
    JobState,
    ModelProfile,
    Node,
    QosClass,
)

#: 1000 samples/s per GPU whatever the batch, 2 % of a GPU lost per peer, inter-node peers 4x.
LINEAR = ModelProfile("linear", (1000.0, 0.0, 0.0), comm_gamma=0.02, comm_lambda=4.0)


def job(
    job_id: str,
    gpus: int = 1,
    *,
    samples: float = 3.6e6,
    arrival: float = 0.0,
    dataset: str | None = None,
    qos: QosClass = QosClass.NORMAL,
    max_gpus: int | None = None,
    profile: ModelProfile = LINEAR,
) -> JobSpec:
    return JobSpec(
        job_id,
        arrival,
        gpus,
        profile,
        samples,
        samples_per_epoch=int(samples / 10),
        batch_size=256,
        batch_per_gpu=True,
        dataset=dataset,
        qos=qos,
        max_gpus=max_gpus,
    )


def cluster(
    free: Mapping[str, int],
    *,
    gpus: int = 4,
    now: float = 0.0,
    running: tuple[JobState, ...] = (),
    waiting: tuple[JobState, ...] = (),
    datasets: Mapping[str, Dataset] | None = None,
) -> ClusterState:
    nodes = {name: Node(name, gpus, count, cache_capacity=100) for name, count in free.items()}
    return ClusterState(now, nodes, dict(datasets or {}), running, waiting)
