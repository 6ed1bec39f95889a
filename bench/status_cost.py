"""What one `cachefs status` costs the worker: a fresh worker (no dataset), ``--calls`` status
requests through its control API, the worker's user + system CPU per request.

    python -m bench.status_cost [--calls 300] [--json FILE]

`cachefs stats` asks once a second, the benchmarks' observers between passes; the request is
answered on the FUSE loop, so what it costs is time no FUSE request is served.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

from harness.processes import WorkerProcess, cpu_seconds


def measure(calls: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="cachefs-status-cost-") as directory:
        worker = WorkerProcess(directory, ram_dir=os.path.join(directory, "ram")).start()
        try:
            assert worker.proc is not None
            for _ in range(20):  # warm: imports, first-call caches
                frozen = worker.client.status()["gc"]["frozen_objects"]
            cpu_before, started = cpu_seconds(worker.proc.pid), time.perf_counter()
            for _ in range(calls):
                worker.client.status()
            cpu = cpu_seconds(worker.proc.pid) - cpu_before
            wall = time.perf_counter() - started
        finally:
            worker.stop()
    return {
        "calls": calls,
        "frozen_objects": frozen,
        "worker_cpu_ms_per_status": round(1000 * cpu / calls, 3),
        "wall_ms_per_status": round(1000 * wall / calls, 3),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.release()}",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = measure(args.calls)
    print(json.dumps(result, indent=2))
    print("| status requests | frozen objects | worker CPU per status | wall per status |")
    print("|---:|---:|---:|---:|")
    print(
        f"| {result['calls']} | {result['frozen_objects']:,} | "
        f"{result['worker_cpu_ms_per_status']} ms | {result['wall_ms_per_status']} ms |"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)


if __name__ == "__main__":
    main()
