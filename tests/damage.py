"""Damage done to cache files behind cachefs's back, the way the integrity tests do it."""

from __future__ import annotations

import os


def flip_byte(path: str, offset: int) -> None:
    """Change one byte of a file in place: same inode, same size, a checksum that no longer
    matches. ``offset`` < 0 counts from the end (-1: the last byte). Which value the byte gets
    does not matter: any change fails the chunk's checksum."""
    with open(path, "r+b") as damaged:
        damaged.seek(offset, os.SEEK_SET if offset >= 0 else os.SEEK_END)
        where = damaged.tell()
        original = damaged.read(1)
        damaged.seek(where)
        damaged.write(bytes([original[0] ^ 0xFF]))
