"""cachefs.store.s3.parse_timestamp: the parser cachefs's botocore sessions use for response
timestamps (fast for the ISO 8601 of LIST pages, botocore's own for anything else). Pure
functions: no store involved (tests/e2e/store/test_s3.py lists through it and compares with a
plain client's listing)."""

from __future__ import annotations

import datetime

import botocore.utils
import pytest

from cachefs.store.s3 import parse_timestamp

UTC = datetime.timezone.utc


@pytest.mark.parametrize(
    "text",
    [
        "2026-11-28T08:53:51.000Z",  # a LIST page's LastModified
        "2026-11-28T08:53:51.123Z",
        "2026-11-28T08:53:51Z",
        "2026-11-28T10:53:51.5+02:00",
        "Wed, 12 Oct 2009 17:50:00 GMT",  # a Last-Modified header
        "1700000000",  # epoch seconds
    ],
)
def test_it_gives_the_instant_botocore_gives(text):
    ours = parse_timestamp(text)
    assert ours == botocore.utils.parse_timestamp(text)
    assert ours.tzinfo is not None


def test_a_time_without_a_zone_is_utc():
    assert parse_timestamp("2026-11-28T08:53:51") == datetime.datetime(
        2026, 11, 28, 8, 53, 51, tzinfo=UTC
    )


def test_what_no_parser_understands_fails_as_botocore_fails():
    with pytest.raises(ValueError):
        parse_timestamp("not a time")
