"""The spec's patterns against the readers behind them: whatever a pattern admits, the reader
takes (else the API would refuse, with a 400, a request its spec allows), and the path prefix
pattern is exactly the rule of :class:`cachefs.preload_jobs.Selection`.

Strings are drawn from the patterns themselves (Hypothesis reads the regex) and, for the
reverse direction, from small alphabets that hit every edge (dots, slashes, NUL, zeros)."""

from __future__ import annotations

import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cachefs.errors import ConfigError
from cachefs.preload_jobs import Selection
from cachefs.protocol import SHARDS, CleanupPolicy
from coordinator.api import ADDRESS_PATTERN, CLEANUP_PATTERN, PATH_PREFIX_PATTERN, SHARD_PATTERN

EXAMPLES = settings(max_examples=300, deadline=None)


@EXAMPLES
@given(st.from_regex(CLEANUP_PATTERN, fullmatch=True))
@example("ttl:0.000000001ms")
@example("ttl:999999999.999999999d")
def test_every_cleanup_the_spec_admits_is_read(text: str) -> None:
    policy = CleanupPolicy.parse(text)
    if policy.kind == "ttl":
        assert 0 < policy.ttl_s < float("inf")


@EXAMPLES
@given(st.text(alphabet="0123456789.:tlsmhd", max_size=12).map(lambda t: "ttl:" + t))
@example("ttl:5.")
@example("ttl:.5")
@example("ttl:0ms")
def test_the_spec_refuses_what_the_reader_refuses(text: str) -> None:
    try:
        CleanupPolicy.parse(text)
    except ConfigError:
        assert re.fullmatch(CLEANUP_PATTERN, text) is None, text


def _selection_takes(prefix: str) -> bool:
    try:
        Selection(paths=(prefix,))
    except ConfigError:
        return False
    return True


@EXAMPLES
@given(st.text(alphabet="a./\x00", max_size=10))
@example("")
@example("..")
@example("a/..")
@example("a//b/")
@example("...")
@example("/a")
def test_the_path_prefix_pattern_is_the_selection_rule(prefix: str) -> None:
    assert (re.fullmatch(PATH_PREFIX_PATTERN, prefix) is not None) == _selection_takes(prefix)


@EXAMPLES
@given(st.from_regex(PATH_PREFIX_PATTERN, fullmatch=True))
def test_every_path_prefix_the_spec_admits_is_selected(prefix: str) -> None:
    assert _selection_takes(prefix), repr(prefix)


def test_the_shard_pattern_is_the_shard_numbers() -> None:
    admitted = {str(n) for n in range(10_000) if re.fullmatch(SHARD_PATTERN, str(n))}
    assert admitted == {str(n) for n in range(SHARDS)}
    for text in ("007", "-1", "1.0", "²", "١", " 1", ""):
        assert re.fullmatch(SHARD_PATTERN, text) is None, text


@EXAMPLES
@given(st.from_regex(ADDRESS_PATTERN, fullmatch=True))
@example("127.0.0.2:7701")
@example("gpu-1:65535")
def test_every_address_the_spec_admits_can_be_dialled(address: str) -> None:
    host, port = address.rsplit(":", 1)
    assert 1 <= int(port) <= 65535
    assert host.strip(".0"), address  # not 0, 0.0.0.0: the unspecified address


def test_addresses_no_peer_can_dial_are_refused() -> None:
    for address in ("0:0", "0.0.0.0:7070", "00:80", "h:0", "h:65536", "h:123456", ":80", "h:"):
        assert re.fullmatch(ADDRESS_PATTERN, address) is None, address
