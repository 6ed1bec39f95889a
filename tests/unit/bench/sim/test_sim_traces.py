"""Workload generators and the CSV trace format."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from bench.sim.__main__ import main
from bench.sim.cluster import DatasetSpec, SimulationError
from bench.sim.traces import (
    GANDIVA_CLASSES,
    dump_csv,
    gandiva_duration,
    load_csv,
    p2_workload,
    p3_workload,
    p5_workload,
    poisson_arrivals,
)
from bench.sim.truth import profiles
from coordinator.scheduling.model import QosClass

PROFILES = profiles(0)
MINUTE = 60.0


def test_gandiva_durations_follow_the_papers_classes() -> None:
    rng = random.Random(5)
    durations = [gandiva_duration(rng) for _ in range(20_000)]

    def share(limit: float) -> float:
        return sum(d < limit for d in durations) / len(durations)

    assert share(10 * MINUTE) == pytest.approx(0.30, abs=0.02)
    assert share(100 * MINUTE) == pytest.approx(0.62, abs=0.02)
    assert share(1000 * MINUTE) == pytest.approx(0.82, abs=0.02)
    assert max(durations) <= GANDIVA_CLASSES[-1][2]


def test_poisson_gaps_have_the_asked_mean() -> None:
    times = poisson_arrivals(random.Random(2), 5000, 900.0)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert sum(gaps) / len(gaps) == pytest.approx(900.0, rel=0.05)


def test_p3_workload_mix_and_p2_p5_shapes() -> None:
    trace = p3_workload(1, PROFILES, per_hour=20.0, hours=24.0)
    counts = Counter(job.qos for job in trace.jobs)
    total = len(trace.jobs)
    assert total == pytest.approx(480, rel=0.15)
    assert counts[QosClass.URGENT] / total == pytest.approx(0.05, abs=0.03)
    assert counts[QosClass.PRIOR] / total == pytest.approx(0.35, abs=0.06)
    assert {job.profile.name for job in trace.jobs} <= {
        "alexnet",
        "googlenet",
        "resnet50",
        "inception3",
        "lstm",
        "seq2seq",
    }
    assert len(p2_workload(1, PROFILES).jobs) == 20
    assert all(job.gpus in (1, 2, 4, 8, 16) for job in p5_workload(1, PROFILES).jobs)
    assert (
        p3_workload(1, PROFILES, per_hour=5.0).jobs == p3_workload(1, PROFILES, per_hour=5.0).jobs
    )


def test_csv_round_trip(tmp_path: Path) -> None:
    datasets = {"imagenet": DatasetSpec("imagenet", 144 * 10**9, 1_281_167)}
    trace = p3_workload(2, PROFILES, per_hour=5.0, hours=2.0)
    path = tmp_path / "trace.csv"
    dump_csv(trace.jobs, path)
    loaded = load_csv(path, PROFILES, datasets)
    assert len(loaded.jobs) == len(trace.jobs)
    for original, back in zip(trace.jobs, loaded.jobs, strict=True):
        assert back.samples == pytest.approx(original.samples)
        assert (back.job_id, back.gpus, back.qos, back.max_gpus, back.profile) == (
            original.job_id,
            original.gpus,
            original.qos,
            original.max_gpus,
            original.profile,
        )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("job_id,arrival_s,gpus,model\n", "lacks required column"),
        ("job_id,arrival_s,gpus,model,epochs,colour\n", "unknown column"),
        ("job_id,arrival_s,gpus,model,epochs\nj,0,1,bert,1\n", ":2: unknown model 'bert'"),
        (
            "job_id,arrival_s,gpus,model,epochs,samples_per_epoch\nj,soon,1,resnet50,1,10\n",
            "'arrival_s'='soon' is not a float",
        ),
        (
            "job_id,arrival_s,gpus,model,epochs,dataset\nj,0,1,resnet50,1,coco\n",
            "unknown dataset 'coco'",
        ),
        ("job_id,arrival_s,gpus,model,epochs\nj,0,0,resnet50,1\n", "column 'samples_per_epoch'"),
        (
            "job_id,arrival_s,gpus,model,epochs,samples_per_epoch\nj,0,0,resnet50,1,10\n",
            "gpus=0",
        ),
        (
            "job_id,arrival_s,gpus,model,epochs,samples_per_epoch\n"
            "j,0,1,resnet50,1,10\nj,0,1,resnet50,1,10\n",
            "not unique",
        ),
    ],
)
def test_csv_errors_name_the_line_and_column(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(SimulationError, match=message):
        load_csv(path, PROFILES)


def test_cli_writes_a_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The report states what this run computed: P1's overall gains per scale, and the verdict
    against the paper's 2.2x–3.7x worked out here from the JSON's speeds, not copied."""
    assert main(["p1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "p1_tdcs.md").read_text()
    data = json.loads((tmp_path / "p1_tdcs.json").read_text())
    scales = sorted((key for key in data if key.isdigit()), key=int)  # the JSON sorts keys
    assert scales == ["8", "32", "64", "128"]
    overall = [data[g]["config4_samples_per_s"] / data[g]["config1_samples_per_s"] for g in scales]
    # The cache must pay at every scale; a broken model that reads nothing faster fails here.
    assert all(ratio > 1.5 for ratio in overall), overall
    assert data["overall_range"] == pytest.approx([min(overall), max(overall)])
    low, high = data["paper"]["overall"]
    inside = sum(low <= ratio <= high for ratio in overall)
    expected = f"inside (all {len(overall)})" if inside == len(overall) else "outside ("
    row = next(line for line in report.splitlines() if line.startswith("| config 4 over 1 |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[2] == ", ".join(f"{ratio:.2f}x" for ratio in overall)
    assert cells[3].startswith(expected), cells
    assert data["verdicts"]["overall"] == cells[3]
    word = "inside" if inside == len(overall) else "outside"
    assert f"{min(overall):.2f}x to {max(overall):.2f}x, is {word} the paper's" in report
    assert "p1: wrote" in capsys.readouterr().out
