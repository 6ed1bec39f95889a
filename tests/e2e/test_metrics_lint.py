"""Both /metrics endpoints pass Prometheus's own linter, ``promtool check metrics`` (Debian's
``prometheus`` package; scripts/setup.sh installs it): a real worker process (`cachefs up`,
scraped through its control socket after a read through the mount) and a real coordinator
process (`cachefs coordinator`, with a node, a dataset, a preload job and a job registered), so
that every family has series. No label may be ``job`` or ``instance``: Prometheus sets those on
every scraped series and renames a target's own (``exported_job``)."""

from __future__ import annotations

import os
import shutil
import subprocess

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster_process import TOKEN, CoordinatorProcess
from tests.worker_process import WorkerProcess

RESERVED_LABELS = {"job", "instance"}


def promtool_problems(text: str) -> str:
    """What ``promtool check metrics`` says about ``text`` ("" when it passes)."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (scripts/setup.sh does)"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=120
    )
    problems = (result.stdout + result.stderr).strip()
    assert (result.returncode == 0) == (problems == ""), (result.returncode, problems)
    return problems


def labels_of(text: str) -> set[str]:
    return {
        label
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        for label in sample.labels
    }


def test_promtool_finds_what_it_should() -> None:
    """The linter is really run: a family named like the coordinator's old one (a counter
    with a _count suffix) fails it."""
    old = (
        "# HELP cachefs_preload_failed_count Preload job failed_count\n"
        "# TYPE cachefs_preload_failed_count gauge\n"
        'cachefs_preload_failed_count{dataset="d",job="d-1",state="running"} 0.0\n'
    )
    assert 'should not have "_count" suffix' in promtool_problems(old)


def test_the_coordinators_metrics_pass_promtool(tmp_path) -> None:
    coordinator = CoordinatorProcess(str(tmp_path), extra_args=("--down-after", "1h")).start()
    try:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=coordinator.url, headers=auth, timeout=30) as admin:
            beat = {
                "address": "127.0.0.2:7070",
                "gpus": 8,
                "tiers": [{"name": "ram", "capacity": 1 << 30, "used": 1 << 20}],
            }
            assert admin.post("/v1/nodes/n1/heartbeat", json=beat).status_code == 200
            for name in ("imagenet", "coco"):
                dataset = {"name": name, "uri": f"s3://bucket/{name}/"}
                assert admin.post("/v1/datasets", json=dataset).status_code == 201
                started = admin.post(f"/v1/datasets/{name}/preload", json={})
                assert started.status_code == 201, started.text
            assert admin.post("/v1/datasets/coco/preload/cancel").status_code == 200
            job = {"id": "train-1", "dataset": "imagenet"}
            assert admin.post("/v1/jobs", json=job).status_code == 201
            text = httpx.get(f"{coordinator.url}/metrics", timeout=30).text
    finally:
        coordinator.stop()
    assert promtool_problems(text) == "", text
    assert not labels_of(text) & RESERVED_LABELS
    families = {family.name: family for family in text_string_to_metric_families(text)}
    for name in (
        "cachefs_node_up",
        "cachefs_preload_jobs",
        "cachefs_preload_bytes_done",
        "cachefs_preload_failed_objects",
        "cachefs_cache_used_ratio",
        "cachefs_jobs",
    ):
        assert families[name].samples, name
    states = {
        (s.labels["dataset"], s.labels["state"]): s.value
        for s in families["cachefs_preload_jobs"].samples
    }
    assert states[("imagenet", "running")] == 1 and states[("coco", "cancelled")] == 1


def test_the_workers_metrics_pass_promtool(tmp_path) -> None:
    source = tmp_path / "source"
    (source / "train").mkdir(parents=True)
    data = os.urandom(3 << 20)
    (source / "train" / "a.bin").write_bytes(data)
    worker = WorkerProcess(str(tmp_path / "worker")).start()
    try:
        worker.add_dataset("ds", f"file://{source}")
        with open(worker.path("ds", "train", "a.bin"), "rb") as f:
            assert f.read() == data
        with pytest.raises(FileNotFoundError):  # an error reply, for the errno family
            os.stat(worker.path("ds", "missing"))
        text = worker.client.metrics()  # /metrics on the control socket
    finally:
        worker.cleanup()
    assert promtool_problems(text) == "", text
    assert not labels_of(text) & RESERVED_LABELS
    families = {family.name: family for family in text_string_to_metric_families(text)}
    served = sum(s.value for s in families["cachefs_bytes_served"].samples)
    assert served >= len(data)
    assert families["cachefs_fuse_op_seconds"].samples  # a histogram with observations
