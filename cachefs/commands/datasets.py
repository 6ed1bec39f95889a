"""`cachefs dataset add|set|ls|refresh|rm`: on the local worker, or with a coordinator on the
whole cluster (sharing and cleanup policies are the coordinator's)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from cachefs.client import ControlClient, CoordinatorClient, one_line
from cachefs.commands.common import (
    cluster_client,
    coordinator_if_any,
    names,
    print_datasets,
    print_result,
    waiting,
)
from cachefs.errors import ConfigError, EmptySource, StoreError
from cachefs.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_STORE_TIMEOUT_S,
    CleanupPolicy,
    DatasetSpec,
)
from cachefs.units import format_size, parse_duration, parse_size


def cmd_dataset_add(args: argparse.Namespace) -> int:
    spec = {
        "name": args.name,
        "uri": args.uri,
        "endpoint": args.endpoint,
        "region": args.region,
        "path_style": args.path_style,
        "profile": args.profile,
        "credentials_file": args.credentials_file,
        "block_size": parse_size(args.block_size),
        "timeout_s": parse_duration(args.timeout),
        "first_byte_timeout_s": parse_duration(args.first_byte_timeout),
        "refresh_interval_s": parse_duration(args.refresh_every) if args.refresh_every else None,
    }
    sharing = {
        "max_jobs_per_copy": args.max_jobs_per_copy,
        "overflow": args.overflow,
        "cleanup": args.cleanup,
        "nodes": names(args.nodes) if args.nodes else None,
    }
    # The rules the worker and the coordinator apply, checked here too: one line before
    # anything is sent, whichever receives it.
    policy = {k: v for k, v in sharing.items() if k != "nodes" and v is not None}
    DatasetSpec.from_json({**spec, **policy})
    cluster = coordinator_if_any(args)
    if cluster is not None:
        if not args.allow_empty:
            _refuse_an_empty_listing(spec)
        with cluster:
            body = {k: v for k, v in {**spec, **sharing}.items() if v is not None}
            result = cluster.add_dataset(body)
        print_result(args, result, f"dataset {args.name!r} added; workers are mounting it")
        return 0
    given = [f"--{k.replace('_', '-')}" for k, v in sharing.items() if v is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} need a coordinator (jobs, copies and cleanup are the "
            "coordinator's): pass --coordinator URL or set CACHEFS_COORDINATOR"
        )
    goes_on = f"the worker may still add dataset {args.name!r}: `cachefs dataset ls`"
    with ControlClient(args.state) as client, waiting(goes_on):
        result = client.add_dataset(spec, allow_empty=args.allow_empty)
    print_result(args, result, f"dataset {args.name!r} added")
    return 0


def _refuse_an_empty_listing(spec: dict[str, Any]) -> None:
    """Cluster mode: a source that lists no object (a mistyped prefix, most likely) is refused
    before the coordinator accepts it, since its workers list the source only later. One
    LIST request, from where the CLI runs: if it cannot list from here (no credentials here, a
    file:// path only the workers have), it says so and adds the dataset unchecked."""
    from cachefs.datasets import store_config
    from cachefs.store import open_store
    from cachefs.store.base import names_a_file

    config = store_config(DatasetSpec.from_json(spec))
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "found credentials": noise here
    try:
        store = open_store(config)
        try:
            first = next(filter(names_a_file, store.list()), None)  # markers are no files
        finally:
            store.close()
    except StoreError as exc:
        print(
            f"cachefs: note: could not list {spec['uri']} from here, so it is added unchecked "
            f"({one_line(str(exc), 200)})",
            file=sys.stderr,
        )
        return
    if first is None:
        raise EmptySource(spec["name"], spec["uri"])


def cmd_dataset_set(args: argparse.Namespace) -> int:
    changes = {}
    if args.max_jobs_per_copy is not None:
        changes["max_jobs_per_copy"] = args.max_jobs_per_copy or None  # 0: no limit
    if args.overflow:
        changes["overflow"] = args.overflow
    if args.cleanup:
        changes["cleanup"] = args.cleanup
    if not changes:
        raise ConfigError("dataset set needs --max-jobs-per-copy, --overflow or --cleanup")
    if args.cleanup:
        CleanupPolicy.parse(args.cleanup)  # the coordinator's rule, as one line before sending
    with cluster_client(args) as client:
        result = client.update_policy(args.name, **changes)
    print_result(args, result, f"dataset {args.name!r}: policy changed")
    return 0


def cmd_dataset_ls(args: argparse.Namespace) -> int:
    cluster = coordinator_if_any(args)
    if cluster is not None:
        with cluster:
            datasets = cluster.datasets()
    else:
        with ControlClient(args.state) as client:
            datasets = client.datasets()
    if args.json:
        print(json.dumps(datasets, indent=2))
    else:
        print_datasets(datasets)
    return 0


def _on_coordinator_or_worker(
    args: argparse.Namespace,
    ask_coordinator: Callable[[CoordinatorClient], dict[str, Any]],
    coordinator_summary: str,
    ask_worker: Callable[[ControlClient], dict[str, Any]],
    worker_summary: Callable[[dict[str, Any]], str],
) -> int:
    """Run a dataset command where it belongs: on the coordinator when one is configured (it
    passes the command on to every worker and answers at once, so its summary is fixed), on
    the local worker otherwise (its answer says what was done)."""
    cluster = coordinator_if_any(args)
    if cluster is not None:
        with cluster:
            result = ask_coordinator(cluster)
        print_result(args, result, coordinator_summary)
        return 0
    with ControlClient(args.state) as client:
        result = ask_worker(client)
    print_result(args, result, worker_summary(result))
    return 0


def cmd_dataset_refresh(args: argparse.Namespace) -> int:
    return _on_coordinator_or_worker(
        args,
        lambda cluster: cluster.refresh_dataset(args.name),
        f"dataset {args.name!r}: workers are re-listing the source",
        lambda worker: worker.refresh_dataset(args.name),
        lambda result: (
            f"dataset {args.name!r} refreshed "
            f"({result['changed']} changed, {result['removed']} removed)"
        ),
    )


def cmd_dataset_rm(args: argparse.Namespace) -> int:
    return _on_coordinator_or_worker(
        args,
        lambda cluster: cluster.remove_dataset(args.name),
        f"dataset {args.name!r} removed; workers free its cache",
        lambda worker: worker.remove_dataset(args.name, keep_cache=args.keep_cache),
        lambda result: f"dataset {args.name!r} removed, {format_size(result['freed_bytes'])} freed",
    )


def add_dataset_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dataset = sub.add_parser("dataset", help="manage datasets").add_subparsers(
        dest="dataset_command", required=True
    )
    add = dataset.add_parser("add", help="add a dataset: snapshot its listing and mount it")
    add.add_argument("name")
    add.add_argument("uri", help="s3://bucket/prefix, oss://bucket/prefix or file:///dir")
    add.add_argument("--endpoint", help="store endpoint URL (S3-compatible or OSS)")
    add.add_argument("--region")
    add.add_argument("--path-style", action=argparse.BooleanOptionalAction, default=None)
    add.add_argument("--profile", help="AWS profile name (credentials stay in ~/.aws)")
    add.add_argument("--credentials-file", help="credentials ini file (read by the worker)")
    add.add_argument("--block-size", default=str(DEFAULT_BLOCK_SIZE))
    add.add_argument(
        "--timeout",
        default=f"{DEFAULT_STORE_TIMEOUT_S:g}s",
        help="give up on a store request after this long, all its tries included "
        "(default %(default)s)",
    )
    add.add_argument(
        "--first-byte-timeout",
        default=f"{DEFAULT_FIRST_BYTE_TIMEOUT_S:g}s",
        help="replace a store read silent (before its first byte, or mid-body) this long; "
        "one silent for half of it gets a parallel twin (default %(default)s)",
    )
    add.add_argument("--refresh-every", help="refresh the snapshot periodically, e.g. 1h")
    add.add_argument("--max-jobs-per-copy", type=int, help="running jobs sharing one copy")
    add.add_argument(
        "--overflow", choices=["suspend", "clone"], help="a job over the limit (default suspend)"
    )
    add.add_argument("--cleanup", help="lock (default), lru or ttl:<duration>, e.g. ttl:6h")
    add.add_argument("--nodes", action="append", help="nodes of the first copy (default all)")
    add.add_argument(
        "--allow-empty",
        action="store_true",
        help="add it even if the source lists no file (refused otherwise: a mistyped prefix?)",
    )
    add.add_argument("--json", action="store_true")
    add.set_defaults(func=cmd_dataset_add)
    policy = dataset.add_parser("set", help="change a dataset's sharing and cleanup policy")
    policy.add_argument("name")
    policy.add_argument("--max-jobs-per-copy", type=int, help="running jobs per copy (0: none)")
    policy.add_argument("--overflow", choices=["suspend", "clone"])
    policy.add_argument("--cleanup", help="lock, lru or ttl:<duration>")
    policy.add_argument("--json", action="store_true")
    policy.set_defaults(func=cmd_dataset_set)

    ls = dataset.add_parser("ls", help="list datasets")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_dataset_ls)
    refresh = dataset.add_parser("refresh", help="re-list the source and swap in the new snapshot")
    refresh.add_argument("name")
    refresh.add_argument("--json", action="store_true")
    refresh.set_defaults(func=cmd_dataset_refresh)
    rm = dataset.add_parser("rm", help="remove a dataset from the mount and free its cache")
    rm.add_argument("name")
    rm.add_argument("--keep-cache", action="store_true", help="keep its cached blocks")
    rm.add_argument("--json", action="store_true")
    rm.set_defaults(func=cmd_dataset_rm)
