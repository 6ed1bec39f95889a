"""The block protocol's bytes: the handshake, request frames and answer heads.

One TCP connection per pair of workers carries any number of block requests at once. The
client opens it with a handshake (magic, protocol version, the cluster's bearer token: checked
once per connection); after that each request is one frame tagged with a request id, and each
answer starts with a head naming the id it answers, so answers come back in any order — a
block served from RAM is not held up behind one the owner must fetch from the store. Several
requests written in one send are a batch: small blocks of small files cost one syscall
each side for many blocks, not one round trip per block.

Everything is big-endian and length-prefixed; both sides check every length against a bound
before reading the bytes it announces, so garbage on the wire is an error, never an allocation
of what it claims. A change to any layout here bumps :data:`VERSION`: peers of two versions
refuse each other in the handshake, with a log line that says so.
"""

from __future__ import annotations

import struct

from cachefs.peer.base import MAX_BLOCK_SIZE, BlockRequest

MAGIC = b"CFSB"
VERSION = 1

# Client -> server, once: magic, version, token length, then the token.
HELLO = struct.Struct("!4sBH")
# Server -> client, once: magic, the server's version, a verdict (HELLO_OK or a refusal).
WELCOME = struct.Struct("!4sBB")
HELLO_OK, HELLO_BAD_TOKEN, HELLO_BAD_VERSION = 0, 1, 2
MAX_TOKEN_LEN = 4096

# A block request: request id, flags, dataset / etag / key lengths, object size, block index,
# block size; then the dataset name, the etag and the key's raw bytes.
REQUEST = struct.Struct("!IBxHHIQQI")
FLAG_CACHED_ONLY = 1
MAX_NAME_LEN = 0xFFFF  # dataset names and etags are short; S3 keys are at most 1,024 bytes

# An answer: request id, status, chunk size, length of the chunk checksums, length of the body
# (the block for OK, else a UTF-8 reason); then the checksums, then the body.
ANSWER = struct.Struct("!IB3xIIQ")
MAX_REASON_LEN = 4096

# Statuses. The refusals keep the HTTP numbers the read path and fills branch on (404: not
# here, ask the store; 503: busy or failing, maybe later) as PeerRefused.status.
OK = 0
NOT_THIS_NODES_FILE = 1
NOT_CACHED = 2
UNAVAILABLE = 3  # its own store fetch failed: the reason follows
OVERLOADED = 4
BAD_REQUEST = 5
INTERNAL_ERROR = 6
REFUSAL_STATUS = {NOT_THIS_NODES_FILE: 404, NOT_CACHED: 404, UNAVAILABLE: 503, OVERLOADED: 503}
STATUS_TEXT = {
    NOT_THIS_NODES_FILE: "not this node's file",
    NOT_CACHED: "not cached",
    UNAVAILABLE: "unavailable",
    OVERLOADED: "too many concurrent peer reads",
    BAD_REQUEST: "bad request",
    INTERNAL_ERROR: "internal error",
}


def hello(token: str) -> bytes:
    raw = token.encode()
    return HELLO.pack(MAGIC, VERSION, len(raw)) + raw


def encode_request(request_id: int, req: BlockRequest) -> bytes:
    dataset = req.dataset.encode("utf-8", "surrogateescape")
    etag = req.etag.encode("utf-8", "surrogateescape")
    key = req.key.encode("utf-8", "surrogateescape")
    if max(len(dataset), len(etag), len(key)) > MAX_NAME_LEN:
        raise ValueError("a dataset name, etag or key longer than 64 KiB has no request frame")
    flags = FLAG_CACHED_ONLY if req.cached_only else 0
    head = REQUEST.pack(
        request_id, flags, len(dataset), len(etag), len(key), req.size, req.index, req.block_size
    )
    return b"".join((head, dataset, etag, key))


def file_identity(dataset: str, etag: str, key: str, size: int, block_size: int) -> bytes:
    """The bytes every request for a block of this file version carries, whatever its id,
    flags and block index: the head's name lengths and file size (bytes 6..22), its block size
    (bytes 30..34), then the names. An owner's native table answers the requests whose bytes
    are these (cachefs_fast_read.c, "peer answers"); a change to REQUEST changes them too."""
    names = [n.encode("utf-8", "surrogateescape") for n in (dataset, etag, key)]
    head = REQUEST.pack(0, 0, *(len(n) for n in names), size, 0, block_size)
    return b"".join((head[6:22], head[30:34], *names))


def request_names_length(head: bytes) -> int:
    """Bytes of names that follow a request head; ValueError past the bounds."""
    _, _, dataset_len, etag_len, key_len, _, _, _ = REQUEST.unpack(head)
    if dataset_len > MAX_NAME_LEN or etag_len > MAX_NAME_LEN or key_len > MAX_NAME_LEN:
        raise ValueError("a name in the request is longer than 64 KiB")
    names_length: int = dataset_len + etag_len + key_len  # Struct.unpack's items are Any
    return names_length


def decode_request(head: bytes, names: bytes) -> tuple[int, BlockRequest]:
    """The request id and the request; ValueError (with the id known: a bad request) if the
    fields make no request (BlockRequest's own checks)."""
    request_id, flags, dataset_len, etag_len, _, size, index, block_size = REQUEST.unpack(head)
    if flags & ~FLAG_CACHED_ONLY:
        raise ValueError(f"unknown request flags {flags:#x}")
    # surrogateescape: any key, even bytes that are not UTF-8, round-trips byte for byte
    dataset = names[:dataset_len].decode("utf-8", "surrogateescape")
    etag = names[dataset_len : dataset_len + etag_len].decode("utf-8", "surrogateescape")
    key = names[dataset_len + etag_len :].decode("utf-8", "surrogateescape")
    request = BlockRequest(
        dataset, key, etag, size, index, block_size, bool(flags & FLAG_CACHED_ONLY)
    )
    return request_id, request


def encode_answer(request_id: int, status: int, chunk_size: int, sums: bytes, length: int) -> bytes:
    """An answer's head and checksums; ``length`` bytes of body follow."""
    return ANSWER.pack(request_id, status, chunk_size, len(sums), length) + sums


def encode_refusal(request_id: int, status: int, reason: str = "") -> bytes:
    body = (reason or STATUS_TEXT[status]).encode("utf-8", "backslashreplace")[:MAX_REASON_LEN]
    return encode_answer(request_id, status, 0, b"", len(body)) + body


def check_answer_lengths(status: int, sums_len: int, body_len: int) -> None:
    """ValueError if an answer head announces more than any answer may carry."""
    if status == OK:
        if body_len > MAX_BLOCK_SIZE or sums_len > MAX_BLOCK_SIZE:
            raise ValueError(f"an answer of {body_len} bytes is larger than any block")
    elif status in STATUS_TEXT:
        if sums_len or body_len > MAX_REASON_LEN:
            raise ValueError(f"a refusal announces {sums_len} + {body_len} bytes")
    else:
        raise ValueError(f"unknown answer status {status}")
