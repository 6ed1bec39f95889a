"""The `cachefs` command line.

    cachefs up --mount /mnt/cachefs --ram 8GiB --ssd /var/cache/cachefs:100GiB
    cachefs dataset add imagenet s3://bucket/imagenet --endpoint http://127.0.0.1:9000
    cachefs status | dataset ls | dataset refresh NAME | dataset rm NAME | down
    cachefs demo      # everything above on a generated dataset, no cloud account needed

Every command but `up` talks to the running worker through its control socket, found from
--state / CACHEFS_STATE (default /var/lib/cachefs as root).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from cachefs.client import ControlClient, ControlError, WorkerNotRunning, default_state_dir
from cachefs.errors import CachefsError, ConfigError
from cachefs.protocol import DEFAULT_BLOCK_SIZE
from cachefs.units import format_size, parse_duration, parse_size


def _parse_ssd(text: str) -> tuple[str, int]:
    path, sep, size = text.rpartition(":")
    if not sep or not path:
        raise ConfigError(f"--ssd wants DIR:SIZE (e.g. /var/cache/cachefs:100GiB), got {text!r}")
    return path, parse_size(size)


def cmd_up(args) -> int:
    import trio

    from cachefs.fs.blocks import ReadLimits
    from cachefs.worker import Worker, WorkerConfig

    ssd_dir, ssd_capacity = _parse_ssd(args.ssd) if args.ssd else (None, 0)
    config = WorkerConfig(
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
        allow_other=not args.no_allow_other,
        no_open={"auto": None, "on": True, "off": False}[args.fuse_no_open],
        metrics_listen=None if args.metrics == "off" else args.metrics,
        limits=ReadLimits(store_threads=args.store_threads),
        **({"node": args.node} if args.node else {}),
    )
    print(
        f"cachefs: serving {config.mountpoint} (state {config.state_dir}); "
        "Ctrl-C or `cachefs down` to stop",
        file=sys.stderr,
    )
    trio.run(Worker(config).run)
    return 0


def cmd_down(args) -> int:
    with ControlClient(args.state) as client:
        try:
            client.shutdown()
        except WorkerNotRunning:
            print("cachefs: no worker running", file=sys.stderr)
            return 0
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            if not client.is_running():
                print("cachefs: worker stopped, mount removed, cache kept")
                return 0
            time.sleep(0.1)
    print(f"cachefs: worker still running after {args.timeout:.0f}s", file=sys.stderr)
    return 1


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
    cache = status["cache"]
    print(
        f"cache: {cache['admitted']} admitted, {cache['refused']} refused, "
        f"{cache['evicted']} evicted, {cache['corrupt']} corrupt dropped"
    )
    _print_datasets(status["datasets"])
    return 0


def _print_datasets(datasets: list[dict]) -> None:
    print("\nDATASET          FILES      SIZE        CACHED            SKIPPED  SOURCE")
    for ds in datasets:
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
        "refresh_interval_s": parse_duration(args.refresh_every) if args.refresh_every else None,
    }
    with ControlClient(args.state) as client:
        result = client.add_dataset(spec)
    _print_result(args, result, f"dataset {args.name!r} added")
    return 0


def cmd_dataset_ls(args) -> int:
    with ControlClient(args.state) as client:
        datasets = client.datasets()
    if args.json:
        print(json.dumps(datasets, indent=2))
    else:
        _print_datasets(datasets)
    return 0


def cmd_dataset_refresh(args) -> int:
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
    with ControlClient(args.state) as client:
        result = client.remove_dataset(args.name, keep_cache=args.keep_cache)
    _print_result(
        args, result, f"dataset {args.name!r} removed, {format_size(result['freed_bytes'])} freed"
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cachefs", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--state",
        default=default_state_dir(),
        help="state directory of the worker (default $CACHEFS_STATE or /var/lib/cachefs)",
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run the worker and mount (foreground)")
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
    up.add_argument("--no-allow-other", action="store_true", help="only root may read the mount")
    up.add_argument(
        "--fuse-no-open",
        choices=["auto", "on", "off"],
        default="auto",
        help="FUSE no-open mode: the kernel stops sending OPEN/RELEASE and warm reads never "
        "reach Python (auto: on when the patched pyfuse3 of third_party/ is installed)",
    )
    up.add_argument("--metrics", default="127.0.0.1:9464", help="HOST:PORT for /metrics, or off")
    up.add_argument("--node", help="node name (default: hostname)")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop the worker and unmount (cache kept)")
    down.add_argument("--timeout", type=float, default=30.0)
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="tiers, datasets, hit ratio")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

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
    add.add_argument("--timeout", default="30s", help="per store request")
    add.add_argument("--refresh-every", help="refresh the snapshot periodically, e.g. 1h")
    add.add_argument("--json", action="store_true")
    add.set_defaults(func=cmd_dataset_add)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control call is noise
    try:
        return args.func(args)
    except (CachefsError, ControlError) as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
