"""Converters of the public cluster traces (Philly, Alibaba PAI 2020, Helios) and the trace
command, on small samples written here in each documented layout (no real trace is
downloaded): arrivals, GPUs, durations and skip counts against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.__main__ import main
from bench.sim.cluster import SimulationError
from bench.sim.real_traces import (
    DEFAULT_POLICIES,
    SKIP_DUPLICATE,
    SKIP_NO_GPUS,
    SKIP_NO_SUBMIT,
    SKIP_NO_TASKS,
    SKIP_NO_TIMES,
    SKIP_NON_POSITIVE,
    SKIP_TOO_LARGE,
    Conversion,
    detect_format,
    model_for,
    peak_gpus,
    read_helios,
    read_pai,
    read_philly,
    read_trace,
    to_trace,
)
from bench.sim.traces import dump_csv, p2_workload
from bench.sim.truth import CATALOGUE, profiles
from coordinator.scheduling.perf import packed_shape

PROFILES = profiles(0)


def _attempt(start: str | None, end: str | None, *gpus_per_server: int) -> dict[str, object]:
    return {
        "start_time": start,
        "end_time": end,
        "detail": [
            {"ip": f"m{i}", "gpus": [f"gpu{g}" for g in range(count)]}
            for i, count in enumerate(gpus_per_server)
        ],
    }


def _philly_job(jobid: str, submitted: str | None, *attempts: dict[str, object]) -> dict:
    return {
        "status": "Pass",
        "vc": "ee9e8c",
        "jobid": jobid,
        "attempts": list(attempts),
        "submitted_time": submitted,
        "user": "ce2f4c",
    }


def _at(clock: str | None) -> str | None:
    """A Philly time on 2017-10-07 (the README's example day); None and "None" stay."""
    return clock if clock in (None, "None") else f"2017-10-07 {clock}"


def write_philly(directory: Path) -> Path:
    """A cluster_job_log: three usable jobs and one job per skip reason."""
    jobs = [
        # 0 GPUs (no detail), submitted before every kept job: arrivals must not count it
        _philly_job("app_0", _at("01:00:00"), _attempt(_at("01:00:10"), _at("01:05:00"))),
        # two attempts: the last one counts (4 + 4 GPUs on two servers, 2 h)
        _philly_job(
            "app_1",
            _at("01:11:39"),
            _attempt(_at("01:12:09"), _at("01:13:23"), 8),
            _attempt(_at("01:13:30"), _at("03:13:30"), 4, 4),
        ),
        _philly_job("app_2", _at("01:21:39"), _attempt(_at("01:22:39"), _at("01:52:39"), 1)),
        {
            **_philly_job("app_3", _at("01:31:39"), _attempt(_at("01:41:39"), _at("01:51:39"), 2)),
            "status": "Killed",
        },
        _philly_job("app_4", _at("01:40:00")),  # no attempts
        # still running: no end time of the last attempt ("None" as the README writes it)
        _philly_job("app_5", _at("01:45:00"), _attempt(_at("01:46:00"), "None", 1)),
        _philly_job("app_6", _at("01:50:00"), _attempt(_at("01:51:00"), _at("01:51:00"), 1)),
        _philly_job("app_2", _at("01:55:00"), _attempt(_at("01:56:00"), _at("02:56:00"), 1)),
        _philly_job("app_7", None, _attempt(_at("01:56:00"), _at("02:56:00"), 1)),
    ]
    path = directory / "cluster_job_log"
    path.write_text(json.dumps(jobs, indent=4))
    return path


def write_pai(directory: Path, *, header: bool = False) -> tuple[Path, Path]:
    """pai_job_table.csv and pai_task_table.csv, header-less as published."""
    jobs = [
        "j1,i1,u1,Terminated,1000.0,5000.0",
        "j2,i2,u2,Terminated,1600.0,9000.0",
        "j3,i3,u1,Failed,2000.0,3000.0",
        "jcpu,i4,u3,Terminated,2100.0,2500.0",
        "jrun,i5,u3,Running,2200.0,",
        "jzero,i6,u2,Terminated,2300.0,6000.0",
        "jnotask,i7,u1,Waiting,2400.0,",
        "jnosubmit,i8,u1,Terminated,,6000.0",
        "j1,i1,u1,Terminated,1000.0,5000.0",
    ]
    tasks = [
        # j1: 2 workers of 1 GPU + a CPU-only ps; span 1050..4200
        "j1,worker,2.0,Terminated,1100.0,4100.0,600.0,29.296875,100.0,V100",
        "j1,ps,1.0,Terminated,1050.0,4200.0,400.0,10.0,,",
        # j2: 0.5 + 3 x 0.5 = 2 GPUs; span 1700..2700
        "j2,tensorflow,1.0,Terminated,1700.0,2300.0,600.0,29.296875,50.0,MISC",
        "j2,evaluator,3.0,Terminated,1800.0,2700.0,100.0,5.0,50.0,T4",
        # j3: 3 x 33.3 % = 0.999 of a GPU, rounded up to 1; span 300 s
        "j3,worker,3.0,Failed,2100.0,2400.0,100.0,5.0,33.3,P100",
        "jcpu,worker,1.0,Terminated,2150.0,2450.0,800.0,20.0,,",
        "jrun,worker,1.0,Running,2250.0,,600.0,20.0,100.0,V100",
        "jzero,worker,1.0,Terminated,6000.0,6000.0,600.0,20.0,100.0,V100",
        "jnosubmit,worker,1.0,Terminated,5000.0,5900.0,600.0,20.0,100.0,V100",
        "jghost,worker,1.0,Terminated,100.0,200.0,600.0,20.0,100.0,V100",
    ]
    if header:
        jobs.insert(0, "job_name,inst_id,user,status,start_time,end_time")
        tasks.insert(
            0,
            "job_name,task_name,inst_num,status,start_time,end_time,"
            "plan_cpu,plan_mem,plan_gpu,gpu_type",
        )
    job_path, task_path = directory / "pai_job_table.csv", directory / "pai_task_table.csv"
    job_path.write_text("\n".join(jobs) + "\n")
    task_path.write_text("\n".join(tasks) + "\n")
    return job_path, task_path


HELIOS_HEADER = (
    "job_id,user,vc,gpu_num,cpu_num,node_num,state,submit_time,start_time,end_time,duration,queue"
)


def write_helios(directory: Path) -> Path:
    """A cluster_log.csv with the README's header and its first two example rows."""
    day, next_day = "2020-06-09", "2020-06-10"
    rows = [
        HELIOS_HEADER,
        f"1425511,uXBbc,vcJkd,1,1,1,COMPLETED,{day} 18:41:01,{day} 18:41:01,"
        f"{next_day} 04:55:09,36848,0",
        f"1425512,uVMrF,vchbv,4,16,1,FAILED,{day} 18:41:27,{day} 18:41:27,{day} 18:45:36,249,0",
        f"1425513,uzqls,vcpDC,16,64,2,COMPLETED,{day} 18:50:00,{day} 19:00:00,{day} 20:00:00,"
        "3600,600",
        # a CPU job; cancelled before it started; a zero-length run; a repeated id; no submit
        f"1425514,uzqls,vcpDC,0,8,1,COMPLETED,{day} 18:30:00,{day} 18:30:00,{day} 19:30:00,3600,0",
        f"1425515,uzqls,vcpDC,2,8,1,CANCELLED,{day} 18:55:00,,{day} 19:30:00,0,0",
        f"1425516,uzqls,vcpDC,1,8,1,FAILED,{day} 18:56:00,{day} 18:57:00,{day} 18:57:00,0,60",
        f"1425513,uzqls,vcpDC,1,8,1,COMPLETED,{day} 18:58:00,{day} 18:58:00,{day} 18:59:00,60,0",
        f"1425517,uzqls,vcpDC,1,8,1,COMPLETED,,{day} 18:58:00,{day} 18:59:00,60,0",
    ]
    path = directory / "cluster_log.csv"
    path.write_text("\n".join(rows) + "\n")
    return path


def _shape(conversion: Conversion) -> list[tuple[str, float, int, float]]:
    """(id, arrival relative to the first kept job, GPUs, duration) of each kept job."""
    first = conversion.jobs[0].submit
    return [(j.job_id, j.submit - first, j.gpus, j.duration) for j in conversion.jobs]


def test_philly_conversion(tmp_path: Path) -> None:
    conversion = read_philly(write_philly(tmp_path))
    assert _shape(conversion) == [
        ("app_1", 0.0, 8, 7200.0),
        ("app_2", 600.0, 1, 1800.0),
        ("app_3", 1200.0, 2, 600.0),
    ]
    assert conversion.total == 9
    assert conversion.skipped == {
        SKIP_NO_GPUS: 1,
        SKIP_NO_TIMES: 2,
        SKIP_NON_POSITIVE: 1,
        SKIP_DUPLICATE: 1,
        SKIP_NO_SUBMIT: 1,
    }
    # the last attempt's run: 01:13:30-03:13:30 on 8 GPUs overlaps app_2 and app_3
    assert peak_gpus(conversion.jobs) == 11


def test_pai_conversion(tmp_path: Path) -> None:
    conversion = read_pai(*write_pai(tmp_path))
    assert _shape(conversion) == [
        ("j1", 0.0, 2, 3150.0),
        ("j2", 600.0, 2, 1000.0),
        ("j3", 1000.0, 1, 300.0),
    ]
    assert conversion.total == 9
    assert conversion.skipped == {
        SKIP_NO_GPUS: 1,
        SKIP_NO_TIMES: 1,
        SKIP_NON_POSITIVE: 1,
        SKIP_NO_TASKS: 1,
        SKIP_NO_SUBMIT: 1,
        SKIP_DUPLICATE: 1,
    }
    assert conversion.notes == ["1 task row(s) name a job that is not in the job table"]
    # a header line on top (the published .header prepended) changes nothing
    (tmp_path / "with-header").mkdir()
    again = read_pai(*write_pai(tmp_path / "with-header", header=True))
    assert _shape(again) == _shape(conversion) and again.skipped == conversion.skipped


def test_helios_conversion(tmp_path: Path) -> None:
    conversion = read_helios(write_helios(tmp_path))
    assert _shape(conversion) == [
        ("1425511", 0.0, 1, 36848.0),
        ("1425512", 26.0, 4, 249.0),
        ("1425513", 539.0, 16, 3600.0),
    ]
    assert conversion.total == 8
    assert conversion.skipped == {
        SKIP_NO_GPUS: 1,
        SKIP_NO_TIMES: 1,
        SKIP_NON_POSITIVE: 1,
        SKIP_DUPLICATE: 1,
        SKIP_NO_SUBMIT: 1,
    }
    assert peak_gpus(conversion.jobs) == 17


def test_detection_by_content(tmp_path: Path) -> None:
    philly = write_philly(tmp_path)
    jobs, tasks = write_pai(tmp_path)
    helios = write_helios(tmp_path)
    ours = tmp_path / "ours.csv"
    dump_csv(p2_workload(0, PROFILES, jobs=2).jobs, ours)
    # names say nothing: detection reads the content
    for source, kind in ((philly, "philly"), (jobs, "pai"), (helios, "helios"), (ours, "csv")):
        renamed = tmp_path / f"renamed-{kind}.data"
        renamed.write_bytes(source.read_bytes())
        assert detect_format(renamed) == kind
    assert detect_format(tasks) == "pai"
    assert detect_format(tmp_path) == "philly"  # a directory: by the file names it holds
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(SimulationError, match="give --format"):
        detect_format(odd)


def test_pai_tables_are_found_from_either_one(tmp_path: Path) -> None:
    jobs, tasks = write_pai(tmp_path)
    expected = _shape(read_pai(jobs, tasks))
    for given in (jobs, tasks, tmp_path):
        assert _shape(read_trace(given, "pai")) == expected
    lonely = tmp_path / "alone"
    lonely.mkdir()
    (lonely / "pai_job_table.csv").write_bytes(jobs.read_bytes())
    with pytest.raises(SimulationError, match="no task table"):
        read_trace(lonely / "pai_job_table.csv")


def test_jobs_take_their_traced_duration_on_their_traced_gpus(tmp_path: Path) -> None:
    conversion = read_helios(write_helios(tmp_path))
    trace = to_trace(conversion, PROFILES, gpus_per_node=8, seed=3)
    assert [job.arrival for job in trace.jobs] == [0.0, 26.0, 539.0]
    for job, traced in zip(trace.jobs, conversion.jobs, strict=True):
        assert job.profile.name == model_for(traced.job_id, 3)
        rate = CATALOGUE[job.profile.name].rate(job, packed_shape(job.gpus, 8))
        assert job.samples / rate == pytest.approx(traced.duration)
        assert job.gpus == traced.gpus and job.dataset is None
    # deterministic, spread over the catalogue, and changed by the seed
    assert model_for("x", 0) == model_for("x", 0)
    assert len({model_for(str(i)) for i in range(200)}) == len(CATALOGUE)
    assert [model_for(str(i), 0) for i in range(20)] != [model_for(str(i), 1) for i in range(20)]


def test_malformed_input_names_the_place(tmp_path: Path) -> None:
    bad = tmp_path / "cluster_log.csv"
    bad.write_text(
        "job_id,gpu_num,submit_time,start_time,end_time\n1,1,yesterday,2020-06-09 18:41:01,\n"
    )
    with pytest.raises(SimulationError, match=r":2: submit_time='yesterday'"):
        read_helios(bad)
    jobs, tasks = write_pai(tmp_path)
    tasks.write_text("j1,worker,two,Terminated,1.0,2.0,1,1,100,V100\n")
    with pytest.raises(SimulationError, match=r"pai_task_table.csv:1: inst_num='two'"):
        read_pai(jobs, tasks)
    tasks.write_text("j1,worker,1\n")
    with pytest.raises(SimulationError, match="3 fields; this table has 10"):
        read_pai(jobs, tasks)


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[str, dict]:
    out_dir = Path(args[args.index("--out") + 1])
    assert main(args) == 0
    printed = capsys.readouterr().out
    data = json.loads(next(out_dir.glob("trace_*.json")).read_text())
    return printed, data


@pytest.mark.parametrize("kind", ["philly", "pai", "helios"])
def test_trace_command_runs_every_policy(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sample = {"philly": write_philly, "pai": lambda d: write_pai(d)[0], "helios": write_helios}
    path = sample[kind](tmp_path)
    printed, data = _run(["trace", str(path), "--out", str(tmp_path / "out")], capsys)
    for name in ("as traced", *DEFAULT_POLICIES):
        assert f"| {name} | 3 |" in printed
    assert "| jobs simulated | 3 |" in printed
    assert f"| format | {kind} |" in printed
    assert f"| skipped: {SKIP_NON_POSITIVE} | 1 |" in printed
    assert data["jobs_simulated"] == 3
    assert data["jobs_in_file"] == {"philly": 9, "pai": 9, "helios": 8}[kind]
    assert {name: row["jobs"] for name, row in data["policies"].items()} == dict.fromkeys(
        DEFAULT_POLICIES, 3
    )
    assert sum(data["skipped"].values()) == data["jobs_in_file"] - 3
    # sized from the trace: Philly held 11 GPUs at once, PAI 5, Helios 17
    assert data["cluster"]["nodes"] == {"philly": 2, "pai": 1, "helios": 3}[kind]


def test_trace_command_limit_nodes_and_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    helios = write_helios(tmp_path)
    printed, data = _run(
        ["trace", str(helios), "--limit", "2", "--policies", "fifo", "--out", str(tmp_path / "a")],
        capsys,
    )
    assert data["jobs_simulated"] == 2 and list(data["policies"]) == ["fifo"]
    assert "first 2 of 3 converted jobs by submission" in printed
    # a cluster smaller than the 16-GPU job: it is skipped and counted, not dropped silently
    _, data = _run(
        [
            "trace",
            str(helios),
            "--nodes",
            "1",
            "--policies",
            "fifo,tiresias-las",
            "--out",
            str(tmp_path / "b"),
        ],
        capsys,
    )
    assert data["jobs_simulated"] == 2 and data["skipped"][SKIP_TOO_LARGE] == 1
    ours = tmp_path / "ours.csv"
    dump_csv(p2_workload(0, PROFILES, jobs=3).jobs, ours)
    printed, data = _run(
        ["trace", str(ours), "--policies", "fifo,p2-elastic", "--out", str(tmp_path / "c")], capsys
    )
    assert data["format"] == "csv" and data["jobs_simulated"] == 3
    assert "as traced" not in printed


def test_trace_command_reports_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    helios = write_helios(tmp_path)
    assert main(["trace", str(helios), "--policies", "fifo,nonsense"]) == 1
    assert "unknown or no policies ['nonsense']" in capsys.readouterr().err
    assert main(["trace", str(tmp_path / "missing.json")]) == 1
    empty = tmp_path / "empty" / "cluster_job_log"
    empty.parent.mkdir()
    empty.write_text("[]")
    assert main(["trace", str(empty)]) == 1
    assert "no job left to simulate" in capsys.readouterr().err
