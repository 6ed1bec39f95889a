"""Who may read what through the mount: the owner and mode bits every entry shows.

The mount is made with ``default_permissions``, so the *kernel* checks these bits against the
reader's uid and groups before a request reaches cachefs; what :class:`MountPermissions` and a
snapshot's recorded modes say is what is enforced.

* An entry whose source records an owner and mode (a ``file://`` directory) shows the source's
  owner, group and mode without its write bits (and without setuid, setgid and sticky): the
  mount never lets anyone read what the source would not let them read.
* Every other entry — objects of S3 and OSS, which have no POSIX owner, the mount root, and
  directories implied by keys — shows ``MountPermissions``: by default owned by the worker's
  uid and gid, files 0444 and directories 0555. mountpoint-s3 defaults to 0644/0755; the mount
  is read-only, so cachefs shows no write bit it would then refuse.

This module has no heavy imports: the CLI reads the defaults from it when it builds its parser.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from cachefs.errors import ConfigError

#: Mode of a file with no recorded mode (object stores): everyone may read.
DEFAULT_FILE_MODE = 0o444
#: Mode of a directory with no recorded mode: everyone may list and enter.
DEFAULT_DIR_MODE = 0o555
#: The bits of a source's mode the mount keeps: read and execute for owner, group and others.
READ_ONLY_BITS = 0o555
_MAX_ID = (1 << 32) - 2  # (uid_t)-1 is "no id" to the kernel's chown(); never an owner


@dataclass(frozen=True, slots=True)
class MountPermissions:
    """Owner and modes of the entries whose source records none (see the module docstring)."""

    uid: int = field(default_factory=os.getuid)  # the worker's own, as mountpoint-s3 does
    gid: int = field(default_factory=os.getgid)
    file_mode: int = DEFAULT_FILE_MODE  # permission bits only (no S_IFREG)
    dir_mode: int = DEFAULT_DIR_MODE

    def __post_init__(self) -> None:
        check_id(self.uid, "--uid")
        check_id(self.gid, "--gid")
        check_mode(self.file_mode, "--file-mode")
        check_mode(self.dir_mode, "--dir-mode")


def shown_mode(source_mode: int) -> int:
    """The permission bits the mount shows for an entry whose source recorded ``source_mode``."""
    return source_mode & READ_ONLY_BITS


def parse_mode(text: str, option: str) -> int:
    """An octal mode as ``chmod`` takes it ("444", "0444" or "0o444")."""
    digits = text.strip().lower().removeprefix("0o")
    try:
        mode = int(digits, 8)
    except ValueError:
        raise ConfigError(f"{option} wants an octal mode such as 0444, got {text!r}") from None
    check_mode(mode, option)
    return mode


def parse_id(text: str, option: str) -> int:
    """A numeric uid or gid."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{option} wants a numeric id such as 1000, got {text!r}") from None
    check_id(value, option)
    return value


def check_mode(mode: int, option: str) -> None:
    if not 0 <= mode <= 0o7777:
        raise ConfigError(f"{option} {mode:#o} is not a permission mode (0000 to 0555)")
    if mode & ~READ_ONLY_BITS:
        raise ConfigError(
            f"{option} {mode:04o} grants write or special bits, but the mount is read-only: "
            f"use {mode & READ_ONLY_BITS:04o}"
        )


def check_id(value: int, option: str) -> None:
    if not 0 <= value <= _MAX_ID:
        raise ConfigError(f"{option} {value} is not a valid id (0 to {_MAX_ID})")
