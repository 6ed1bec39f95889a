"""What a peer read costs the reading worker: CPU per block in ``PeerClient``, against an owner
that costs nothing to ask.

    .venv/bin/python -m bench.peer_client_cost [--blocks 20000] [--concurrency 16] [--rounds 3]
                                               [--block-bytes 110000] [--json PATH]

The reading side of a peer read, alone: one trio process runs ``--concurrency`` tasks that
each call ``PeerClient.get_block`` in a loop, ``--blocks`` blocks in all, over one real TCP
connection on loopback (127.0.0.9) to a stub owner in another process. The stub speaks the
block protocol (cachefs/peer/wire.py) and answers every request with the same pre-encoded
``--block-bytes`` block and its chunk checksums, from one thread: it does no lookup and no
file read, so the figure is the client's own — framing, the socket reads and writes, trio's
scheduling, the length and checksum check. Every block returned is checked for its length.
The client keeps the worker's default timeout (``--peer-timeout``, 2 s): each request's cancel
scope is a deadline in trio's heap for that long, which is part of the cost.

The client is pinned to CPU 0 and the stub to CPU 1 (where there are two), so each round's CPU
time (``time.process_time`` of the client) is its own. Prints JSON, then a table: per round,
client CPU per block and blocks/s. To compare two commits, run it from a worktree of each, in
turns (the machine's speed drifts between minutes).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import socket
import sys
import threading
import time

import trio

from cachefs.cache.base import CHUNK_SIZE, chunk_checksums
from cachefs.peer import wire
from cachefs.peer.base import BlockRequest
from cachefs.peer.client import open_peer_client

HOST = "127.0.0.9"
TOKEN = "peer-client-cost"


def _pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})


def stub_owner(port_queue: multiprocessing.Queue, block_bytes: int) -> None:
    """Accept connections; answer every block request with the same block (a process)."""
    _pin(1)
    listener = socket.socket()
    listener.bind((HOST, 0))
    listener.listen(16)
    port_queue.put(listener.getsockname()[1])
    block = os.urandom(block_bytes)
    sums = chunk_checksums(block, chunk_size=CHUNK_SIZE)

    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as incoming:
            _magic, _version, token_len = wire.HELLO.unpack(incoming.read(wire.HELLO.size))
            incoming.read(token_len)
            conn.sendall(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, wire.HELLO_OK))
            while len(head := incoming.read(wire.REQUEST.size)) == wire.REQUEST.size:
                incoming.read(wire.request_names_length(head))
                request_id = wire.REQUEST.unpack(head)[0]
                answer = wire.encode_answer(request_id, wire.OK, CHUNK_SIZE, sums, block_bytes)
                conn.sendall(answer + block)

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


async def one_round(address: str, blocks: int, concurrency: int, block_bytes: int) -> dict:
    request = BlockRequest("bench", "object", "etag", block_bytes, 0, max(block_bytes, 4096))
    async with open_peer_client(TOKEN) as client:  # the worker's default timeout (2 s)
        await client.get_block(address, request)  # connect and shake hands outside the clock
        cpu_before, wall_before = time.process_time(), time.perf_counter()

        async def reader(count: int) -> None:
            for _ in range(count):
                if len(await client.get_block(address, request)) != block_bytes:
                    raise AssertionError("a block of the wrong length")

        async with trio.open_nursery() as nursery:
            for share in range(concurrency):
                nursery.start_soon(reader, blocks // concurrency + (share < blocks % concurrency))
        cpu = time.process_time() - cpu_before
        wall = time.perf_counter() - wall_before
    return {
        "blocks": blocks,
        "client_cpu_us_per_block": 1e6 * cpu / blocks,
        "blocks_per_s": blocks / wall,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-bytes", type=int, default=110_000)
    parser.add_argument("--json", help="also write the JSON here")
    args = parser.parse_args(argv)
    ports: multiprocessing.Queue = multiprocessing.Queue()
    owner = multiprocessing.Process(target=stub_owner, args=(ports, args.block_bytes), daemon=True)
    owner.start()
    try:
        address = f"{HOST}:{ports.get(timeout=30)}"
        _pin(0)
        rounds = [
            trio.run(one_round, address, args.blocks, args.concurrency, args.block_bytes)
            for _ in range(args.rounds)
        ]
    finally:
        owner.kill()
        owner.join()
    results = {
        "benchmark": "peer_client_cost",
        "command": "python -m bench.peer_client_cost "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} cores, {platform.platform()}, Python "
        f"{platform.python_version()}",
        "concurrency": args.concurrency,
        "block_bytes": args.block_bytes,
        "rounds": rounds,
    }
    print(json.dumps(results, indent=2))
    print("\n| round | blocks | client CPU per block | blocks/s |\n|---:|---:|---:|---:|")
    for number, one in enumerate(rounds, 1):
        print(
            f"| {number} | {one['blocks']:,} | {one['client_cpu_us_per_block']:.1f} µs "
            f"| {one['blocks_per_s']:,.0f} |"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return results


if __name__ == "__main__":
    main()
