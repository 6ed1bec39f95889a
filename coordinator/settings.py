"""Every setting of `cachefs coordinator`, declared once: its default, its help and how it is
given on the command line (kopf's model: the settings class is the one source).

- The CLI builds the options of `cachefs coordinator` from :func:`options` (flag, placeholder,
  default, help, choices) and turns what it parsed into settings with
  :meth:`CoordinatorSettings.from_options`.
- :class:`~coordinator.service.Coordinator` hands the values to the parts that use them
  (the model's ``down_after_s``, the Cluster's heartbeat interval, the CacheManager's lease,
  watermark and fill timeout); the server reads ``listen``, ``store`` and the ticker's period.
- The README's table of the options is :func:`markdown_table` (``python -m
  coordinator.settings`` prints it).

A default is written as a user would type it ("2s", "10m") and parsed once, here, into the
value the coordinator uses (seconds for durations); a default that is no constant says in
words what it is. The global options `--state` and `--token-file` are the CLI's, shared with
the worker: :func:`coordinator.server.serve` takes them beside the settings.

This module imports nothing heavy: the CLI reads it whenever it builds its parser.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from cachefs.errors import ConfigError
from cachefs.units import parse_duration

#: Without `--down-after`, a node silent for this many heartbeat intervals is down.
DOWN_AFTER_HEARTBEATS = 3


@dataclass(frozen=True)
class Kind:
    """What an option's value looks like: its placeholder and how its text becomes the value
    (a ConfigError for text it cannot read)."""

    metavar: str
    convert: Callable[[str], Any]
    choices: tuple[str, ...] | None = None


def _ratio(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{text!r} is not a number") from None


ADDRESS = Kind("HOST:PORT", str)
LOCATION = Kind("URL", str)
DURATION = Kind("DURATION", parse_duration)
RATIO = Kind("RATIO", _ratio)


@dataclass(frozen=True)
class Option:
    """How one setting is given on the command line, and how it is documented."""

    flag: str  # "--job-lease"
    kind: Kind
    typed: str | None  # the default as a user would type it; None: no value unless given
    help: str  # markdown: `code` in backticks (the README shows them, --help drops them)
    shown: str  # the default, in markdown, as the README and --help show it

    @property
    def cli_help(self) -> str:
        """The help line of ``--help``: the text and its default, without markdown."""
        return f"{self.help} (default: {self.shown})".replace("`", "")


def option(flag: str, kind: Kind, typed: str | None, help: str, *, shown: str = "none") -> Any:
    """A dataclass field that is also a command-line option. ``typed``: the default as a user
    would type it (parsed here into the field's default, and shown in backticks); without one
    the field defaults to None and ``shown`` says in words what that means. Returns the
    ``dataclasses.field`` (typed ``Any``, as ``field()`` is, so the class declares its type)."""
    value = kind.convert(typed) if typed is not None else None
    shown = f"`{typed}`" if typed is not None else shown
    return field(default=value, metadata={"option": Option(flag, kind, typed, help, shown)})


@dataclass(frozen=True)
class CoordinatorSettings:
    """Every setting of the coordinator; the fields' options are `cachefs coordinator`'s."""

    listen: str = option(
        "--listen",
        ADDRESS,
        "127.0.0.1:7700",
        "where the API listens (also `/metrics` and the scheduler extender's routes)",
    )
    store: str | None = option(
        "--store",
        LOCATION,
        None,
        "state store: `etcd://HOST:PORT[,HOST:PORT…]` for an etcd cluster",
        shown="LMDB in `<state>/coordinator`",
    )
    heartbeat_interval_s: float = option(
        "--heartbeat-interval",
        DURATION,
        "2s",
        "how often workers heartbeat (every heartbeat reply tells them); the coordinator "
        "checks leases, fills and cleanup twice as often",
    )
    down_after_s: float | None = option(
        "--down-after",
        DURATION,
        None,
        "mark a node down after this long without heartbeats: its shards move to the other "
        "live nodes of its copy",
        shown=f"{DOWN_AFTER_HEARTBEATS} heartbeat intervals",
    )
    job_lease_s: float = option(
        "--job-lease",
        DURATION,
        "10m",
        "release a job that is not renewed for this long (`0`: never)",
    )
    lru_high_watermark: float = option(
        "--lru-high-watermark",
        RATIO,
        "0.9",
        "`lru` cleanup frees datasets on a node whose cache is at least this full (more than "
        "0, at most 1)",
    )
    fill_timeout_s: float = option(
        "--fill-timeout",
        DURATION,
        "1h",
        "give up a clone's fill or a scale's hand-off after this long",
    )

    def __post_init__(self) -> None:
        checks = [
            ("heartbeat_interval_s", self.heartbeat_interval_s > 0, "must be more than 0"),
            ("down_after_s", self.down_after_s is None or self.down_after_s > 0,
             "must be more than 0"),
            ("job_lease_s", self.job_lease_s >= 0, "must be 0 (never) or more"),
            ("lru_high_watermark", 0 < self.lru_high_watermark <= 1, "must be in (0, 1]"),
            ("fill_timeout_s", self.fill_timeout_s > 0, "must be more than 0"),
        ]  # fmt: skip
        for name, valid, rule in checks:
            if not valid:
                raise ConfigError(f"{_flag(name)} {rule}, got {getattr(self, name)!r}")

    @property
    def node_down_after_s(self) -> float:
        """How long a node may be silent before it is down (`--down-after`, else
        :data:`DOWN_AFTER_HEARTBEATS` heartbeat intervals)."""
        if self.down_after_s is not None:
            return self.down_after_s
        return DOWN_AFTER_HEARTBEATS * self.heartbeat_interval_s

    @classmethod
    def from_options(cls, given: Mapping[str, str | None]) -> CoordinatorSettings:
        """Settings from the options' text by field name (what the CLI parsed: an option
        missing or None keeps its default); a ConfigError names the option it cannot read."""
        values = {}
        for name, found in options():
            text = given.get(name)
            if text is None:
                continue
            try:
                values[name] = found.kind.convert(text)
            except ConfigError as exc:
                raise ConfigError(f"{found.flag}: {exc}") from None
        return cls(**values)


def options() -> Iterator[tuple[str, Option]]:
    """(field name, option) of every setting, in declaration order."""
    for item in fields(CoordinatorSettings):
        yield item.name, item.metadata["option"]


def _flag(name: str) -> str:
    return next(found.flag for field_name, found in options() if field_name == name)


def markdown_table() -> str:
    """The README's table of `cachefs coordinator`'s options: option, default, meaning."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for _name, found in options():
        rows.append(f"| `{found.flag} {found.kind.metavar}` | {found.shown} | {found.help} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown_table())
