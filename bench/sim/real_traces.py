"""Converters from public GPU-cluster traces to the simulator's jobs.

Three published formats, each read exactly as its public documentation describes it. The
formats were written from that documentation (the repositories' READMEs, their ``.header``
files and their analysis scripts); no real trace file could be downloaded here, so the tests
run on small samples written in the documented layout.

**Microsoft Philly** (msr-fiddle/philly-traces, ``trace-data/cluster_job_log``): one JSON list
of jobs. Used keys: ``jobid``, ``submitted_time`` and ``attempts``, a list of
``{"start_time", "end_time", "detail": [{"ip", "gpus": [...]}]}``. Times are
``"%Y-%m-%d %H:%M:%S"`` strings without a time zone; ``null``, ``""`` or ``"None"`` means not
recorded (the README: attempts may lack either time; a last attempt without ``end_time`` was
still running). The run is the **last** attempt: GPUs = the sum of ``len(gpus)`` over its
``detail``, duration = its ``end_time - start_time`` (the trace's own notebook counts the
first attempt's GPUs and the time from the first start to the last end; we take the last
attempt, the run that ended the job). ``status``, ``vc``, ``user`` and ``ip`` are not used.
The times are naive local times, so a duration across a daylight-saving change is off by an
hour.

**Alibaba PAI 2020** (alibaba/clusterdata ``cluster-trace-gpu-v2020``): two header-less CSV
files (their headers ship separately as ``*.header``; a header line at the top is skipped).
``pai_job_table.csv``: ``job_name,inst_id,user,status,start_time,end_time``; used:
``job_name`` (the id; tasks join on it) and ``start_time``, which the README defines as the
job's *submission* time. ``pai_task_table.csv``: ``job_name,task_name,inst_num,status,
start_time,end_time,plan_cpu,plan_mem,plan_gpu,gpu_type``; used: ``job_name``, ``inst_num``,
``start_time``, ``end_time`` (task launch and completion) and ``plan_gpu`` (percent of one GPU:
100 = one GPU, 50 = half). Times are seconds (shifted by a constant); an empty field, ``nan``
or ``0`` means not recorded (the trace's own ``utils.py`` treats ``start_time == 0`` as
missing); an empty ``plan_gpu`` (CPU tasks) or ``inst_num`` is 0. GPUs = ``ceil(sum over
the job's tasks of inst_num * plan_gpu / 100)``; the run spans the earliest task start to the
latest task end (tasks without both times are left out of the span). Task rows whose job is
not in the job table are counted and ignored.

**SenseTime Helios** (S-Lab-System-Group/HeliosData, ``data/<cluster>/cluster_log.csv``): a
CSV with a header, documented as ``job_id,user,vc,gpu_num,cpu_num,node_num,state,
submit_time,start_time,end_time,duration,queue``. Columns are found by name; used:
``job_id`` (optional: the row number otherwise), ``gpu_num``, ``submit_time``, ``start_time``
and ``end_time`` (``"%Y-%m-%d %H:%M:%S"``, empty / ``None`` / ``NaT`` / ``nan`` = missing).
Duration = ``end_time - start_time`` (the ``duration`` column is documented as the same
difference and is not read).

**Every format.** A job's arrival is its submission time minus the first simulated job's
submission time. Every job of the trace is kept whatever its final status (failed and killed
jobs held their GPUs too), except, counted per reason and reported, never dropped silently,
under the first reason that applies in this order: a repeated job id (the first one is kept),
no submission time, (PAI) no task rows, no start or end time of the run, 0 GPUs, a
non-positive duration (and, in :func:`run_trace`, more GPUs than a cluster given with ``nodes``).
Traces carry no model: each job gets one from the simulator's catalogue,
picked by a seeded hash of its id (the same job gets the same model whatever ``limit`` is). Its
work is what its model does at its true speed on its traced GPUs, packed, in its traced
duration (:func:`.traces.job_lasting`), with 50,000 samples per epoch and a batch of 256 per
GPU; no dataset (no data I/O).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from coordinator.scheduling import POLICY_NAMES, make_policy
from coordinator.scheduling.model import JobSpec, ModelProfile

from .cluster import SimulationError, Trace, uniform_cluster
from .engine import Simulator
from .report import Report
from .traces import CSV_REQUIRED, job_lasting, load_csv
from .truth import CATALOGUE, profiles

FORMATS = ("philly", "pai", "helios", "csv")
TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
#: samples per epoch of every converted job (the trace gives none; only epoch ends matter).
SAMPLES_PER_EPOCH = 50_000

SKIP_DUPLICATE = "repeated job id"
SKIP_NO_SUBMIT = "no submission time"
SKIP_NO_TASKS = "no task rows"
SKIP_NO_TIMES = "no start or end time"
SKIP_NO_GPUS = "0 GPUs"
SKIP_NON_POSITIVE = "non-positive duration"
SKIP_TOO_LARGE = "more GPUs than the cluster"
SKIP_REASONS = (
    SKIP_DUPLICATE,
    SKIP_NO_SUBMIT,
    SKIP_NO_TASKS,
    SKIP_NO_TIMES,
    SKIP_NO_GPUS,
    SKIP_NON_POSITIVE,
    SKIP_TOO_LARGE,
)

PAI_JOB_COLUMNS = ("job_name", "inst_id", "user", "status", "start_time", "end_time")
PAI_TASK_COLUMNS = (
    "job_name",
    "task_name",
    "inst_num",
    "status",
    "start_time",
    "end_time",
    "plan_cpu",
    "plan_mem",
    "plan_gpu",
    "gpu_type",
)
#: the policies that take a plain queue of jobs (no datasets, no hardware facts): P2's, P3's
#: and P5's comparisons. p4-roofline needs node FLOPs and bandwidths, tdcs needs datasets.
DEFAULT_POLICIES = (
    "fifo",
    "p2-earliest-finish",
    "p2-elastic",
    "p3-qos",
    "capacity",
    "weighted-fair",
    "min-min",
    "tetris+perf",
    "tetris+cer",
    "p5-themis",
    "tiresias-las",
)
HELIOS_REQUIRED = ("gpu_num", "submit_time", "start_time", "end_time")
PHILLY_NAME = "cluster_job_log"
PAI_JOB_NAME = "pai_job_table.csv"
PAI_TASK_NAME = "pai_task_table.csv"
HELIOS_NAME = "cluster_log.csv"
_MISSING = {"", "none", "null", "nan", "nat"}


@dataclass(frozen=True)
class TracedJob:
    """One job as the trace ran it; times in seconds on the trace's own clock."""

    job_id: str
    submit: float
    start: float
    end: float
    gpus: int

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Conversion:
    """What a converter read: the jobs kept (in submission order) and why others were not."""

    format: str
    source: str
    #: jobs in the file (kept + skipped).
    total: int = 0
    jobs: list[TracedJob] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def keep(self, job: TracedJob) -> None:
        self.jobs.append(job)

    def skip(self, reason: str) -> None:
        self.skipped[reason] += 1

    def finish(self) -> Conversion:
        self.jobs.sort(key=lambda job: job.submit)  # stable: ties keep the file's order
        return self

    def first(self, limit: int | None) -> Conversion:
        """The first ``limit`` kept jobs by submission (all when None); counts stay."""
        if limit is not None and limit < 1:
            raise SimulationError(f"limit={limit}: need at least 1 job")
        if limit is None or limit >= len(self.jobs):
            return self
        return Conversion(
            self.format,
            self.source,
            self.total,
            self.jobs[:limit],
            Counter(self.skipped),
            [*self.notes, f"first {limit} of {len(self.jobs)} converted jobs by submission"],
        )


# --- Philly -----------------------------------------------------------------------------------


def read_philly(path: Path | str) -> Conversion:
    """Microsoft Philly ``cluster_job_log`` (a JSON list of jobs)."""
    try:
        with open(path) as handle:
            records = json.load(handle)
    except json.JSONDecodeError as err:
        raise SimulationError(f"{path}: not JSON ({err})") from None
    if not isinstance(records, list):
        raise SimulationError(f"{path}: a Philly cluster_job_log is a JSON list of jobs")
    out = Conversion("philly", str(path), total=len(records))
    seen: set[str] = set()
    for index, record in enumerate(records):
        where = f"{path}: job #{index}"
        if not isinstance(record, dict) or "jobid" not in record or "attempts" not in record:
            raise SimulationError(f"{where}: not a Philly job (needs 'jobid' and 'attempts')")
        job_id = str(record["jobid"])
        if job_id in seen:
            out.skip(SKIP_DUPLICATE)
            continue
        seen.add(job_id)
        submit = _stamp(record.get("submitted_time"), where, "submitted_time")
        attempts = record["attempts"] or []
        if not isinstance(attempts, list):
            raise SimulationError(f"{where}: 'attempts' is not a list")
        last = attempts[-1] if attempts else {}
        if not isinstance(last, dict):
            raise SimulationError(f"{where}: an attempt is not a JSON object")
        start = _stamp(last.get("start_time"), where, "start_time")
        end = _stamp(last.get("end_time"), where, "end_time")
        details = last.get("detail") or []
        if not isinstance(details, list) or not all(isinstance(d, dict) for d in details):
            raise SimulationError(f"{where}: an attempt's 'detail' is not a list of objects")
        gpus = sum(len(detail.get("gpus") or ()) for detail in details)
        _check(out, job_id, submit, start, end, gpus)
    return out.finish()


# --- Alibaba PAI ------------------------------------------------------------------------------


def read_pai(job_table: Path | str, task_table: Path | str) -> Conversion:
    """Alibaba PAI 2020 ``pai_job_table.csv`` + ``pai_task_table.csv`` (header-less CSVs)."""
    # job_name -> [gpu fraction sum, earliest start, latest end, task rows]
    tasks: dict[str, list[float]] = {}
    for line, row in _headerless(task_table, PAI_TASK_COLUMNS):
        where = f"{task_table}:{line}"
        inst_num = _number(row[2], where, "inst_num") or 0.0
        plan_gpu = _number(row[8], where, "plan_gpu") or 0.0
        start = _number(row[4], where, "start_time") or None  # 0 = not recorded
        end = _number(row[5], where, "end_time") or None
        entry = tasks.setdefault(row[0], [0.0, math.inf, -math.inf, 0.0])
        entry[0] += inst_num * plan_gpu / 100.0
        entry[3] += 1
        if start is not None and end is not None:
            entry[1] = min(entry[1], start)
            entry[2] = max(entry[2], end)
    out = Conversion("pai", f"{job_table} + {task_table}")
    seen: set[str] = set()
    for line, row in _headerless(job_table, PAI_JOB_COLUMNS):
        out.total += 1
        job_id = row[0]
        if job_id in seen:
            out.skip(SKIP_DUPLICATE)
            continue
        seen.add(job_id)
        submit = _number(row[4], f"{job_table}:{line}", "start_time") or None
        if submit is None:
            out.skip(SKIP_NO_SUBMIT)
            continue
        entry = tasks.get(job_id)
        if entry is None:
            out.skip(SKIP_NO_TASKS)
            continue
        gpu_sum, start, end, _rows = entry
        gpus = math.ceil(gpu_sum - 1e-9) if gpu_sum > 1e-9 else 0
        _check(
            out,
            job_id,
            submit,
            None if start == math.inf else start,
            None if end == -math.inf else end,
            gpus,
        )
    orphans = sum(int(entry[3]) for name, entry in tasks.items() if name not in seen)
    if orphans:
        out.notes.append(f"{orphans} task row(s) name a job that is not in the job table")
    return out.finish()


def _headerless(path: Path | str, columns: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    """Rows of a header-less CSV with exactly ``len(columns)`` fields (a header line is skipped)."""
    with open(path, newline="") as handle:
        for line, row in enumerate(csv.reader(handle), start=1):
            if not row:
                continue
            if len(row) != len(columns):
                raise SimulationError(
                    f"{path}:{line}: {len(row)} fields; this table has {len(columns)} "
                    f"({','.join(columns)})"
                )
            if line == 1 and tuple(field.strip() for field in row) == tuple(columns):
                continue
            yield line, [field.strip() for field in row]


# --- Helios -----------------------------------------------------------------------------------


def read_helios(path: Path | str) -> Conversion:
    """SenseTime Helios ``cluster_log.csv`` (a CSV with a header)."""
    out = Conversion("helios", str(path))
    seen: set[str] = set()
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in HELIOS_REQUIRED if c not in (reader.fieldnames or [])]
        if missing:
            raise SimulationError(f"{path}: header lacks Helios column(s) {', '.join(missing)}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            cells = {name: (value or "").strip() for name, value in row.items() if name}
            out.total += 1
            job_id = cells.get("job_id") or f"line{reader.line_num}"
            if job_id in seen:
                out.skip(SKIP_DUPLICATE)
                continue
            seen.add(job_id)
            gpus = _number(cells["gpu_num"], where, "gpu_num") or 0.0
            if gpus != int(gpus) or gpus < 0:
                raise SimulationError(f"{where}: gpu_num={cells['gpu_num']!r} is not a GPU count")
            _check(
                out,
                job_id,
                _stamp(cells["submit_time"], where, "submit_time"),
                _stamp(cells["start_time"], where, "start_time"),
                _stamp(cells["end_time"], where, "end_time"),
                int(gpus),
            )
    return out.finish()


# --- shared -----------------------------------------------------------------------------------


def _check(
    out: Conversion,
    job_id: str,
    submit: float | None,
    start: float | None,
    end: float | None,
    gpus: int,
) -> None:
    """Keep the job, or count the first reason it cannot be simulated."""
    if submit is None:
        out.skip(SKIP_NO_SUBMIT)
    elif start is None or end is None:
        out.skip(SKIP_NO_TIMES)
    elif gpus <= 0:
        out.skip(SKIP_NO_GPUS)
    elif end - start <= 0:
        out.skip(SKIP_NON_POSITIVE)
    else:
        out.keep(TracedJob(job_id, submit, start, end, gpus))


def _stamp(value: object, where: str, name: str) -> float | None:
    """A ``%Y-%m-%d %H:%M:%S`` time as seconds (naive: only differences are used)."""
    if value is None or str(value).strip().lower() in _MISSING:
        return None
    text = str(value).strip()
    try:
        return (datetime.strptime(text, TIME_FORMAT) - datetime(1970, 1, 1)).total_seconds()
    except ValueError:
        raise SimulationError(f"{where}: {name}={text!r} is not {TIME_FORMAT}") from None


def _number(text: str, where: str, name: str) -> float | None:
    if text.strip().lower() in _MISSING:
        return None
    try:
        value = float(text)
    except ValueError:
        raise SimulationError(f"{where}: {name}={text!r} is not a number") from None
    return None if math.isnan(value) else value


# --- detection --------------------------------------------------------------------------------


def detect_format(path: Path | str) -> str:
    """``philly``, ``pai``, ``helios`` or ``csv`` (the simulator's own), from the content.

    A directory is recognised by the file names the traces ship with.
    """
    path = Path(path)
    if path.is_dir():
        for name, kind in ((PHILLY_NAME, "philly"), (PAI_JOB_NAME, "pai"), (HELIOS_NAME, "helios")):
            if (path / name).is_file():
                return kind
        raise SimulationError(
            f"{path}: a directory without {PHILLY_NAME}, {PAI_JOB_NAME} or {HELIOS_NAME}"
        )
    with open(path, newline="") as handle:
        head = handle.read(65536)
    text = head.lstrip()
    if text.startswith("["):
        return "philly"
    first = next(csv.reader([text.splitlines()[0] if text else ""]), [])
    names = {name.strip() for name in first}
    if set(HELIOS_REQUIRED) <= names:
        return "helios"
    if set(CSV_REQUIRED) <= names:
        return "csv"
    if len(first) in (len(PAI_JOB_COLUMNS), len(PAI_TASK_COLUMNS)):
        return "pai"
    raise SimulationError(
        f"{path}: not a Philly cluster_job_log (JSON list), a PAI job or task table "
        f"(header-less, {len(PAI_JOB_COLUMNS)} or {len(PAI_TASK_COLUMNS)} fields), a Helios "
        "cluster_log.csv or the simulator's CSV; give --format"
    )


def pai_tables(path: Path | str, task_table: Path | str | None = None) -> tuple[Path, Path]:
    """(job table, task table) for a PAI directory, job table or task table."""
    path = Path(path)
    if path.is_dir():
        jobs, tasks = path / PAI_JOB_NAME, Path(task_table) if task_table else path / PAI_TASK_NAME
    elif _field_count(path) == len(PAI_TASK_COLUMNS):
        jobs, tasks = _sibling(path, "pai_task_table", "pai_job_table", PAI_JOB_NAME), path
    else:
        jobs = path
        tasks = (
            Path(task_table)
            if task_table
            else _sibling(path, "pai_job_table", "pai_task_table", PAI_TASK_NAME)
        )
    for role, table in (("job", jobs), ("task", tasks)):
        if not table.is_file():
            raise SimulationError(
                f"PAI needs both tables: no {role} table at {table} (give the job table as the "
                "file and the task table with --pai-tasks)"
            )
    return jobs, tasks


def _field_count(path: Path) -> int:
    with open(path, newline="") as handle:
        return len(next(csv.reader(handle), []))


def _sibling(path: Path, mine: str, theirs: str, default: str) -> Path:
    if mine in path.name:
        return path.with_name(path.name.replace(mine, theirs))
    return path.with_name(default)


def read_trace(
    path: Path | str, format: str = "auto", *, pai_tasks: Path | str | None = None
) -> Conversion:
    """Read a public trace (``format``: auto, philly, pai, helios)."""
    kind = detect_format(path) if format == "auto" else format
    path = Path(path)
    if kind == "philly":
        return read_philly(path / PHILLY_NAME if path.is_dir() else path)
    if kind == "pai":
        return read_pai(*pai_tables(path, pai_tasks))
    if kind == "helios":
        return read_helios(path / HELIOS_NAME if path.is_dir() else path)
    raise SimulationError(
        f"format {kind!r}: converters exist for philly, pai and helios "
        "(the simulator's own CSV is read by traces.load_csv)"
    )


# --- to the simulator -------------------------------------------------------------------------


def model_for(job_id: str, seed: int = 0, models: Sequence[str] | None = None) -> str:
    """The catalogue model a traced job gets: a seeded hash of its id (deterministic)."""
    names = sorted(models or CATALOGUE)
    return names[zlib.crc32(f"{seed}/{job_id}".encode()) % len(names)]


def to_trace(
    conversion: Conversion,
    profiles: Mapping[str, ModelProfile],
    *,
    gpus_per_node: int,
    seed: int = 0,
    models: Sequence[str] | None = None,
) -> Trace:
    """The simulator's jobs: arrival relative to the first job, each lasting its traced
    duration at its true speed on its traced GPUs packed on ``gpus_per_node``-GPU nodes."""
    if not conversion.jobs:
        return Trace(())
    first = conversion.jobs[0].submit
    specs: list[JobSpec] = [
        job_lasting(
            job.job_id,
            job.submit - first,
            job.duration,
            job.gpus,
            profiles[model_for(job.job_id, seed, models)],
            per_node=gpus_per_node,
            samples_per_epoch=SAMPLES_PER_EPOCH,
        )
        for job in conversion.jobs
    ]
    return Trace(tuple(specs))


def peak_gpus(jobs: Sequence[TracedJob]) -> int:
    """The most GPUs the traced jobs held at once in the trace (ends before starts at a tie)."""
    events = sorted(
        [(job.start, 1, job.gpus) for job in jobs] + [(job.end, 0, -job.gpus) for job in jobs]
    )
    held = peak = 0
    for _time, _order, change in events:
        held += change
        peak = max(peak, held)
    return peak


def drop_larger_than(conversion: Conversion, total_gpus: int) -> Conversion:
    """The conversion without jobs asking more than ``total_gpus``, counted as a skip."""
    kept = [job for job in conversion.jobs if job.gpus <= total_gpus]
    dropped = len(conversion.jobs) - len(kept)
    if not dropped:
        return conversion
    skipped = Counter(conversion.skipped)
    skipped[SKIP_TOO_LARGE] += dropped
    return Conversion(
        conversion.format, conversion.source, conversion.total, kept, skipped, conversion.notes
    )


# --- the trace command ------------------------------------------------------------------------

HOUR = 3600.0


def run_trace(
    path: Path | str,
    *,
    format: str = "auto",
    pai_tasks: Path | str | None = None,
    limit: int | None = None,
    gpus_per_node: int = 8,
    nodes: int | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    seed: int = 0,
) -> Report:
    """Convert a trace and run ``policies`` on it; a report of JCT, makespan, utilisation.

    Without ``nodes`` the cluster is sized from the trace: as many ``gpus_per_node``-GPU nodes
    as the most GPUs the simulated jobs held at once when they ran (enough for the largest job;
    for the simulator's CSV, which has no run times, just enough for the largest job).
    """
    path = Path(path)
    if gpus_per_node < 1 or (nodes is not None and nodes < 1):
        raise SimulationError("--gpus-per-node and --nodes must be at least 1")
    unknown = [name for name in policies if name not in POLICY_NAMES]
    if unknown or not policies:
        raise SimulationError(f"unknown or no policies {unknown}; known: {', '.join(POLICY_NAMES)}")
    kind = detect_format(path) if format == "auto" else format
    if kind not in FORMATS:
        raise SimulationError(f"format {kind!r} is not one of auto, {', '.join(FORMATS)}")
    fitted = profiles(seed)
    if kind == "csv":
        specs = sorted(load_csv(path, fitted).jobs, key=lambda job: job.arrival)
        conversion = Conversion("csv", str(path), total=len(specs))
        if limit is not None and limit < len(specs):
            if limit < 1:
                raise SimulationError(f"limit={limit}: need at least 1 job")
            conversion.notes.append(f"first {limit} of {len(specs)} jobs by arrival")
            specs = specs[:limit]
        largest = max((job.gpus for job in specs), default=1)
        node_count = nodes or math.ceil(largest / gpus_per_node)
        sizing = "given" if nodes else "enough for the largest job"
        total_gpus = node_count * gpus_per_node
        if any(job.gpus > total_gpus for job in specs):
            conversion.skipped[SKIP_TOO_LARGE] += sum(job.gpus > total_gpus for job in specs)
            specs = [job for job in specs if job.gpus <= total_gpus]
        traced: list[TracedJob] = []
    else:
        conversion = read_trace(path, kind, pai_tasks=pai_tasks).first(limit)
        if nodes is None:
            need = max([peak_gpus(conversion.jobs), *(job.gpus for job in conversion.jobs), 1])
            node_count = math.ceil(need / gpus_per_node)
            sizing = "the most GPUs the simulated jobs held at once in the trace"
        else:
            node_count, sizing = nodes, "given"
        conversion = drop_larger_than(conversion, node_count * gpus_per_node)
        traced = conversion.jobs
        specs = list(to_trace(conversion, fitted, gpus_per_node=gpus_per_node, seed=seed).jobs)
    if not specs:
        raise SimulationError(
            f"{path}: no job left to simulate ({conversion.total} in the file; skipped: "
            f"{_skips(conversion) or 'none'})"
        )
    cluster = uniform_cluster(node_count, gpus_per_node, cache_mode="none", seed=seed)
    total_gpus = node_count * gpus_per_node
    results = {}
    for name in policies:
        result = Simulator(cluster, Trace(tuple(specs)), make_policy(name, seed=seed)).run()
        jcts = [record.jct for record in result.jobs]
        results[name] = {
            "jobs": len(result.jobs),
            "mean_jct_s": statistics.fmean(jcts),
            "median_jct_s": statistics.median(jcts),
            "mean_wait_s": statistics.fmean(record.wait for record in result.jobs),
            "makespan_s": result.makespan,
            "gpu_utilisation": result.gpu_utilisation,
        }
    return _trace_report(
        path, conversion, traced, results, node_count, gpus_per_node, sizing, len(specs), seed
    )


def as_traced(jobs: Sequence[TracedJob], total_gpus: int) -> dict[str, float]:
    """The same metrics for the jobs as they ran in the trace (on the trace's own cluster)."""
    first = min(job.submit for job in jobs)
    makespan = max(job.end for job in jobs) - first
    jcts = [job.end - job.submit for job in jobs]
    return {
        "jobs": len(jobs),
        "mean_jct_s": statistics.fmean(jcts),
        "median_jct_s": statistics.median(jcts),
        "mean_wait_s": statistics.fmean(job.start - job.submit for job in jobs),
        "makespan_s": makespan,
        "gpu_utilisation": sum(job.gpus * job.duration for job in jobs) / (total_gpus * makespan),
    }


def _skips(conversion: Conversion) -> str:
    return ", ".join(
        f"{reason}: {conversion.skipped[reason]}"
        for reason in SKIP_REASONS
        if conversion.skipped[reason]
    )


def _trace_report(
    path: Path,
    conversion: Conversion,
    traced: list[TracedJob],
    results: dict[str, dict[str, float]],
    node_count: int,
    gpus_per_node: int,
    sizing: str,
    simulated: int,
    seed: int,
) -> Report:
    stem = "".join(c if c.isalnum() or c in "-_" else "_" for c in path.stem) or "trace"
    if conversion.format == "csv":
        setup = "The simulator's own CSV (`traces.load_csv`): jobs, models and work as given."
    else:
        setup = (
            "Converted by `bench/sim/real_traces.py` (formats, columns and assumptions: "
            'docs/scheduling.md, "Real traces"). Each job arrives at its submission time '
            "(relative to the first simulated job), asks its traced GPUs and carries the work "
            "its model does on them, packed, in its traced duration; models are assigned by a "
            f"seeded hash of the job id (seed {seed}), since traces name none."
        )
    report = Report(
        f"trace_{conversion.format}_{stem}",
        f"Placement policies on the {conversion.format} trace {path.name}",
        f"{setup} Policies see offline-fitted profiles (seed {seed}). No data I/O.",
    )
    total_gpus = node_count * gpus_per_node
    rows: list[list[object]] = [
        ["format", conversion.format],
        ["source", conversion.source],
        ["jobs in the file", conversion.total],
        ["jobs simulated", simulated],
    ]
    rows += [
        [f"skipped: {reason}", conversion.skipped[reason]]
        for reason in SKIP_REASONS
        if conversion.skipped[reason]
    ]
    rows += [["note", note] for note in conversion.notes]
    plural = "node" if node_count == 1 else "nodes"
    rows.append(["cluster", f"{node_count} {plural} x {gpus_per_node} GPUs ({sizing})"])
    report.table(["", ""], rows, "Conversion")
    header = [
        "policy",
        "jobs",
        "mean JCT (h)",
        "median JCT (h)",
        "mean wait (h)",
        "makespan (h)",
        "GPU utilisation",
    ]
    baseline = as_traced(traced, total_gpus) if traced else None
    measured = {"as traced": baseline, **results} if baseline else results
    report.table(
        header,
        [
            [
                name,
                int(row["jobs"]),
                row["mean_jct_s"] / HOUR,
                row["median_jct_s"] / HOUR,
                row["mean_wait_s"] / HOUR,
                row["makespan_s"] / HOUR,
                f"{row['gpu_utilisation'] * 100:.0f} %",
            ]
            for name, row in measured.items()
        ],
        "Per policy"
        + (
            " (first row: the jobs as they ran in the trace, on its own cluster; its utilisation "
            "is over this cluster's GPUs)"
            if traced
            else ""
        ),
    )
    report.data = {
        "format": conversion.format,
        "source": conversion.source,
        "jobs_in_file": conversion.total,
        "jobs_simulated": simulated,
        "skipped": {reason: conversion.skipped[reason] for reason in SKIP_REASONS},
        "notes": conversion.notes,
        "cluster": {"nodes": node_count, "gpus_per_node": gpus_per_node, "sizing": sizing},
        "seed": seed,
        "policies": results,
        "as_traced": baseline,
    }
    return report
