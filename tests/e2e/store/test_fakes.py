"""The shared test servers of tests/fakes (used by every package's integration tests): the fault
proxy's pass-through, counting, faults and restart, checked with plain HTTP clients."""

from __future__ import annotations

import http.client
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from tests.fakes.fault_proxy import FaultProxy

PAYLOAD = bytes(range(256)) * 4096 + os.urandom(12345)  # every byte value, odd length


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)


def request(conn, method, path, body=None, headers=None) -> tuple[int, dict, bytes]:
    conn.request(method, path, body=body, headers=headers or {})
    response = conn.getresponse()
    return response.status, dict(response.getheaders()), response.read()


@pytest.fixture(scope="module")
def bucket(moto_s3):
    """A bucket whose object "blob" anyone may read, so raw HTTP clients can GET it."""
    name = moto_s3.make_bucket()
    moto_s3.client().put_object(Bucket=name, Key="blob", Body=PAYLOAD, ACL="public-read")
    return name


def test_bodies_pass_through_byte_exactly_both_ways(fault_proxy, bucket, moto_s3):
    client = moto_s3.client(endpoint=fault_proxy.url)  # signed requests, through the proxy

    client.put_object(Bucket=bucket, Key="uploaded", Body=PAYLOAD[::-1])
    whole = client.get_object(Bucket=bucket, Key="uploaded")["Body"].read()
    part = client.get_object(Bucket=bucket, Key="uploaded", Range="bytes=1000-1999")

    assert whole == PAYLOAD[::-1]
    assert part["Body"].read() == PAYLOAD[::-1][1000:2000]
    assert part["ContentRange"] == f"bytes 1000-1999/{len(PAYLOAD)}"


def test_client_connections_are_kept_alive(fault_proxy, bucket):
    # moto closes its connection after every response; the proxy must not pass that on.
    conn = connect(fault_proxy.url)

    first = request(conn, "GET", f"/{bucket}/blob", headers={"Range": "bytes=0-9"})
    first_socket = conn.sock
    second = request(conn, "HEAD", f"/{bucket}/blob")
    third = request(conn, "GET", f"/{bucket}/blob")

    assert (first[0], first[2]) == (206, PAYLOAD[:10])
    assert second[0] == 200 and second[1]["Content-Length"] == str(len(PAYLOAD))
    assert third[2] == PAYLOAD
    assert conn.sock is first_socket


def test_a_chunked_request_body_arrives_intact(fault_proxy, bucket, moto_s3):
    conn = connect(fault_proxy.url)
    conn.request("PUT", f"/{bucket}/chunked", body=iter([PAYLOAD[:1000], PAYLOAD[1000:]]))
    response = conn.getresponse()
    response.read()

    assert response.status == 200
    assert moto_s3.client().get_object(Bucket=bucket, Key="chunked")["Body"].read() == PAYLOAD


def test_requests_are_counted_by_method_and_path(fault_proxy, bucket):
    conn = connect(fault_proxy.url)
    request(conn, "PUT", f"/{bucket}/train/a", body=b"a")
    request(conn, "GET", f"/{bucket}/train/a")
    request(conn, "HEAD", f"/{bucket}/val/b")
    request(conn, "GET", f"/{bucket}?list-type=2&prefix=train/")

    assert fault_proxy.count() == 4  # whatever moto answered (these are unsigned requests)
    assert fault_proxy.count("GET") == 2
    assert fault_proxy.count("GET", path_contains="train/") == 1  # the query is not the path
    assert fault_proxy.requests[-1] == ("GET", f"/{bucket}")
    fault_proxy.reset_counts()
    assert fault_proxy.count() == 0


def test_fail_next_and_fail_matching_answer_with_s3_error_bodies(fault_proxy, bucket):
    conn = connect(fault_proxy.url)
    fault_proxy.fail_next(1, status=503)
    fault_proxy.fail_matching("/never", status=500)

    status, headers, body = request(conn, "GET", f"/{bucket}/blob")
    head_status, _, head_body = request(conn, "HEAD", f"/{bucket}/never")
    ok_status, _, ok_body = request(conn, "GET", f"/{bucket}/blob")

    assert status == 503 and b"<Code>SlowDown</Code>" in body
    assert headers["Content-Type"] == "application/xml"
    assert head_status == 500 and head_body == b""
    assert ok_status == 200 and ok_body == PAYLOAD
    fault_proxy.clear_faults()
    assert request(conn, "HEAD", f"/{bucket}/never")[0] != 500  # moto's own answer now


def test_reset_next_resets_the_connection(fault_proxy, bucket):
    fault_proxy.reset_next(1)
    conn = connect(fault_proxy.url)

    with pytest.raises((ConnectionResetError, http.client.RemoteDisconnected)):
        request(conn, "GET", f"/{bucket}/k")


def test_truncate_next_cuts_the_body_but_not_the_promised_length(fault_proxy, bucket):
    conn = connect(fault_proxy.url)
    fault_proxy.truncate_next(1, keep_bytes=100)

    conn.request("GET", f"/{bucket}/blob")
    response = conn.getresponse()
    assert response.getheader("Content-Length") == str(len(PAYLOAD))
    with pytest.raises(http.client.IncompleteRead) as caught:
        response.read()
    assert caught.value.partial == PAYLOAD[:100]


def test_delays_still_deliver_the_right_bytes(fault_proxy, bucket):
    conn = connect(fault_proxy.url)
    fault_proxy.delay_next(1, 0.05)
    fault_proxy.first_byte_delay_s = 0.01
    fault_proxy.bandwidth_bytes_per_s = 50_000_000

    assert request(conn, "GET", f"/{bucket}/blob")[2] == PAYLOAD


def test_a_black_hole_holds_requests_until_cleared(fault_proxy, bucket):
    fault_proxy.blackhole()
    outcome = []

    def client():
        try:
            request(connect(fault_proxy.url), "GET", f"/{bucket}/k")
            outcome.append("answered")
        except (http.client.RemoteDisconnected, ConnectionError):
            outcome.append("dropped")

    thread = threading.Thread(target=client)
    thread.start()
    for _ in range(500):  # bounded wait until the request has reached the proxy
        if fault_proxy.count() or not thread.is_alive():
            break
        threading.Event().wait(0.01)
    assert outcome == []  # not answered while black-holed
    fault_proxy.clear_faults()
    thread.join(timeout=30)

    assert outcome == ["dropped"]


def test_stop_refuses_connections_and_start_serves_again_on_the_same_port(fault_proxy, bucket):
    port = fault_proxy.port

    fault_proxy.stop()
    with pytest.raises(ConnectionRefusedError):
        request(connect(fault_proxy.url), "GET", f"/{bucket}/blob")
    fault_proxy.start()

    assert fault_proxy.port == port
    assert request(connect(fault_proxy.url), "GET", f"/{bucket}/blob")[2] == PAYLOAD


class _ChunkedUpstream(BaseHTTPRequestHandler):
    """An upstream that answers with a chunked body (moto always sends Content-Length)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for part in (PAYLOAD[:7], PAYLOAD[7:]):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format, *args):
        pass


def test_a_chunked_upstream_response_is_relayed_intact():
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _ChunkedUpstream)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        with FaultProxy(f"http://127.0.0.1:{upstream.server_address[1]}") as proxy:
            conn = connect(proxy.url)
            assert request(conn, "GET", "/x")[2] == PAYLOAD
            assert request(conn, "GET", "/y")[2] == PAYLOAD  # and the connection stays usable
    finally:
        upstream.shutdown()
        upstream.server_close()
