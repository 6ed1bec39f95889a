"""Peer READs sent from C by the reader (cachefs/fs/native_peer_reads.py, "peer reads" in
cachefs_fast_read.c) when the owner misbehaves: a real coordinator, two real workers, a real S3
endpoint (moto) behind the fault proxy. The owner n2 is killed once n1 has read from it, and its
peer address taken over by a fake owner in this process, which speaks the block protocol's handshake
and then answers every request in one wrong way (the coordinator is told to wait an hour before
marking n2 down, so n1 keeps routing n2's shards to the fake). Every read through n1's mount
must still return the uploaded bytes, from the store, and the READs must have been sent from C.
With ``--fuse-processes 2`` the same holds of the READs the serving process sends on the
connections the worker handed it (cachefs/fs/serving.py), and the serving processes' first:
they answer peer READs from C too.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import socket
import threading
from collections.abc import Callable

import pytest

from cachefs.cache.base import CHUNK_SIZE, chunk_checksums
from cachefs.fs.fuse_ops import CLONES_SUPPORTED, PEER_READS_SUPPORTED
from cachefs.peer import wire
from tests.cluster_process import Cluster, read_all, wait_for
from tests.e2e.fs.test_native_reads import cli_status_text
from tests.worker_process import drop_page_cache

pytestmark = pytest.mark.skipif(
    not PEER_READS_SUPPORTED, reason="needs the patched pyfuse3 (peer reads sent from C)"
)

BLOCK = 256 << 10


def _files() -> dict[str, bytes]:
    rng = random.Random(11)
    return {f"d/f{i}.bin": rng.randbytes(rng.randint(1, 100_000)) for i in range(40)}


def _answer_ok(request_id: int, data: bytes, sums: bytes | None = None) -> bytes:
    sums = chunk_checksums(data) if sums is None else sums
    return wire.encode_answer(request_id, wire.OK, CHUNK_SIZE, sums, len(data)) + data


#: What the fake owner sends for a request (its id and the block's length), or None: nothing.
ANSWERS: dict[str, Callable[[int, int], bytes | None]] = {
    "wrong-checksum": lambda rid, n: _answer_ok(rid, bytes(n), sums=bytes(8 * -(-n // CHUNK_SIZE))),
    "wrong-length": lambda rid, n: _answer_ok(rid, bytes(n + 1)),
    "garbage": lambda rid, n: b"\xff" * wire.ANSWER.size,
    "refused": lambda rid, n: wire.encode_refusal(rid, wire.NOT_CACHED),
    "silent": lambda rid, n: None,
    "half-then-hangup": lambda rid, n: _answer_ok(rid, bytes(n))[: wire.ANSWER.size + 8],
}


class FakeOwner:
    """Listens on ``address``; on each connection: the handshake, then ``answer`` for every
    request frame. Counts the requests it was sent."""

    def __init__(self, address: str, answer: Callable[[int, int], bytes | None]):
        host, _, port = address.rpartition(":")
        self._listener = socket.create_server((host, int(port)))
        self._answer = answer
        self.requests = 0
        self._stopped = False
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                _, _, token_len = wire.HELLO.unpack(_exactly(conn, wire.HELLO.size))
                _exactly(conn, token_len)
                conn.sendall(wire.WELCOME.pack(wire.MAGIC, wire.VERSION, wire.HELLO_OK))
                while True:
                    head = _exactly(conn, wire.REQUEST.size)
                    names = _exactly(conn, wire.request_names_length(head))
                    request_id, request = wire.decode_request(head, names)
                    self.requests += 1
                    answer = self._answer(request_id, request.length)
                    if answer is not None:
                        conn.sendall(answer)
                        if answer[4:5] != bytes([wire.NOT_CACHED]):
                            return  # a broken answer: hang up after it (what a bad owner does)
            except (OSError, EOFError):
                return

    def close(self) -> None:
        self._stopped = True
        self._listener.close()
        for conn in self._connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _exactly(conn: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        more = conn.recv(count - len(data))
        if not more:
            raise EOFError
        data += more
    return data


SERVING_PROCESSES = [
    1,
    pytest.param(2, marks=pytest.mark.skipif(not CLONES_SUPPORTED, reason="no clones")),
]


def _connections(status: dict) -> int:
    """The reader's connections to owners: the worker's and its serving processes'."""
    serving = status.get("fuse_processes") or {}
    return status["peers"]["native_connections"] + serving.get("peer_connections", 0)


@pytest.mark.parametrize("processes", SERVING_PROCESSES)
@pytest.mark.parametrize("misbehaviour", list(ANSWERS))
def test_a_misbehaving_owner_costs_readers_no_error_and_no_wrong_byte(
    tmp_path, moto_s3, fault_proxy, misbehaviour, processes
):
    files = _files()
    bucket = moto_s3.make_bucket()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    cluster = Cluster(
        str(tmp_path / "c"),
        2,
        coordinator_args=("--down-after", "3600s"),
        worker_args=("--fuse-processes", str(processes)),
    )
    try:
        cluster.start()
        cluster.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        reader, owner = cluster.workers

        problems: list[str] = []

        def read_from_the_owner() -> bool:
            problems.extend(read_all(reader.mount, files))  # every pass byte-exact
            requests = reader.status()["peers"]["requests"]
            return requests.get("ok", 0) + requests.get("native_ok", 0) > 0

        # n1 knows n2 owns some files once it has read one from it.
        wait_for(read_from_the_owner, "peer reads")
        assert problems == []
        owner.kill9()
        # Its connections ended with nothing pending: n2 is not cooled down for that.
        wait_for(lambda: _connections(reader.status()) == 0, "connections gone")
        fake = FakeOwner(owner.address, ANSWERS[misbehaviour])
        try:
            drop_page_cache()
            os.listdir(os.path.join(reader.mount, "ds", "d"))  # routes n2's files to the fake
            # One for the worker, one for each serving process (given before the routes).
            wait_for(lambda: _connections(reader.status()) == processes, "the connections")
            before = reader.status()
            assert read_all(reader.mount, files) == []  # byte-exact, no error
        finally:
            fake.close()
        after = reader.status()
        native = {k: after["fuse_fast_read"][k] - before["fuse_fast_read"][k] for k in (
            "peer_sent", "peer_reads", "peer_handbacks", "peer_refused")}  # fmt: skip
        assert native["peer_sent"] > 0, native  # READs were sent from C ...
        assert native["peer_reads"] == 0, native  # ... none answered from a bad answer ...
        assert native["peer_handbacks"] == native["peer_sent"], native  # ... all to Python
        assert fake.requests >= native["peer_sent"]
        served = after["reads"]["bytes_served"]["store"] - before["reads"]["bytes_served"]["store"]
        assert served > 0  # what the fake owns came from the store
        if misbehaviour == "refused":  # a refusal drops the route, the owner is not cooled down
            assert native["peer_refused"] == native["peer_handbacks"]
        else:  # a fault or a timeout closes the connection and cools the owner down
            assert native["peer_refused"] == 0
            assert _connections(after) == 0
    finally:
        cluster.cleanup()


@pytest.mark.skipif(not CLONES_SUPPORTED, reason="needs the patched pyfuse3 (--fuse-processes)")
def test_serving_processes_send_peer_reads_from_c_on_connections_of_their_own(
    tmp_path, moto_s3, fault_proxy
):
    """n1 serves its mount with two processes; 16 readers read every file, half of them
    n2's: each file byte-exact, and the serving process answered READs of n2's files from C
    on the connection the worker handed it (not forwarded to the worker's Python)."""
    files = _files()
    bucket = moto_s3.make_bucket()
    for key, data in files.items():
        moto_s3.put(bucket, f"ds/{key}", data)
    cluster = Cluster(str(tmp_path / "c"), 2, worker_args=("--fuse-processes", "2"))
    try:
        cluster.start()
        cluster.add_dataset("ds", f"s3://{bucket}/ds", endpoint=fault_proxy.url, block_size=BLOCK)
        reader = cluster.workers[0]
        problems: list[str] = []

        def read_with_16_readers() -> None:
            drop_page_cache()
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                for found in pool.map(
                    lambda key: read_all(reader.mount, {key: files[key]}), sorted(files)
                ):
                    problems.extend(found)

        def serving_process_answered_a_peer_read() -> bool:
            read_with_16_readers()
            return reader.status()["fuse_fast_read"]["serving_peer_reads"] > 0

        wait_for(serving_process_answered_a_peer_read, "a peer READ answered by a clone")
        assert problems == []
        # (Its connection may be gone by now: an owner that fetches from the store on a
        # loaded machine can miss the 1 s peer timeout, which cools it down: no error either.)
        status = reader.status()
        assert status["fuse_processes"]["deaths"] == 0
        text = cli_status_text(reader)  # `cachefs status` says so
        assert re.search(r"READs answered in C by them, and [1-9]\d* of other workers' blocks "
                         r"\(on \d+ connections of theirs\)", text), text  # fmt: skip
    finally:
        cluster.cleanup()
