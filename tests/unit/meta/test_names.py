"""validate_key: which object keys can be paths in the mount, and the reason for the others."""

from __future__ import annotations

import pytest

from cachefs.meta import validate_key


def short_id(value: object) -> str:
    text = ascii(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)})"


@pytest.mark.parametrize(
    "key",
    ids=short_id,
    argvalues=[
        "a",
        "train/n01440764/n01440764_10026.JPEG",
        "a/b/",  # a directory marker
        "with space/and\nnewline/é/日本.txt",
        "x" * 255,  # NAME_MAX bytes
        "é" * 127 + "x",  # 255 bytes in 128 characters
        "/".join(["p" * 200] * 20) + "/" + "q" * 76,  # exactly 4096 bytes
        "..a/a../.a/a.",  # dots inside names are fine
        "back\\slash",
    ],
)
def test_valid_keys(key: str) -> None:
    assert validate_key(key) is None


@pytest.mark.parametrize(
    ("key", "reason"),
    ids=short_id,
    argvalues=[
        ("", "empty-segment"),
        ("/", "empty-segment"),
        ("/abs", "empty-segment"),
        ("a//b", "empty-segment"),
        ("a//", "empty-segment"),
        (".", "dot-segment"),
        ("..", "dot-segment"),
        ("../etc/passwd", "dot-segment"),
        ("a/../../b", "dot-segment"),
        ("./a", "dot-segment"),
        ("a/./", "dot-segment"),
        ("a\0b", "nul"),
        ("\0", "nul"),
        ("x" * 256, "too-long"),
        ("a/" + "é" * 128, "too-long"),  # 256 bytes in 128 characters
        ("/".join(["p" * 200] * 20) + "/" + "q" * 77, "path-too-long"),  # 4097 bytes
        ("bad\udcffbyte", "undecodable"),  # os.fsdecode(b"bad\xffbyte")
        ("\ud800", "undecodable"),
        # Several problems: the first reason in the documented order wins.
        ("\udcff\0", "undecodable"),
        ("a\0//", "nul"),
        ("../" * 1400, "path-too-long"),
        ("x" * 300 + "//..", "empty-segment"),
        ("x" * 300 + "/..", "dot-segment"),
    ],
)
def test_invalid_keys(key: str, reason: str) -> None:
    assert validate_key(key) == reason
