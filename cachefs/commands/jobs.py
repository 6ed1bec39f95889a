"""Training jobs sharing cached copies, and copies' nodes (the coordinator's CacheManager):
`cachefs job submit|show|renew|release|ls`, `cachefs scale`, `cachefs events`."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

from cachefs.client import CoordinatorClient
from cachefs.commands.common import cluster_client, names, print_result, waiting
from cachefs.errors import ConfigError
from cachefs.units import parse_duration


def _job_line(job: dict[str, Any]) -> str:
    if job["state"] == "suspended":
        return f"{job['id']}: suspended (position {job['position']}): {job['explanation']}"
    where = f"a new copy {job['copy']}" if job["cloned"] else f"copy {job['copy']}"
    return f"{job['id']}: running on {','.join(job['nodes'])} ({where})"


def cmd_job_submit(args: argparse.Namespace) -> int:
    lease_s = parse_duration(args.lease) if args.lease is not None else None
    with cluster_client(args) as client:
        job = client.submit_job(
            args.job,
            args.dataset,
            args.nodes,
            candidates=names(args.candidates) or None,
            lease_s=lease_s,
        )
        waits = args.wait and job["state"] == "suspended"
        # The job exists from here on: a Ctrl-C, even before the wait begins, stops only the
        # waiting and says that the job stays queued.
        with waiting(_still_queued(job)) if waits else contextlib.nullcontext():
            if not args.json:
                print(_job_line(job), flush=True)  # shown before a --wait, also through a pipe
                if args.explain:
                    for row in job["ranking"]:
                        print(f"  {row['node']:<16} {row['why']}")
            if waits:
                job = _wait_for_promotion(client, job, quiet=args.json)
    if args.json:
        print(json.dumps(job, indent=2))
    return 0


def _still_queued(job: dict[str, Any]) -> str:
    """What goes on when the user stops waiting for a suspended job."""
    lease = job.get("lease_s")  # 0: held until released
    released = f"; released unless renewed within {lease:g} s" if lease else ""
    return (
        f"job {job['id']} stays queued for dataset {job['dataset']!r}{released}: "
        f"`cachefs job show {job['id']} --wait` waits again, "
        f"`cachefs job release {job['id']}` gives up its place"
    )


def _wait_for_promotion(
    client: CoordinatorClient, job: dict[str, Any], *, quiet: bool
) -> dict[str, Any]:
    """Long-poll until the job runs; each poll renews its lease."""
    while job["state"] == "suspended":
        job = client.job(job["id"], wait_s=30)
    if not quiet:
        print(f"{_job_line(job)}  (waited {job['waited_s']:.1f} s)")
    return job


def cmd_job_show(args: argparse.Namespace) -> int:
    with cluster_client(args) as client:
        job = client.job(args.job)
        if args.wait and job["state"] == "suspended":
            with waiting(_still_queued(job)):
                job = _wait_for_promotion(client, job, quiet=True)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(_job_line(job))
    print(f"  {job['explanation']}")
    for row in job["ranking"]:
        print(f"  {row['node']:<16} {row['why']}")
    return 0


def cmd_job_ls(args: argparse.Namespace) -> int:
    with cluster_client(args) as client:
        jobs = client.jobs(args.dataset)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    print("JOB              DATASET          STATE      COPY  WAITED   NODES / POSITION")
    for job in jobs:
        where = ",".join(job["nodes"]) if job["state"] == "running" else f"#{job['position']}"
        print(
            f"{job['id']:<16} {job['dataset']:<16} {job['state']:<10} {job['copy'] or '-':<5}"
            f" {job['waited_s']:>6.1f}s  {where}"
        )
    return 0


def cmd_job_renew(args: argparse.Namespace) -> int:
    with cluster_client(args) as client:
        job = client.renew_job(args.job)
    print_result(args, job, f"{args.job}: lease renewed ({job['lease_expires_in_s']} s left)")
    return 0


def cmd_job_release(args: argparse.Namespace) -> int:
    with cluster_client(args) as client:
        result = client.release_job(args.job)
    promoted = ", ".join(result["promoted"])
    summary = f"{args.job} released" + (f"; promoted {promoted}" if promoted else "")
    print_result(args, result, summary)
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    add, remove = names(args.add), names(args.remove)
    if not add and not remove:
        raise ConfigError("scale needs --add and/or --remove")
    with cluster_client(args) as client:
        result = client.scale(args.dataset, args.copy, add=add, remove=remove)
    copy = next(c for c in result["copies"] if c["id"] == args.copy)
    summary = f"copy {args.copy} of {args.dataset}: {','.join(copy['nodes'])}"
    if "moved_shards" in result:
        summary += f"; {result['moved_shards']} shards change owner and are handed off"
    print_result(args, result, summary)
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    with cluster_client(args) as client:
        events = client.events(args.dataset, args.limit)
    if args.json:
        print(json.dumps(events, indent=2))
        return 0
    for event in events:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["at"]))
        print(f"{at}  {event['kind']:<8} {event['message']}")
    return 0


def add_job_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    job = sub.add_parser("job", help="training jobs sharing cached copies").add_subparsers(
        dest="job_command", required=True
    )
    submit = job.add_parser("submit", help="register a job: placed on a copy, or suspended")
    submit.add_argument("job", help="the job's name")
    submit.add_argument("--dataset", required=True)
    submit.add_argument("--nodes", type=int, default=1, help="how many nodes it runs on")
    submit.add_argument("--candidates", action="append", help="nodes it may run on (default all)")
    submit.add_argument("--lease", help="released unless renewed within this (default: the "
                        "coordinator's --job-lease; 0: never)")  # fmt: skip
    submit.add_argument("--wait", action="store_true", help="if suspended, wait until it runs")
    submit.add_argument("--explain", action="store_true", help="show every candidate's rank")
    submit.add_argument("--json", action="store_true")
    submit.set_defaults(func=cmd_job_submit)
    for name, func, text in [
        ("show", cmd_job_show, "one job, with the ranking of its nodes"),
        ("renew", cmd_job_renew, "renew a job's lease"),
        ("release", cmd_job_release, "release a job; the next suspended one is placed"),
    ]:
        verb = job.add_parser(name, help=text)
        verb.add_argument("job")
        verb.add_argument("--json", action="store_true")
        if name == "show":
            verb.add_argument("--wait", action="store_true", help="wait until it runs")
        verb.set_defaults(func=func)
    ls = job.add_parser("ls", help="running and suspended jobs")
    ls.add_argument("--dataset")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_job_ls)

    scale = sub.add_parser("scale", help="add or remove nodes of a dataset's copy")
    scale.add_argument("dataset")
    scale.add_argument("--copy", default="A", help="copy id (default A)")
    scale.add_argument("--add", action="append", help="nodes to add (comma-separated)")
    scale.add_argument("--remove", action="append", help="nodes to remove (comma-separated)")
    scale.add_argument("--json", action="store_true")
    scale.set_defaults(func=cmd_scale)

    events = sub.add_parser("events", help="what the coordinator did: jobs, clones, cleanup")
    events.add_argument("--dataset")
    events.add_argument("--limit", type=int, default=50)
    events.add_argument("--json", action="store_true")
    events.set_defaults(func=cmd_events)
