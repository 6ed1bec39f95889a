"""`cachefs preload`: on the local worker (`cachefs up` runs preload jobs itself), or across
the cluster with a coordinator; the same calls and answers either way. Also the coordinator's
views of where data is: `cachefs locality` and `cachefs nodes`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cachefs.client import ControlClient, CoordinatorClient, find_token
from cachefs.commands.common import (
    EXIT_FAILED,
    coordinator_if_any,
    fraction_text,
    require_coordinator,
    waiting,
)
from cachefs.errors import ConfigError
from cachefs.units import format_size, parse_size

PRELOAD_VERBS = ("status", "resume", "cancel")


def parse_at(text: str, now: float | None = None) -> float:
    """--at: "HH:MM" (the next such local time), an ISO 8601 date-time, or unix seconds."""
    import datetime as dt

    now = time.time() if now is None else now
    try:
        return float(text)
    except ValueError:
        pass
    try:
        clock = dt.datetime.strptime(text, "%H:%M").time()
    except ValueError:
        try:
            return dt.datetime.fromisoformat(text).timestamp()
        except ValueError:
            raise ConfigError(
                f"--at wants HH:MM, an ISO date-time or unix seconds, got {text!r}"
            ) from None
    today = dt.datetime.fromtimestamp(now)
    start = dt.datetime.combine(today.date(), clock)
    if start.timestamp() <= now:
        start += dt.timedelta(days=1)
    return start.timestamp()


def cmd_preload(args: argparse.Namespace) -> int:
    words = args.words
    if len(words) == 2 and words[0] in PRELOAD_VERBS:
        verb, dataset = words
    elif len(words) == 1:
        verb, dataset = "start", words[0]
    else:
        raise ConfigError(
            "usage: cachefs preload DATASET [options] | "
            "cachefs preload status|resume|cancel DATASET"
        )
    with _preload_client(args) as client:
        if verb == "start":
            paths = [p for chunk in args.paths or [] for p in chunk.split(",") if p]
            job = client.preload(
                dataset,
                paths=paths,
                fraction=args.fraction,
                nbytes=parse_size(args.bytes) if args.bytes else None,
                at=parse_at(args.at) if args.at else None,
            )
            if not args.wait and not args.json:
                print(f"preload {job['id']} {job['state']}: {_selection_text(job)}")
        elif verb == "resume":
            job = client.resume_preload(dataset)
            if not args.wait and not args.json:
                print(f"preload {job['id']} {job['state']}: {_selection_text(job)}")
        elif verb == "cancel":
            job = client.cancel_preload(dataset)
        else:
            job = client.preload_status(dataset)
        if args.wait:
            goes_on = f"the preload of {dataset!r} goes on: `cachefs preload status {dataset}`"
            with waiting(goes_on):
                job = _wait_for_preload(client, dataset, json_output=args.json)
        if args.json:
            print(json.dumps(job, indent=2))
        elif verb in ("status", "cancel") or args.wait:
            _print_preload(job)
    if verb == "cancel":
        return 0  # it did what was asked: the job is cancelled (or was over already)
    if _warn_if_nothing_selected(job):
        return EXIT_NOTHING_SELECTED
    return 0 if job["state"] in ("completed", "running", "scheduled") else EXIT_FAILED


#: `cachefs preload` exit status when its selection matches no file: nothing is preloaded,
#: most likely a mistyped --paths (1: objects failed, or the command was refused).
EXIT_NOTHING_SELECTED = 3


def _preload_client(args: argparse.Namespace) -> CoordinatorClient | ControlClient:
    """The coordinator's client in a cluster; else the local worker's (`cachefs up`), which
    runs preload jobs itself: the same calls, the same answers."""
    return coordinator_if_any(args) or ControlClient(args.state)


def _warn_if_nothing_selected(job: dict[str, Any]) -> bool:
    """One warning line on stderr when --paths name nothing; True when the whole selection
    matches no file. A single node checks every prefix at once (``unmatched_paths``); a
    cluster's job says so once planned (completed with 0 objects)."""
    paths = job["selection"]["paths"]
    unmatched = job.get("unmatched_paths") or []
    planned_empty = job["state"] == "completed" and job["planned"] and job["objects"] == 0
    if planned_empty or (paths and len(unmatched) == len(paths)):
        print(
            f"cachefs: warning: preload {job['id']}: {_selection_text(job)} matches no file "
            f"of dataset {job['dataset']!r}: nothing to preload",
            file=sys.stderr,
        )
        return True
    if unmatched:
        print(
            f"cachefs: warning: {', '.join(unmatched)} matches nothing in dataset "
            f"{job['dataset']!r} (the other paths are preloaded)",
            file=sys.stderr,
        )
    return False


def _selection_text(job: dict[str, Any]) -> str:
    sel = job["selection"]
    what = ", ".join(sel["paths"]) or "everything"
    if sel.get("fraction") is not None:
        what += f", {100 * sel['fraction']:g}% of the bytes"
    if sel.get("bytes") is not None:
        what += f", {format_size(sel['bytes'])}"
    if sel.get("at"):
        what += f", from {time.strftime('%Y-%m-%d %H:%M', time.localtime(sel['at']))}"
    return what


def _preload_fraction(job: dict[str, Any]) -> float:
    total, done = job["bytes"], job["bytes_done"]
    return done / total if total else (1.0 if job["planned"] else 0.0)


def _progress_text(job: dict[str, Any]) -> str:
    """A preload job's progress in words: the bar's caption."""
    total, done = job["bytes"], job["bytes_done"]
    eta = f"ETA {job['eta_s']:.0f}s" if job.get("eta_s") is not None else ""
    planned = "" if job["planned"] else f" (planning {job['shards_reported']}/1024 shards)"
    return (
        f"{job['objects_done']}/{job['objects']} objects  "
        f"{format_size(done)}/{format_size(total)}  {format_size(int(job['rate_bytes_per_s']))}/s"
        f"  {eta}  failed {job['failed_count']}{planned}"
    )


def _progress_line(job: dict[str, Any]) -> str:
    fraction = _preload_fraction(job)
    bar = "#" * int(30 * fraction) + "-" * (30 - int(30 * fraction))
    return f"[{bar}] {100 * fraction:5.1f}%  {_progress_text(job)}"


def _scheduled_text(job: dict[str, Any]) -> str:
    at = time.localtime(job["selection"]["at"])
    return f"scheduled for {time.strftime('%Y-%m-%d %H:%M', at)}"


#: How often `preload --wait` asks for the job's progress, in seconds.
PRELOAD_POLL_S = 0.5


def _wait_for_preload(
    client: CoordinatorClient | ControlClient, dataset: str, *, json_output: bool
) -> dict[str, Any]:
    """Poll until the job is over, showing its progress on stderr: rich's progress bar on a
    terminal, else a line every few seconds (nothing with --json)."""
    if sys.stderr.isatty() and not json_output:
        return _preload_progress_bar(client, dataset)
    last_line = 0.0
    while True:
        job = client.preload_status(dataset)
        over = job["state"] not in ("running", "scheduled")
        if not json_output and (over or time.monotonic() - last_line > 5):
            scheduled = job["state"] == "scheduled"
            line = _scheduled_text(job) if scheduled else _progress_line(job)
            print(line, file=sys.stderr, flush=True)
            last_line = time.monotonic()
        if over:
            return job
        time.sleep(PRELOAD_POLL_S)


def _preload_progress_bar(
    client: CoordinatorClient | ControlClient, dataset: str
) -> dict[str, Any]:
    """rich draws the bar and its caption, redrawn in place (shorter text leaves nothing
    behind) and ended with a newline however the wait ends (Ctrl-C included)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

    progress = Progress(
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("{task.description}"),
        console=Console(stderr=True, highlight=False),
        auto_refresh=False,  # redrawn at each answer: no drawing thread
    )
    with progress:
        bar = progress.add_task("", total=None)  # pulses until there is a fraction
        while True:
            job = client.preload_status(dataset)
            if job["state"] == "scheduled":
                progress.update(bar, total=None, description=_scheduled_text(job))
            else:
                fraction = _preload_fraction(job) if job["planned"] else None
                progress.update(
                    bar,
                    total=None if fraction is None else 1.0,
                    completed=fraction or 0.0,
                    description=_progress_text(job),
                )
            progress.refresh()
            if job["state"] not in ("running", "scheduled"):
                return job
            time.sleep(PRELOAD_POLL_S)


def _print_preload(job: dict[str, Any]) -> None:
    print(f"preload {job['id']} of {job['dataset']}: {job['state']}  ({_selection_text(job)})")
    print(f"  {_progress_line(job)}")
    for failure in job["failed"]:
        print(f"  failed: {failure['key']} on {failure['node']}: {failure['reason']}")
    if job["failed_count"] > len(job["failed"]):
        print(f"  … {job['failed_count'] - len(job['failed'])} more failed")


def cmd_locality(args: argparse.Namespace) -> int:
    with CoordinatorClient(
        require_coordinator(args), find_token(args.token_file, args.state)
    ) as client:
        locality = client.locality(args.dataset)
    if args.json:
        print(json.dumps(locality, indent=2))
        return 0
    print(
        f"{locality['dataset']}: {format_size(locality['cached_bytes'])} of "
        f"{format_size(locality['bytes'])} cached ({fraction_text(locality['fraction'])})"
    )
    print("NODE             STATE  CACHED        FRACTION  ADDRESS")
    for row in locality["nodes"]:
        print(
            f"{row['node']:<16} {row['state']:<6} {format_size(row['cached_bytes']):>10}"
            f"  {fraction_text(row['fraction']):>9}  {row['address']}"
        )
    return 0


def cmd_nodes(args: argparse.Namespace) -> int:
    with CoordinatorClient(
        require_coordinator(args), find_token(args.token_file, args.state)
    ) as client:
        nodes = [client.node(args.name)] if args.name else client.nodes()
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    for node in nodes:
        used = sum(t["used"] for t in node["tiers"])
        capacity = sum(t["capacity"] for t in node["tiers"])
        print(
            f"{node['node']:<16} {node['state']:<5} {node['address']:<22} "
            f"cache {format_size(used)}/{format_size(capacity)}  "
            f"heartbeat {node['last_heartbeat_s_ago']:.1f}s ago"
        )
        for held in node["datasets"]:
            print(
                f"  {held['dataset']:<16} {format_size(held['cached_bytes']):>10}"
                f"  {fraction_text(held['fraction'])}"
            )
    return 0


def add_preload_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`cachefs preload`, `locality`, `nodes`."""
    preload = sub.add_parser(
        "preload",
        help="preload a dataset (or: preload status|resume|cancel DATASET): on the local worker "
        "(cachefs up), or across the cluster with --coordinator",
    )
    preload.add_argument("words", nargs="+", metavar="DATASET")
    preload.add_argument("--paths", action="append", help="path prefixes, comma-separated")
    size = preload.add_mutually_exclusive_group()
    size.add_argument("--fraction", type=float, help="share of the bytes, 0-1")
    size.add_argument("--bytes", help="byte budget, e.g. 500GiB")
    preload.add_argument("--at", help="start at HH:MM, an ISO date-time or unix seconds")
    preload.add_argument("--wait", action="store_true", help="show progress until it ends")
    preload.add_argument("--json", action="store_true")
    preload.set_defaults(func=cmd_preload)

    locality = sub.add_parser("locality", help="which nodes hold a dataset, how much")
    locality.add_argument("dataset")
    locality.add_argument("--json", action="store_true")
    locality.set_defaults(func=cmd_locality)

    nodes = sub.add_parser("nodes", help="nodes, their state and the datasets they hold")
    nodes.add_argument("name", nargs="?")
    nodes.add_argument("--json", action="store_true")
    nodes.set_defaults(func=cmd_nodes)
