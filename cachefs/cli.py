"""The `cachefs` command line.

    cachefs up --mount /mnt/cachefs --ram 8GiB --ssd /var/cache/cachefs:100GiB
    cachefs dataset add imagenet s3://bucket/imagenet --endpoint http://127.0.0.1:9000
    cachefs status | dataset ls | dataset refresh NAME | dataset rm NAME | down
    cachefs demo      # everything above on a generated dataset, no cloud account needed

A cluster: one coordinator, one worker per node; dataset, preload and locality commands then
go to the coordinator (--coordinator URL or CACHEFS_COORDINATOR):

    cachefs coordinator --listen 127.0.0.1:7700 --state /var/lib/cachefs
    cachefs worker --coordinator http://127.0.0.1:7700 --node gpu1 --listen 127.0.0.2:7701 \
                   --mount /mnt/cachefs --ram 8GiB --ssd /var/cache/cachefs:100GiB
    cachefs preload imagenet --paths train/ --fraction 0.5 [--at 02:00] [--wait]
    cachefs preload status imagenet | cachefs locality imagenet | cachefs nodes

Without a coordinator, commands talk to the local worker through its control socket, found
from --state / CACHEFS_STATE (default /var/lib/cachefs as root).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time

from cachefs.client import (
    ControlClient,
    ControlError,
    CoordinatorClient,
    InvalidField,
    WorkerNotRunning,
    coordinator_url,
    default_state_dir,
    find_token,
    one_line,
)
from cachefs.csi import DEFAULT_KUBELET_DIR
from cachefs.errors import CachefsError, ConfigError, EmptySource, StoreError
from cachefs.fs.permissions import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    MountPermissions,
    parse_id,
    parse_mode,
)
from cachefs.pidlock import WORKER_LOCK_NAME, is_locked
from cachefs.protocol import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_STORE_TIMEOUT_S,
    CleanupPolicy,
    DatasetSpec,
)
from cachefs.stats import DEFAULT_INTERVAL_S
from cachefs.units import format_size, parse_duration, parse_size

log = logging.getLogger(__name__)


def _parse_ssd(text: str) -> tuple[str, int]:
    path, sep, size = text.rpartition(":")
    if not sep or not path:
        raise ConfigError(f"--ssd wants DIR:SIZE (e.g. /var/cache/cachefs:100GiB), got {text!r}")
    return path, parse_size(size)


def _worker_config(args, **cluster):
    from cachefs.fs.blocks import ReadLimits
    from cachefs.worker import WorkerConfig

    ssd_dir, ssd_capacity = _parse_ssd(args.ssd) if args.ssd else (None, 0)
    return WorkerConfig(
        state_dir=args.state,
        mountpoint=args.mount,
        ram_capacity=parse_size(args.ram),
        ram_dir=args.ram_dir,
        ram_reserve=parse_size(args.ram_reserve),
        ssd_dir=ssd_dir,
        ssd_capacity=ssd_capacity,
        ssd_reserve=parse_size(args.ssd_reserve),
        admission=args.admission,
        promote=args.promote,
        entry_timeout=parse_duration(args.entry_timeout),
        attr_timeout=parse_duration(args.attr_timeout),
        max_tasks=args.max_tasks,
        readahead_kib=parse_size(args.readahead) // 1024,
        allow_other=args.allow_other,
        permissions=_mount_permissions(args),
        no_open={"auto": None, "on": True, "off": False}[args.fuse_no_open],
        fast_read={"auto": None, "on": True, "off": False}[args.fuse_fast_read],
        metrics_listen=None if args.metrics == "off" else args.metrics,
        limits=ReadLimits(store_threads=args.store_threads),
        **({"node": args.node} if args.node else {}),
        **cluster,
    )


def _mount_permissions(args) -> MountPermissions:
    """--uid/--gid/--file-mode/--dir-mode; the ones not given keep MountPermissions' defaults."""
    given = {}
    if args.uid is not None:
        given["uid"] = parse_id(args.uid, "--uid")
    if args.gid is not None:
        given["gid"] = parse_id(args.gid, "--gid")
    if args.file_mode is not None:
        given["file_mode"] = parse_mode(args.file_mode, "--file-mode")
    if args.dir_mode is not None:
        given["dir_mode"] = parse_mode(args.dir_mode, "--dir-mode")
    return MountPermissions(**given)


def _run_worker(config, banner: str) -> int:
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


def cmd_up(args) -> int:
    config = _worker_config(args)
    return _run_worker(
        config,
        f"cachefs: serving {config.mountpoint} (state {config.state_dir}); "
        "Ctrl-C or `cachefs down` to stop",
    )


def cmd_worker(args) -> int:
    url = _require_coordinator(args)
    token = find_token(args.token_file, args.state)
    if not token:
        raise ConfigError(
            "no API token: pass --token-file FILE (a file holding it, such as the "
            "coordinator's <state>/token) or set CACHEFS_TOKEN to the token itself"
        )
    config = _worker_config(
        args,
        coordinator=url,
        listen=args.listen,
        token=token,
        gpus=args.gpus,
        heartbeat_interval_s=parse_duration(args.heartbeat_interval),
        peer_timeout_s=parse_duration(args.peer_timeout),
        preload_processes=args.preload_processes,
    )
    return _run_worker(
        config,
        f"cachefs: worker {config.node} serving {config.mountpoint}, peers on {config.listen}, "
        f"following {url}",
    )


def cmd_coordinator(args) -> int:
    import trio

    from coordinator.server import CoordinatorConfig, serve

    config = CoordinatorConfig(
        listen=args.listen,
        state_dir=args.state,
        store=args.store,
        token_file=args.token_file,
        heartbeat_interval_s=parse_duration(args.heartbeat_interval),
        down_after_s=parse_duration(args.down_after) if args.down_after else None,
        job_lease_s=parse_duration(args.job_lease),
        lru_high_watermark=args.lru_high_watermark,
        fill_timeout_s=parse_duration(args.fill_timeout),
    )
    if not 0 < config.lru_high_watermark <= 1:
        raise ConfigError("--lru-high-watermark must be in (0, 1]")
    print(f"cachefs: coordinator on http://{args.listen} (state {args.state})", file=sys.stderr)
    trio.run(serve, config)
    return 0


def _require_coordinator(args) -> str:
    url = coordinator_url(args.coordinator)
    if not url:
        raise ConfigError("no coordinator: pass --coordinator URL or set CACHEFS_COORDINATOR")
    return url


def _cluster_client(args) -> CoordinatorClient:
    return CoordinatorClient(_require_coordinator(args), find_token(args.token_file, args.state))


def _coordinator(args) -> CoordinatorClient | None:
    """A client of the coordinator when one is configured; None in single-node mode."""
    url = coordinator_url(args.coordinator)
    if not url:
        return None
    return CoordinatorClient(url, find_token(args.token_file, args.state))


def cmd_down(args) -> int:
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


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def cmd_status(args) -> int:
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
        f"{reads['misses']} misses, hit ratio {_fraction(reads['hit_ratio'])}"
    )
    fast = status.get("fuse_fast_read")
    if fast is None:
        print("native reads: off (every READ is served in Python)")
    else:
        print(
            f"native reads: {fast['reads']} READs answered in C ({format_size(fast['bytes'])}), "
            f"{fast['fallbacks']} handed to Python; {fast['blocks']} blocks servable; "
            f"dropped {fast['vanished']} vanished, {fast['corrupt']} corrupt; "
            f"{fast['lookups']} LOOKUPs answered in C; {fast.get('open_files', 0)} block files "
            f"open"
        )
    cache = status["cache"]
    print(
        f"cache: {cache['admitted']} admitted, {cache['refused']} refused, "
        f"{cache['evicted']} evicted, {cache['corrupt']} corrupt dropped"
    )
    _print_cleanup(status)
    _print_datasets(status["datasets"])
    return 0


def _print_cleanup(status: dict) -> None:
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


def _print_datasets(datasets: list[dict]) -> None:
    print("\nDATASET          FILES      SIZE        CACHED            SKIPPED  SOURCE")
    for ds in datasets:
        if "copies" in ds:  # the coordinator's view of a dataset
            cached = f"{format_size(ds['cached_bytes'])} {_fraction(ds['cached_fraction'])}"
            print(
                f"{ds['name']:<16} {ds['files']:>9} {format_size(ds['bytes']):>10}"
                f"  {cached:<17} {'':>7}  {ds['uri']}"
            )
            limit = ds.get("max_jobs_per_copy") or "no limit"
            print(
                f"{'':16}   jobs: {ds['jobs']['running']} running, {ds['jobs']['suspended']} "
                f"suspended; {limit} per copy, then {ds['overflow']}; cleanup {ds['cleanup']}"
                f"; {format_size(ds['freed_bytes'])} freed"
            )
            for c in ds["copies"]:
                fill = f"  filling ({c['fill']['reason']})" if c["fill"] else ""
                print(
                    f"{'':16}   copy {c['id']}: {','.join(c['nodes']) or '-'}  "
                    f"{c['running_jobs']} jobs, cache {_fraction(c['used_ratio'])} used{fill}"
                )
            continue
        if ds["state"] != "ready":
            print(f"{ds['name']:<16} ({ds['state']}: {ds.get('error')})  {ds['uri']}")
            continue
        cached = f"{format_size(ds['cached_bytes'])} {_fraction(ds['cached_fraction'])}"
        print(
            f"{ds['name']:<16} {ds['files']:>9} {format_size(ds['bytes']):>10}"
            f"  {cached:<17} {ds['skipped_total']:>7}  {ds['uri']}"
        )
        if ds["skipped_total"]:
            reasons = ", ".join(f"{k} {v}" for k, v in ds["skipped"].items())
            print(f"{'':16}   skipped keys: {reasons}; e.g. {', '.join(ds['skipped_samples'][:3])}")


def cmd_dataset_add(args) -> int:
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
        "nodes": _names(args.nodes) if args.nodes else None,
    }
    # The rules the worker and the coordinator apply, checked here too: one line before
    # anything is sent, whichever receives it.
    policy = {k: v for k, v in sharing.items() if k != "nodes" and v is not None}
    DatasetSpec.from_json({**spec, **policy})
    cluster = _coordinator(args)
    if cluster is not None:
        if not args.allow_empty:
            _refuse_an_empty_listing(spec)
        with cluster:
            body = {k: v for k, v in {**spec, **sharing}.items() if v is not None}
            result = cluster.add_dataset(body)
        _print_result(args, result, f"dataset {args.name!r} added; workers are mounting it")
        return 0
    given = [f"--{k.replace('_', '-')}" for k, v in sharing.items() if v is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} need a coordinator (jobs, copies and cleanup are the "
            "coordinator's): pass --coordinator URL or set CACHEFS_COORDINATOR"
        )
    goes_on = f"the worker may still add dataset {args.name!r}: `cachefs dataset ls`"
    with ControlClient(args.state) as client, _waiting(goes_on):
        result = client.add_dataset(spec, allow_empty=args.allow_empty)
    _print_result(args, result, f"dataset {args.name!r} added")
    return 0


def _refuse_an_empty_listing(spec: dict) -> None:
    """Cluster mode: a source that lists no object (a mistyped prefix, most likely) is refused
    before the coordinator accepts it, since its workers list the source only later. One
    LIST request, from where the CLI runs: if it cannot list from here (no credentials here, a
    file:// path only the workers have), it says so and adds the dataset unchecked."""
    from cachefs.store import open_store
    from cachefs.store.base import names_a_file
    from cachefs.worker import Worker

    config = Worker.store_config(DatasetSpec.from_json(spec))
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


def cmd_dataset_set(args) -> int:
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
    with _cluster_client(args) as client:
        result = client.update_policy(args.name, **changes)
    _print_result(args, result, f"dataset {args.name!r}: policy changed")
    return 0


def _names(values: list[str] | None) -> list[str]:
    """Node names from repeated and/or comma-separated options."""
    return [name for value in values or [] for name in value.split(",") if name]


# --- jobs, scaling, events (the coordinator's CacheManager) ------------------------------------


def _job_line(job: dict) -> str:
    if job["state"] == "suspended":
        return f"{job['id']}: suspended (position {job['position']}): {job['explanation']}"
    where = f"a new copy {job['copy']}" if job["cloned"] else f"copy {job['copy']}"
    return f"{job['id']}: running on {','.join(job['nodes'])} ({where})"


def cmd_job_submit(args) -> int:
    lease_s = parse_duration(args.lease) if args.lease is not None else None
    with _cluster_client(args) as client:
        job = client.submit_job(
            args.job,
            args.dataset,
            args.nodes,
            candidates=_names(args.candidates) or None,
            lease_s=lease_s,
        )
        waits = args.wait and job["state"] == "suspended"
        # The job exists from here on: a Ctrl-C, even before the wait begins, stops only the
        # waiting and says that the job stays queued.
        with _waiting(_still_queued(job)) if waits else contextlib.nullcontext():
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


def _still_queued(job: dict) -> str:
    """What goes on when the user stops waiting for a suspended job."""
    lease = job.get("lease_s")  # 0: held until released
    released = f"; released unless renewed within {lease:g} s" if lease else ""
    return (
        f"job {job['id']} stays queued for dataset {job['dataset']!r}{released}: "
        f"`cachefs job show {job['id']} --wait` waits again, "
        f"`cachefs job release {job['id']}` gives up its place"
    )


def _wait_for_promotion(client: CoordinatorClient, job: dict, *, quiet: bool) -> dict:
    """Long-poll until the job runs; each poll renews its lease."""
    while job["state"] == "suspended":
        job = client.job(job["id"], wait_s=30)
    if not quiet:
        print(f"{_job_line(job)}  (waited {job['waited_s']:.1f} s)")
    return job


def cmd_job_show(args) -> int:
    with _cluster_client(args) as client:
        job = client.job(args.job)
        if args.wait and job["state"] == "suspended":
            with _waiting(_still_queued(job)):
                job = _wait_for_promotion(client, job, quiet=True)
    if args.json:
        print(json.dumps(job, indent=2))
        return 0
    print(_job_line(job))
    print(f"  {job['explanation']}")
    for row in job["ranking"]:
        print(f"  {row['node']:<16} {row['why']}")
    return 0


def cmd_job_ls(args) -> int:
    with _cluster_client(args) as client:
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


def cmd_job_renew(args) -> int:
    with _cluster_client(args) as client:
        job = client.renew_job(args.job)
    _print_result(args, job, f"{args.job}: lease renewed ({job['lease_expires_in_s']} s left)")
    return 0


def cmd_job_release(args) -> int:
    with _cluster_client(args) as client:
        result = client.release_job(args.job)
    promoted = ", ".join(result["promoted"])
    summary = f"{args.job} released" + (f"; promoted {promoted}" if promoted else "")
    _print_result(args, result, summary)
    return 0


def cmd_scale(args) -> int:
    add, remove = _names(args.add), _names(args.remove)
    if not add and not remove:
        raise ConfigError("scale needs --add and/or --remove")
    with _cluster_client(args) as client:
        result = client.scale(args.dataset, args.copy, add=add, remove=remove)
    copy = next(c for c in result["copies"] if c["id"] == args.copy)
    summary = f"copy {args.copy} of {args.dataset}: {','.join(copy['nodes'])}"
    if "moved_shards" in result:
        summary += f"; {result['moved_shards']} shards change owner and are handed off"
    _print_result(args, result, summary)
    return 0


def cmd_events(args) -> int:
    with _cluster_client(args) as client:
        events = client.events(args.dataset, args.limit)
    if args.json:
        print(json.dumps(events, indent=2))
        return 0
    for event in events:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event["at"]))
        print(f"{at}  {event['kind']:<8} {event['message']}")
    return 0


def cmd_dataset_ls(args) -> int:
    cluster = _coordinator(args)
    if cluster is not None:
        with cluster:
            datasets = cluster.datasets()
    else:
        with ControlClient(args.state) as client:
            datasets = client.datasets()
    if args.json:
        print(json.dumps(datasets, indent=2))
    else:
        _print_datasets(datasets)
    return 0


def cmd_dataset_refresh(args) -> int:
    cluster = _coordinator(args)
    if cluster is not None:
        with cluster:
            result = cluster.refresh_dataset(args.name)
        _print_result(args, result, f"dataset {args.name!r}: workers are re-listing the source")
        return 0
    with ControlClient(args.state) as client:
        result = client.refresh_dataset(args.name)
    _print_result(
        args,
        result,
        f"dataset {args.name!r} refreshed "
        f"({result['changed']} changed, {result['removed']} removed)",
    )
    return 0


def cmd_dataset_rm(args) -> int:
    cluster = _coordinator(args)
    if cluster is not None:
        with cluster:
            result = cluster.remove_dataset(args.name)
        _print_result(args, result, f"dataset {args.name!r} removed; workers free its cache")
        return 0
    with ControlClient(args.state) as client:
        result = client.remove_dataset(args.name, keep_cache=args.keep_cache)
    _print_result(
        args, result, f"dataset {args.name!r} removed, {format_size(result['freed_bytes'])} freed"
    )
    return 0


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


def cmd_preload(args) -> int:
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
            with _waiting(goes_on):
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


def _preload_client(args) -> CoordinatorClient | ControlClient:
    """The coordinator's client in a cluster; else the local worker's (`cachefs up`), which
    runs preload jobs itself: the same calls, the same answers."""
    return _coordinator(args) or ControlClient(args.state)


def _warn_if_nothing_selected(job: dict) -> bool:
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


def _selection_text(job: dict) -> str:
    sel = job["selection"]
    what = ", ".join(sel["paths"]) or "everything"
    if sel.get("fraction") is not None:
        what += f", {100 * sel['fraction']:g}% of the bytes"
    if sel.get("bytes") is not None:
        what += f", {format_size(sel['bytes'])}"
    if sel.get("at"):
        what += f", from {time.strftime('%Y-%m-%d %H:%M', time.localtime(sel['at']))}"
    return what


def _preload_fraction(job: dict) -> float:
    total, done = job["bytes"], job["bytes_done"]
    return done / total if total else (1.0 if job["planned"] else 0.0)


def _progress_text(job: dict) -> str:
    """A preload job's progress in words: the bar's caption."""
    total, done = job["bytes"], job["bytes_done"]
    eta = f"ETA {job['eta_s']:.0f}s" if job.get("eta_s") is not None else ""
    planned = "" if job["planned"] else f" (planning {job['shards_reported']}/1024 shards)"
    return (
        f"{job['objects_done']}/{job['objects']} objects  "
        f"{format_size(done)}/{format_size(total)}  {format_size(int(job['rate_bytes_per_s']))}/s"
        f"  {eta}  failed {job['failed_count']}{planned}"
    )


def _progress_line(job: dict) -> str:
    fraction = _preload_fraction(job)
    bar = "#" * int(30 * fraction) + "-" * (30 - int(30 * fraction))
    return f"[{bar}] {100 * fraction:5.1f}%  {_progress_text(job)}"


def _scheduled_text(job: dict) -> str:
    at = time.localtime(job["selection"]["at"])
    return f"scheduled for {time.strftime('%Y-%m-%d %H:%M', at)}"


#: How often `preload --wait` asks for the job's progress, in seconds.
PRELOAD_POLL_S = 0.5


def _wait_for_preload(
    client: CoordinatorClient | ControlClient, dataset: str, *, json_output: bool
) -> dict:
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


def _preload_progress_bar(client: CoordinatorClient | ControlClient, dataset: str) -> dict:
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


def _print_preload(job: dict) -> None:
    print(f"preload {job['id']} of {job['dataset']}: {job['state']}  ({_selection_text(job)})")
    print(f"  {_progress_line(job)}")
    for failure in job["failed"]:
        print(f"  failed: {failure['key']} on {failure['node']}: {failure['reason']}")
    if job["failed_count"] > len(job["failed"]):
        print(f"  … {job['failed_count'] - len(job['failed'])} more failed")


def cmd_locality(args) -> int:
    with CoordinatorClient(
        _require_coordinator(args), find_token(args.token_file, args.state)
    ) as client:
        locality = client.locality(args.dataset)
    if args.json:
        print(json.dumps(locality, indent=2))
        return 0
    print(
        f"{locality['dataset']}: {format_size(locality['cached_bytes'])} of "
        f"{format_size(locality['bytes'])} cached ({_fraction(locality['fraction'])})"
    )
    print("NODE             STATE  CACHED        FRACTION  ADDRESS")
    for row in locality["nodes"]:
        print(
            f"{row['node']:<16} {row['state']:<6} {format_size(row['cached_bytes']):>10}"
            f"  {_fraction(row['fraction']):>9}  {row['address']}"
        )
    return 0


def cmd_nodes(args) -> int:
    with CoordinatorClient(
        _require_coordinator(args), find_token(args.token_file, args.state)
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
                f"  {_fraction(held['fraction'])}"
            )
    return 0


def cmd_stats(args) -> int:
    """A live view of the local worker, or with a coordinator of the whole cluster
    (cachefs/stats.py). Ctrl-C is how a live view ends: exit 130, nothing printed."""
    from cachefs import stats

    interval_s = parse_duration(args.interval)
    if interval_s <= 0:
        raise ConfigError(f"--interval must be more than 0, got {args.interval!r}")
    cluster = _coordinator(args)
    client = cluster or ControlClient(args.state)
    source = stats.ClusterSource(cluster) if cluster else stats.WorkerSource(client)
    with client:
        try:
            stats.run(source, interval_s=interval_s, once=args.once, json_output=args.json)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    return 0


def cmd_resolve(args) -> int:
    with ControlClient(args.state) as client:
        print(json.dumps(client.resolve(args.dataset, args.path), indent=2))
    return 0


def _print_result(args, result: dict, summary: str) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(summary)
    if "files" in result:
        _print_datasets([result])


def cmd_demo(args) -> int:
    from cachefs.demo import run_demo

    return run_demo(
        workdir=args.workdir, files=args.files, keep=args.keep, log_level=args.log_level
    )


def cmd_csi(args) -> int:
    from cachefs.csi import DRIVER_NAME
    from cachefs.csi.server import PluginConfig, run_until_signalled

    config = PluginConfig(
        endpoint=args.endpoint, node=args.node, state_dir=args.state, kubelet_dir=args.kubelet_dir
    )
    run_until_signalled(
        config,
        f"cachefs: CSI node plugin {DRIVER_NAME} for node {config.node} on {config.endpoint} "
        f"(worker state {config.state_dir}, targets under {config.kubelet_dir}/pods)",
    )
    return 0


def installed_version() -> str:
    """The version pip installed (the distribution's metadata), or ``cachefs.__version__``
    when run from a source tree that was never installed (``PYTHONPATH=. python -m cachefs``)."""
    from importlib.metadata import PackageNotFoundError, version

    from cachefs import __version__

    try:
        return version("cachefs")
    except PackageNotFoundError:
        return __version__


class _PrintVersion(argparse.Action):
    """``--version``. argparse's own version action wants the text when the parser is built;
    this one reads the metadata only when the flag is given."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
            help="print the version of cachefs and exit",
        )  # fmt: skip

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"cachefs {installed_version()}")
        parser.exit()


#: The shells `cachefs completion` writes a script for (shtab also does PowerShell: cachefs
#: runs on Linux only).
COMPLETION_SHELLS = ("bash", "zsh", "fish", "tcsh")
# Options whose values are paths, completed as directories or files by the shell.
_DIRECTORY_OPTIONS = {"state", "mount", "ram_dir", "workdir", "kubelet_dir"}
_FILE_OPTIONS = {"token_file", "credentials_file"}


def cmd_completion(args) -> int:
    """A static script generated by shtab from this very parser: the shell completes
    subcommands and options without starting Python at each TAB."""
    import shtab

    parser = build_parser()
    pending = [parser]
    while pending:
        for action in pending.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            elif action.dest in _DIRECTORY_OPTIONS:
                action.complete = shtab.DIRECTORY
            elif action.dest in _FILE_OPTIONS:
                action.complete = shtab.FILE
    print(shtab.complete(parser, shell=args.shell), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachefs", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--state",
        default=default_state_dir(),
        help="state directory: the worker's, or the coordinator's for `cachefs coordinator` "
        "(default $CACHEFS_STATE or /var/lib/cachefs)",
    )
    parser.add_argument(
        "--coordinator",
        help="coordinator URL (default $CACHEFS_COORDINATOR; none: single-node mode)",
    )
    parser.add_argument(
        "--token-file",
        help="a file holding the API token (default: $CACHEFS_TOKEN, which holds the token "
        "itself; else <state>/token, written by a coordinator)",
    )
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--version", action=_PrintVersion)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the worker and mount (foreground)")
    _add_worker_options(up)
    up.set_defaults(func=cmd_up)

    worker = sub.add_parser("worker", help="run a cluster worker that follows a coordinator")
    _add_worker_options(worker)
    worker.add_argument("--listen", required=True, help="HOST:PORT of this node's peer server")
    worker.add_argument("--gpus", type=int, default=8, help="GPUs of this node (for placement)")
    worker.add_argument("--heartbeat-interval", default="2s")
    worker.add_argument("--peer-timeout", default="2s", help="bound on one peer read")
    worker.add_argument("--preload-processes", type=int, default=2, help="fetcher processes")
    worker.set_defaults(func=cmd_worker)

    coord = sub.add_parser("coordinator", help="run the coordinator (foreground)")
    coord.add_argument("--listen", default="127.0.0.1:7700", help="HOST:PORT")
    coord.add_argument(
        "--store", help="state store: etcd://HOST:PORT[,…] (default: LMDB in --state)"
    )
    coord.add_argument("--heartbeat-interval", default="2s")
    coord.add_argument("--down-after", help="mark a node down after this long without heartbeats")
    coord.add_argument(
        "--job-lease", default="10m", help="release a job not renewed for this long (0: never)"
    )
    coord.add_argument(
        "--lru-high-watermark",
        type=float,
        default=0.9,
        help="lru cleanup frees datasets on a node whose cache is this full (0-1)",
    )
    coord.add_argument("--fill-timeout", default="1h", help="give up a clone fill or hand-off")
    coord.set_defaults(func=cmd_coordinator)

    _add_job_commands(sub)

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
    _add_other_commands(sub)
    _accept_global_options_anywhere(parser)
    return parser


GLOBAL_OPTIONS = ("--state", "--coordinator", "--token-file", "--log-level")


def _accept_global_options_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let `cachefs worker --coordinator URL …` and `cachefs coordinator --state DIR` work as
    well as `cachefs --state DIR coordinator`: every subcommand also accepts the global
    options, and a value given after the subcommand wins."""
    globals_ = [
        a for a in parser._actions if a.option_strings and a.option_strings[0] in GLOBAL_OPTIONS
    ]
    pending = [parser]
    while pending:
        for action in pending.pop()._actions:
            if not isinstance(action, argparse._SubParsersAction):
                continue
            for subparser in action.choices.values():
                known = {o for a in subparser._actions for o in a.option_strings}
                for option in globals_:
                    if option.option_strings[0] not in known:
                        subparser.add_argument(
                            *option.option_strings, dest=option.dest, help=option.help,
                            default=argparse.SUPPRESS,
                        )  # fmt: skip
                pending.append(subparser)


def _add_job_commands(sub) -> None:
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


def _add_worker_options(up: argparse.ArgumentParser) -> None:
    up.add_argument("--mount", default="/mnt/cachefs", help="mountpoint (default /mnt/cachefs)")
    up.add_argument("--ram", default="2GiB", help="RAM tier capacity (default 2GiB)")
    up.add_argument("--ram-dir", help="RAM tier directory on tmpfs (default /dev/shm/cachefs-*)")
    up.add_argument("--ram-reserve", default="0", help="RAM bytes never evicted")
    up.add_argument("--ssd", help="SSD tier as DIR:SIZE, e.g. /var/cache/cachefs:100GiB")
    up.add_argument("--ssd-reserve", default="0", help="SSD bytes never evicted")
    up.add_argument("--admission", choices=["avoid-eviction", "lru"], default="avoid-eviction")
    up.add_argument("--promote", action="store_true", help="copy SSD hits into RAM")
    up.add_argument("--entry-timeout", default="1h", help="kernel dentry cache time")
    up.add_argument("--attr-timeout", default="1h", help="kernel attribute cache time")
    up.add_argument("--max-tasks", type=int, default=64, help="concurrent FUSE requests")
    up.add_argument("--readahead", default="1MiB", help="kernel readahead of the mount (0: leave)")
    up.add_argument("--store-threads", type=int, default=32, help="concurrent store requests")
    up.add_argument(
        "--allow-other",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let users other than the worker's use the mount, as the mode bits allow (default "
        "on; --no-allow-other: only the worker's user)",
    )
    # These apply where the source records no owner: S3/OSS objects, the mount root.
    kept = "file:// datasets keep their source's"
    up.add_argument("--uid", help=f"owner of object-store entries (default: the worker's; {kept})")
    up.add_argument("--gid", help=f"group of object-store entries (default: the worker's; {kept})")
    up.add_argument(
        "--file-mode",
        help=f"octal mode of object-store files (default {DEFAULT_FILE_MODE:04o}; {kept})",
    )
    up.add_argument(
        "--dir-mode",
        help=f"octal mode of object-store directories (default {DEFAULT_DIR_MODE:04o}; {kept})",
    )
    up.add_argument(
        "--fuse-no-open",
        choices=["auto", "on", "off"],
        default="auto",
        help="FUSE no-open mode: the kernel stops sending OPEN/RELEASE and warm reads never "
        "reach Python (auto: on when the patched pyfuse3 of third_party/ is installed)",
    )
    up.add_argument(
        "--fuse-fast-read",
        choices=["auto", "on", "off"],
        default="auto",
        help="answer READs of RAM-tier blocks in C, in the patched pyfuse3, without Python "
        "(auto: on when that pyfuse3 is installed and no-open mode is on)",
    )
    up.add_argument(
        "--metrics",
        help="also serve /metrics on TCP at HOST:PORT, for Prometheus (default: only on the "
        "control socket, so that workers sharing a machine never share a port)",
    )
    up.add_argument("--node", help="node name (default: hostname)")


def _add_other_commands(sub) -> None:
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

    resolve = sub.add_parser("resolve", help="show a file's blocks and local block files")
    resolve.add_argument("dataset")
    resolve.add_argument("path")
    resolve.set_defaults(func=cmd_resolve)

    demo = sub.add_parser("demo", help="generate a dataset, serve it, read it, verify every byte")
    demo.add_argument("--workdir", default="/tmp/cachefs-demo")
    demo.add_argument("--files", type=int, default=2000)
    demo.add_argument("--keep", action="store_true", help="leave the worker running")
    demo.set_defaults(func=cmd_demo)

    csi = sub.add_parser(
        "csi", help="run the Kubernetes CSI node plugin: datasets as read-only volumes"
    )
    csi.add_argument("--endpoint", required=True, help="unix:///PATH of the plugin's socket")
    csi.add_argument("--node", required=True, help="this node's id (the Kubernetes node name)")
    csi.add_argument(
        "--kubelet-dir",
        default=DEFAULT_KUBELET_DIR,
        help="the kubelet's root directory: target paths outside its pods/ are refused "
        "(default %(default)s)",
    )
    csi.set_defaults(func=cmd_csi)

    completion = sub.add_parser(
        "completion",
        help='print a shell completion script (bash: eval "$(cachefs completion bash)")',
    )
    completion.add_argument("shell", choices=COMPLETION_SHELLS)
    completion.set_defaults(func=cmd_completion)


# --- the entry point: every failure is one line on stderr and an exit status -----------------

#: Exit statuses. 0: done; 2: a usage error (argparse's, with the usage); and:
EXIT_FAILED = 1  # refused or failed; one line on stderr says why
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); one line says what goes on without us
# The reader of our output went away (`cachefs … | head -1`): nothing more is printed, and the
# status is a shell's for a command SIGPIPE ended (128 + 13), so `set -o pipefail` scripts see
# cachefs as they see `yes | head -1`.
EXIT_BROKEN_PIPE = 141

#: Request fields the worker or the coordinator may refuse, as the CLI's options that set them
#: (the others are spelled as their option: max_jobs_per_copy is --max-jobs-per-copy).
OPTION_OF_FIELD = {
    "timeout_s": "--timeout",
    "first_byte_timeout_s": "--first-byte-timeout",
    "refresh_interval_s": "--refresh-every",
    "lease_s": "--lease",
    "id": "JOB",
    "name": "NAME",
    "uri": "URI",
}


class StoppedWaiting(Exception):
    """Ctrl-C while the CLI waited on work that goes on without it; ``str()`` says what goes
    on and how to look at it again."""


@contextlib.contextmanager
def _waiting(what_goes_on: str):
    """Ctrl-C inside becomes :class:`StoppedWaiting` (``main`` prints it and exits 130)."""
    try:
        yield
    except KeyboardInterrupt:
        raise StoppedWaiting(what_goes_on) from None


def _option_of(field: InvalidField) -> str:
    if field.where == "path":  # a positional argument: DATASET, JOB, NAME
        return field.field.upper()
    return OPTION_OF_FIELD.get(field.field) or "--" + field.field.replace("_", "-")


def _error_line(exc: Exception) -> str:
    """The one line a failure prints (after "cachefs: ")."""
    inner = getattr(exc, "exceptions", None)  # an exception group: trio wraps what tasks raise
    if isinstance(inner, tuple) and len(inner) == 1:
        return _error_line(inner[0])
    if isinstance(exc, ControlError) and exc.invalid:
        return "error: " + "; ".join(field.describe(_option_of(field)) for field in exc.invalid)
    if isinstance(exc, CachefsError):
        return f"error: {one_line(str(exc))}"
    log.debug("unexpected error", exc_info=exc)
    return (
        f"unexpected error: {type(exc).__name__}: {one_line(str(exc), 300)} "
        "(--log-level DEBUG shows where)"
    )


def _quiet_after_broken_pipe() -> int:
    """Python flushes stdout once more at exit, which would fail again with a traceback: point
    the descriptor at /dev/null first (the recipe of Python's `signal` documentation)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control call is noise
    try:
        status = args.func(args)
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return status
    except BrokenPipeError:
        return _quiet_after_broken_pipe()
    except StoppedWaiting as exc:
        newline = "\n" if sys.stderr.isatty() else ""  # after a progress bar's line
        print(f"{newline}cachefs: stopped waiting; {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print("cachefs: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the one place a failure becomes a line
        print(f"cachefs: {_error_line(exc)}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
