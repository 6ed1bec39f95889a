"""The benchmark suite's one command.

    python -m bench all                    # the default preset (~1 h here): bench/results/<date>/
    python -m bench all --preset quick     # a few minutes: bench/results/<date>-quick/
    python -m bench report DIR             # render DIR/results.json again (markdown + plots)

Run as root from the repository root, with the `.venv` of scripts/setup.sh (it has the patched
pyfuse3 and matplotlib). See bench/README.md for what each part measures. The single benchmarks
stay runnable on their own: ``python -m bench.read_bench``, ``bench.cluster_bench``,
``bench.jobs_bench``, ``bench.emulator``, ``bench.sim``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
from collections.abc import Sequence

from bench.read_bench import run_and_report
from bench.suite import report
from bench.suite.presets import PRESETS
from cachefs.units import parse_size

PARTS = ("small", "large", "metadata", "emulator", "thrash", "multinode", "s3fs", "rclone")


def default_out_dir(preset: str, *, partial: bool = False, root: str = "bench/results") -> str:
    """``<root>/<date>[-<preset>][-partial]``, with ``-2``, ``-3``, ... added rather than
    overwrite an earlier run's results (a quick look at one workload must never replace the
    committed run of the day)."""
    name = datetime.date.today().isoformat()
    name += "" if preset == "default" else f"-{preset}"
    name += "-partial" if partial else ""
    path, n = os.path.join(root, name), 1
    while os.path.exists(os.path.join(path, "results.json")):
        n += 1
        path = os.path.join(root, f"{name}-{n}")
    return path


def write_report(results: dict, out_dir: str) -> list[str]:
    """results.json, report.md and the plots in ``out_dir``; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    with open(json_path, "w") as out:
        json.dump(results, out, indent=1)
        out.write("\n")
    plots = report.write_plots(results, out_dir)
    md_path = os.path.join(out_dir, "report.md")
    with open(md_path, "w") as out:
        out.write(report.render_markdown(results, plots))
    written = [json_path, md_path, *plots]
    if results.get("multinode"):
        from bench.cluster_bench import render_markdown as render_cluster

        cluster_path = os.path.join(out_dir, "cluster_bench.md")
        with open(cluster_path, "w") as out:
            out.write(render_cluster(results["multinode"]))
        written.append(cluster_path)
    return written


def _parts(text: str) -> list[str]:
    parts = [p for p in text.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    return parts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench all",
        description="Run every benchmark side by side and write the report.",
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--out", help="results directory (default bench/results/<date>[-preset])")
    parser.add_argument("--workdir", default="/tmp/cachefs-bench-suite", help="logs, mounts")
    parser.add_argument(
        "--local-root", default="/dev/shm/cachefs-bench-suite", help="the tmpfs copy of the data"
    )
    parser.add_argument("--first-byte-ms", type=float, default=20.0, help="store latency")
    parser.add_argument(
        "--bandwidth", type=parse_size, default=parse_size("64MiB"), help="per connection, /s"
    )
    parser.add_argument(
        "--s3-range", type=parse_size, default=parse_size("8MiB"), help="boto3 large-file GETs"
    )
    parser.add_argument("--skip", type=_parts, default=[], help=f"comma list of {PARTS}")
    parser.add_argument("--cachefs-args", default="", help="extra `cachefs worker` options")
    parser.add_argument(
        "--preload-processes", type=int, default=4, help="cachefs fetcher processes (preload)"
    )
    parser.add_argument("--seed", type=int, default=0, help="data seed")
    parser.add_argument("--order-seed", type=int, default=1, help="shuffled read order seed")
    parser.add_argument("--quiet-cpu", type=float, default=0.3, help="start a timed run at...")
    parser.add_argument("--quiet-wait", type=float, default=10.0, help="...or after this many s")
    parser.add_argument("--keep-data", action="store_true", help="keep the tmpfs copy at the end")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"] and len(argv) == 2:
        with open(os.path.join(argv[1], "results.json")) as saved:
            for path in write_report(json.load(saved), argv[1]):
                print(f"wrote {path}")
        return 0
    if argv[:1] != ["all"]:
        print(__doc__, file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv[1:])
    args.argv = argv[1:]
    out_dir = args.out or default_out_dir(args.preset, partial=bool(args.skip))

    def run(args: argparse.Namespace) -> dict:
        from bench.suite.run import run_suite  # imports boto3, the peers...: only when running

        try:
            return run_suite(args)
        finally:
            if not args.keep_data:
                shutil.rmtree(args.local_root, ignore_errors=True)

    def render(results: dict) -> str:
        """Called once, after the run: write the files, show the markdown report."""
        written = write_report(results, out_dir)
        with open(os.path.join(out_dir, "report.md")) as page:
            text = page.read()
        return text + "\n".join(f"wrote {path}" for path in written)

    # The JSON goes to stdout (no --json), the report to stderr, the files to out_dir.
    args.json, args.save_dir = None, None
    return run_and_report("bench all", args, run, render)


if __name__ == "__main__":
    sys.exit(main())
