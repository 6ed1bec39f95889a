"""Running a worker and looking at it: `cachefs up`, `worker`, `down`, `status`, `stats`,
`resolve`. The options of `up` and `worker` come from the settings class
(:class:`cachefs.settings.WorkerConfig`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from cachefs.client import ControlClient, CoordinatorClient, WorkerNotRunning, find_token
from cachefs.commands.common import (
    EXIT_INTERRUPTED,
    coordinator_if_any,
    fraction_text,
    print_datasets,
    require_coordinator,
)
from cachefs.commands.options import add_options, settings_from_args
from cachefs.errors import ConfigError
from cachefs.pidlock import WORKER_LOCK_NAME, is_locked
from cachefs.settings import UP, WORKER, WorkerConfig
from cachefs.stats import DEFAULT_INTERVAL_S
from cachefs.units import format_size, parse_duration


def worker_config(args: argparse.Namespace, **given: Any) -> WorkerConfig:
    """The settings of `cachefs up` (or, with ``given`` cluster settings, `cachefs worker`)."""
    command = WORKER if args.command == WORKER else UP
    return settings_from_args(WorkerConfig, args, command, state_dir=args.state, **given)


def _run_worker(config: WorkerConfig, banner: str) -> int:
    """Run a worker in the foreground. ``banner`` is printed once it serves (mounted, its
    listeners up), never before a start that then fails: a failed start is only its one line
    (``main``), with nothing left behind (``Worker.run``)."""
    import trio

    from cachefs.worker import Worker

    async def serve() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(Worker(config).run)
            print(banner, file=sys.stderr, flush=True)

    trio.run(serve)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    config = worker_config(args)
    return _run_worker(
        config,
        f"cachefs: serving {config.mountpoint} (state {config.state_dir}); "
        "Ctrl-C or `cachefs down` to stop",
    )


def cmd_worker(args: argparse.Namespace) -> int:
    url = require_coordinator(args)
    token = find_token(args.token_file, args.state)
    if not token:
        raise ConfigError(
            "no API token: pass --token-file FILE (a file holding it, such as the "
            "coordinator's <state>/token) or set CACHEFS_TOKEN to the token itself"
        )
    config = worker_config(args, coordinator=url, token=token)
    return _run_worker(
        config,
        f"cachefs: worker {config.node} serving {config.mountpoint}, peers on {config.listen}, "
        f"following {url}",
    )


def cmd_down(args: argparse.Namespace) -> int:
    with ControlClient(args.state) as client:
        try:
            client.shutdown()
        except WorkerNotRunning:
            cleared = _clear_left_mount(args.state)
            also = f"; cleared the dead mount it left at {cleared}" if cleared else ""
            print(f"cachefs: no worker running{also}", file=sys.stderr)
            return 0
        # The control socket stops answering before the worker has unmounted; the worker
        # holds its state directory's lock until it has unmounted and closed its cache.
        lock = os.path.join(args.state, WORKER_LOCK_NAME)
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            if not client.is_running() and not is_locked(lock):
                print("cachefs: worker stopped, mount removed, cache kept")
                return 0
            time.sleep(0.1)
    print(f"cachefs: worker still running after {args.timeout:.0f}s", file=sys.stderr)
    return 1


def _clear_left_mount(state_dir: str) -> str | None:
    """A worker that was killed left its mount dead: clear it (cachefs/mountpoint.py), unless
    a worker holds the state directory (one starting now clears it itself)."""
    if is_locked(os.path.join(state_dir, WORKER_LOCK_NAME)):
        return None
    import trio

    from cachefs.mountpoint import clear_left_mount

    return trio.run(clear_left_mount, state_dir)


def cmd_status(args: argparse.Namespace) -> int:
    with ControlClient(args.state) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    mounted = "mounted" if status["mounted"] else "NOT mounted"
    print(f"node {status['node']}  pid {status['pid']}  {status['mount']} ({mounted})")
    print(
        f"admission {status['admission']}  promote {status['promote']}  "
        f"rss {format_size(status['rss_bytes'])}"
    )
    print("\nTIER  USED / CAPACITY             RESERVE (HELD)        BLOCKS  PATH")
    for tier in status["tiers"]:
        used, capacity = format_size(tier["used"]), format_size(tier["capacity"])
        print(
            f"{tier['name']:<5} {used:>10} / {capacity:<12}"
            f"  {format_size(tier['reserve']):>9} ({format_size(tier['reserved_used'])})"
            f"  {tier['blocks']:>8}  {tier['path']}"
        )
    reads = status["reads"]
    hits = sum(reads["hits"].values())
    print(
        f"\nreads: {hits} hits ({', '.join(f'{k} {v}' for k, v in reads['hits'].items())}), "
        f"{reads['misses']} misses, hit ratio {fraction_text(reads['hit_ratio'])}"
    )
    fast = status.get("fuse_fast_read")
    if fast is None:
        print("native reads: off (every READ is served in Python)")
    else:
        print(
            f"native reads: {fast['reads']} READs answered in C ({format_size(fast['bytes'])}, "
            f"{fast.get('spliced', 0)} spliced), {fast['fallbacks']} handed to Python; "
            f"{fast['blocks']} blocks servable; "
            f"dropped {fast['vanished']} vanished, {fast['corrupt']} corrupt; "
            f"{fast['lookups']} LOOKUPs answered in C; {fast.get('open_files', 0)} block files "
            f"open"
        )
        serving = status.get("fuse_processes")
        if serving:  # --fuse-processes above 1 (cachefs/fs/serving.py)
            forwarded = ", ".join(f"{op} {n}" for op, n in sorted(serving["forwarded"].items()))
            print(
                f"fuse processes: {serving['processes']} (serving processes "
                f"{' '.join(map(str, serving['pids'])) or 'none now'}; {serving['deaths']} "
                f"died and were replaced); {fast.get('serving_reads', 0)} of the READs answered "
                f"in C by them, and {fast.get('serving_peer_reads', 0)} of other workers' blocks "
                f"(on {serving.get('peer_connections', 0)} connections of theirs); forwarded to "
                f"the worker: {forwarded or 'nothing'}"
            )
        if fast.get("passthrough"):
            print(
                f"passthrough: {fast['pt_opens']} OPENs handed the block file to the kernel, "
                f"{fast['cached_opens']} read through READs; {fast['backing_files']} backing "
                f"files open, {fast['opened']} files open"
            )
    cache = status["cache"]
    print(
        f"cache: {cache['admitted']} admitted, {cache['refused']} refused, "
        f"{cache['evicted']} evicted, {cache['corrupt']} corrupt dropped"
    )
    _print_cleanup(status)
    print_datasets(status["datasets"])
    return 0


def _print_cleanup(status: dict[str, Any]) -> None:
    """What the coordinator's cleanup freed here, and the copying of clone fills/hand-offs."""
    freed = status.get("cleanup", {}).get("freed_bytes", {})
    if freed:
        parts = [
            f"{dataset} {format_size(nbytes)} ({kind})"
            for dataset, kinds in sorted(freed.items())
            for kind, nbytes in sorted(kinds.items())
        ]
        print(f"cleanup: freed {', '.join(parts)}")
    blocks = status.get("fill", {}).get("blocks", {})
    if any(blocks.values()):
        print(
            f"fills: {blocks.get('copied', 0)} blocks copied from peers "
            f"({format_size(status['fill']['bytes'])}), {blocks.get('absent', 0)} absent, "
            f"{blocks.get('failed', 0)} failed"
        )


def cmd_stats(args: argparse.Namespace) -> int:
    """A live view of the local worker, or with a coordinator of the whole cluster
    (cachefs/stats.py). Ctrl-C is how a live view ends: exit 130, nothing printed."""
    from cachefs import stats

    interval_s = parse_duration(args.interval)
    if interval_s <= 0:
        raise ConfigError(f"--interval must be more than 0, got {args.interval!r}")
    cluster = coordinator_if_any(args)
    client: CoordinatorClient | ControlClient
    source: stats.ClusterSource | stats.WorkerSource
    if cluster is not None:
        client, source = cluster, stats.ClusterSource(cluster)
    else:
        client = ControlClient(args.state)
        source = stats.WorkerSource(client)
    with client:
        try:
            stats.run(source, interval_s=interval_s, once=args.once, json_output=args.json)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    with ControlClient(args.state) as client:
        print(json.dumps(client.resolve(args.dataset, args.path), indent=2))
    return 0


def add_run_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`cachefs up` and `cachefs worker`."""
    up = sub.add_parser("up", help="run the worker and mount (foreground)")
    add_options(up, WorkerConfig, UP)
    up.set_defaults(func=cmd_up)

    worker = sub.add_parser("worker", help="run a cluster worker that follows a coordinator")
    add_options(worker, WorkerConfig, WORKER)
    worker.set_defaults(func=cmd_worker)


def add_look_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`cachefs down`, `status`, `stats`."""
    down = sub.add_parser("down", help="stop the worker and unmount (cache kept)")
    down.add_argument("--timeout", type=float, default=30.0)
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="tiers, datasets, hit ratio")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    stats = sub.add_parser(
        "stats",
        help="live view: reads/s, hit ratio per tier, peer and store GETs, FUSE latency, "
        "preloads (of the whole cluster with --coordinator)",
    )
    stats.add_argument(
        "--interval", default=f"{DEFAULT_INTERVAL_S:g}s", help="time between samples (%(default)s)"
    )
    stats.add_argument(
        "--once", action="store_true", help="print one view (two samples one interval apart)"
    )
    stats.add_argument(
        "--json", action="store_true", help="JSON: one document with --once, else a line each"
    )
    stats.set_defaults(func=cmd_stats)


def add_resolve_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    resolve = sub.add_parser("resolve", help="show a file's blocks and local block files")
    resolve.add_argument("dataset")
    resolve.add_argument("path")
    resolve.set_defaults(func=cmd_resolve)
