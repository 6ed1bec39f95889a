"""What the command groups share: exit statuses, finding the coordinator, waiting that Ctrl-C
stops, and the dataset table that `cachefs status` and `cachefs dataset` print."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from typing import Any

from cachefs.client import CoordinatorClient, coordinator_url, find_token
from cachefs.errors import ConfigError
from cachefs.units import format_size

#: Exit statuses. 0: done; 2: a usage error (argparse's, with the usage); and:
EXIT_FAILED = 1  # refused or failed; one line on stderr says why
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT); one line says what goes on without us


class StoppedWaiting(Exception):
    """Ctrl-C while the CLI waited on work that goes on without it; ``str()`` says what goes
    on and how to look at it again."""


@contextlib.contextmanager
def waiting(what_goes_on: str) -> Iterator[None]:
    """Ctrl-C inside becomes :class:`StoppedWaiting` (``main`` prints it and exits 130)."""
    try:
        yield
    except KeyboardInterrupt:
        raise StoppedWaiting(what_goes_on) from None


def require_coordinator(args: argparse.Namespace) -> str:
    url = coordinator_url(args.coordinator)
    if not url:
        raise ConfigError("no coordinator: pass --coordinator URL or set CACHEFS_COORDINATOR")
    return url


def cluster_client(args: argparse.Namespace) -> CoordinatorClient:
    return CoordinatorClient(require_coordinator(args), find_token(args.token_file, args.state))


def coordinator_if_any(args: argparse.Namespace) -> CoordinatorClient | None:
    """A client of the coordinator when one is configured; None in single-node mode."""
    url = coordinator_url(args.coordinator)
    if not url:
        return None
    return CoordinatorClient(url, find_token(args.token_file, args.state))


def names(values: list[str] | None) -> list[str]:
    """Node names from repeated and/or comma-separated options."""
    return [name for value in values or [] for name in value.split(",") if name]


def fraction_text(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def print_result(args: argparse.Namespace, result: dict[str, Any], summary: str) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(summary)
    if "files" in result:
        print_datasets([result])


def print_datasets(datasets: list[dict[str, Any]]) -> None:
    print("\nDATASET          FILES      SIZE        CACHED            SKIPPED  SOURCE")
    for ds in datasets:
        if "copies" in ds:  # the coordinator's view of a dataset
            cached = f"{format_size(ds['cached_bytes'])} {fraction_text(ds['cached_fraction'])}"
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
                    f"{c['running_jobs']} jobs, cache {fraction_text(c['used_ratio'])} used{fill}"
                )
            continue
        if ds["state"] != "ready":
            print(f"{ds['name']:<16} ({ds['state']}: {ds.get('error')})  {ds['uri']}")
            continue
        cached = f"{format_size(ds['cached_bytes'])} {fraction_text(ds['cached_fraction'])}"
        print(
            f"{ds['name']:<16} {ds['files']:>9} {format_size(ds['bytes']):>10}"
            f"  {cached:<17} {ds['skipped_total']:>7}  {ds['uri']}"
        )
        if ds["skipped_total"]:
            reasons = ", ".join(f"{k} {v}" for k, v in ds["skipped"].items())
            print(f"{'':16}   skipped keys: {reasons}; e.g. {', '.join(ds['skipped_samples'][:3])}")
