"""``python -m coordinator.scaler``: run the CacheScaler (see :mod:`coordinator.scaler`)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

from cachefs.client import CoordinatorClient, coordinator_url, find_token
from cachefs.errors import CachefsError, ConfigError
from cachefs.units import parse_duration

from .controller import Settings

if TYPE_CHECKING:
    from kubernetes.client import CoreV1Api


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a ratio in [0, 1]")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m coordinator.scaler",
        description="Scale cachefs copies from Kubernetes pod events and the cache used ratio.",
    )
    parser.add_argument("--coordinator", help="coordinator URL (default $CACHEFS_COORDINATOR)")
    parser.add_argument("--token-file", help="API token file (default $CACHEFS_TOKEN)")
    parser.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch training pods in this namespace (repeat; default: all namespaces)",
    )
    parser.add_argument(
        "--metric-high",
        type=_ratio,
        default=0.9,
        help="scale out when the used ratio stays above this (default 0.9)",
    )
    parser.add_argument(
        "--metric-low",
        type=_ratio,
        default=0.5,
        help="scale in when the used ratio stays below this (default 0.5)",
    )
    parser.add_argument(
        "--metric-window",
        type=_duration,
        default=300.0,
        help="how long the ratio must stay there (default 5m)",
    )
    parser.add_argument(
        "--metric-interval",
        type=_duration,
        default=30.0,
        help="how often to sample the ratio (default 30s)",
    )
    parser.add_argument(
        "--metric-cooldown",
        type=_duration,
        default=None,
        help="after a metric action, samples do not count for this long (default: the window)",
    )
    parser.add_argument("--min-nodes", type=int, default=1, help="never shrink a copy below this")
    parser.add_argument("--max-nodes", type=int, default=None, help="never grow a copy past this")
    parser.add_argument(
        "--release-grace",
        type=_duration,
        default=60.0,
        help="a node without training pods leaves the copy after this (60s)",
    )
    parser.add_argument(
        "--resync", type=_duration, default=10.0, help="reconcile at least this often (default 10s)"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="log what would change, change nothing"
    )
    parser.add_argument(
        "--kubeconfig", help="kubeconfig file (default: the in-cluster service account)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    if args.metric_low >= args.metric_high:
        parser.error("--metric-low must be below --metric-high")
    if args.min_nodes < 1:
        parser.error("--min-nodes must be at least 1 (a copy cannot be empty)")
    if args.max_nodes is not None and args.max_nodes < args.min_nodes:
        parser.error("--max-nodes must be at least --min-nodes")
    return args


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings(
        namespaces=tuple(dict.fromkeys(args.namespace)),
        metric_high=args.metric_high,
        metric_low=args.metric_low,
        metric_window_s=args.metric_window,
        metric_interval_s=args.metric_interval,
        metric_cooldown_s=(
            args.metric_window if args.metric_cooldown is None else args.metric_cooldown
        ),
        min_nodes=args.min_nodes,
        max_nodes=args.max_nodes,
        release_grace_s=args.release_grace,
        resync_s=args.resync,
        dry_run=args.dry_run,
    )


def kubernetes_api(kubeconfig: str | None) -> CoreV1Api:
    """A CoreV1Api: from ``kubeconfig`` if given, else the pod's service account."""
    from kubernetes import client, config

    configuration = client.Configuration()
    # kubernetes ships no type information: its loaders are untyped to mypy.
    if kubeconfig:
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, client_configuration=configuration
        )
    else:
        config.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=configuration
        )
    return client.CoreV1Api(client.ApiClient(configuration))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per coordinator request
    try:
        url = coordinator_url(args.coordinator)
        if url is None:
            raise ConfigError("no coordinator: pass --coordinator URL or set CACHEFS_COORDINATOR")
        token = find_token(args.token_file)
        if token is None:
            raise ConfigError("no API token: pass --token-file or set CACHEFS_TOKEN")
        from kubernetes.config import ConfigException

        try:
            core = kubernetes_api(args.kubeconfig)
        except ConfigException as exc:
            raise ConfigError(f"no Kubernetes configuration: {exc}") from None
    except CachefsError as exc:
        print(f"cachefs scaler: {exc}", file=sys.stderr)
        return 2

    from .controller import Scaler

    with CoordinatorClient(url, token) as coordinator:
        scaler = Scaler(core, coordinator, settings_from(args))

        def _stop(signum: int, _frame: FrameType | None) -> None:
            logging.getLogger("coordinator.scaler").info(
                "received %s, stopping", signal.Signals(signum).name
            )
            scaler.stop()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        scaler.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
