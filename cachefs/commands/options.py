"""Command-line options built from a settings class (cachefs/settings.py): each option's flag,
placeholder, choices, help and default come from the class and are never written here.

An option not given stays :class:`NotGiven` in argparse's namespace and the settings class's
own default applies: the CLI holds no default of its own.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from cachefs.settings import Option, options_of

Settings = TypeVar("Settings")


class NotGiven:
    """argparse's value of an option that was not given. Its text is the setting's default as
    --help shows it: argparse formats help only when asked, so a default looked up in a heavier
    module (--store-threads') costs nothing to a command that prints no help."""

    def __init__(self, option: Option) -> None:
        self.option = option

    def __str__(self) -> str:
        return plain(self.option.shown())


def plain(markdown: str) -> str:
    """Help text as a terminal shows it: the README's backticks dropped."""
    return markdown.replace("`", "")


def add_options(parser: argparse.ArgumentParser, settings: type[Any], command: str) -> None:
    """The options of ``command`` (those of its settings that name it), on ``parser``."""
    for _name, found in options_of(settings, command):
        kind = found.kind
        help_text = plain(found.help).replace("%", "%%")
        if not found.required:
            help_text += " (default: %(default)s)"
        extra: dict[str, Any] = {}
        if kind.action == "store_true":
            extra["action"] = "store_true"
        elif kind.action == "toggle":
            extra["action"] = argparse.BooleanOptionalAction
        else:
            extra.update(metavar=kind.metavar, choices=kind.choices, type=kind.argparse_type)
        parser.add_argument(
            found.flag,
            help=help_text,
            default=None if found.required else NotGiven(found),
            required=found.required,
            **extra,
        )


def dest_of(found: Option) -> str:
    """Where argparse keeps an option's value: named after its flag (``--ram-dir``: ``ram_dir``),
    as for every other option of the CLI (shell completion finds path options by it)."""
    return found.flag.removeprefix("--").replace("-", "_")


def settings_from_args(
    settings: type[Settings], args: argparse.Namespace, command: str, **given: Any
) -> Settings:
    """The settings ``args`` give for ``command``, plus ``given`` (what other options, such
    as the global ones, decide); every option not given keeps the class's default. A value
    that does not parse is a ConfigError naming its option."""
    values = dict(given)
    for name, found in options_of(settings, command):
        value = getattr(args, dest_of(found))
        if isinstance(value, NotGiven) or value is None:
            continue
        kind = found.kind
        if kind.action == "value" and kind.argparse_type is None:
            value = kind.convert(value, found.flag)
        values[name] = value
    return settings(**values)
