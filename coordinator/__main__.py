"""`python -m coordinator placement`: serve the placement endpoint (POST /v1/placement).

Until the coordinator service exists, locality comes live from local cachefs workers' control
sockets (``--worker-state``), or from a URL serving the locality document (``--locality-url``).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coordinator")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("placement", help="serve POST /v1/placement")
    serve.add_argument("--listen", default="127.0.0.1:7710", help="HOST:PORT")
    where = serve.add_mutually_exclusive_group(required=True)
    where.add_argument("--worker-state", action="append", help="a worker's state dir (repeat)")
    where.add_argument("--locality-url", help="URL of a locality document")
    serve.add_argument("--gpus-per-node", type=int, default=8, help="with --worker-state")
    args = parser.parse_args(argv)

    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve as hypercorn_serve

    from coordinator.app import create_app
    from coordinator.scheduling.sources import HttpSource, InMemorySource, WorkerSource

    source: InMemorySource
    if args.worker_state:
        source = WorkerSource(args.worker_state, gpus_per_node=args.gpus_per_node)
    else:
        source = HttpSource(args.locality_url)
    config = Config()
    config.bind = [args.listen]
    config.accesslog = None
    print(f"placement endpoint on http://{args.listen}/v1/placement", file=sys.stderr)
    app = create_app(source, source)
    # hypercorn types its app as its own ASGI callable, narrower than Starlette's signature.
    trio.run(partial(hypercorn_serve, app, config))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
