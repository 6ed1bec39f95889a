"""Parsing and printing of human sizes and durations ("8GiB", "512MiB", "6h")."""

from __future__ import annotations

import re

from cachefs.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from "8GiB", "512MiB", "100GB", "4096" (binary and decimal suffixes)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(f"invalid size {text!r}: use a number with an optional unit like 8GiB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(nbytes: int | float) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(text: str | float) -> float:
    """Seconds from "30s", "6h", "1.5m", "250ms" or a bare number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    match = _DURATION_RE.match(text)
    if match is None:
        raise ConfigError(f"invalid duration {text!r}: use e.g. 30s, 10m, 6h, 2d")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]
