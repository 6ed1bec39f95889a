"""The worker's settings, each declared once: its default, its help and how it is given on the
command line. kopf's model: the settings class is the one source; the CLI builds the options of
`cachefs up` and `cachefs worker` from it (:mod:`cachefs.commands.options`), and the README's
option tables are checked against it (tests/unit/test_settings_docs.py; ``python -m cachefs.settings
up`` prints the table).

A default is written as a user would type it ("2GiB", "1h") and parsed once, here, into the
value the worker uses; a default that is not a constant (the host name, the RAM tier's folder)
says in words what it is. The machinery (:func:`option`, :func:`options_of`,
:func:`markdown_table`) works for any dataclass whose fields carry an :class:`Option`.

This module has no heavy imports: the CLI reads it for every command when it builds its parser.
The defaults that come from the read path's concurrency bounds are looked up only when used.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import xxhash

from cachefs.errors import ConfigError
from cachefs.fs.permissions import (
    DEFAULT_DIR_MODE,
    DEFAULT_FILE_MODE,
    MountPermissions,
    parse_id,
    parse_mode,
)
from cachefs.units import parse_duration, parse_size

#: The commands that run a worker.
UP, WORKER = "up", "worker"
BOTH = frozenset({UP, WORKER})


@dataclass(frozen=True)
class Kind:
    """What an option's value looks like: its placeholder and how its text becomes the value
    (``convert(text, flag)``, after argparse: a bad value is one ``cachefs: error:`` line, exit
    1). ``argparse_type``: converted by argparse instead (a bad value is a usage error, exit 2,
    as for every ``int`` option). ``action``: "value", "store_true" (off unless given) or
    "toggle" (--NAME / --no-NAME)."""

    metavar: str | None
    convert: Callable[[str, str], Any]
    action: str = "value"
    argparse_type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None


def _text(text: str, flag: str) -> str:
    return text


def _count(text: str, flag: str) -> int:
    return int(text)


def _ssd(text: str, flag: str) -> SsdTier:
    path, sep, size = text.rpartition(":")
    if not sep or not path:
        raise ConfigError(f"{flag} wants DIR:SIZE (e.g. /var/cache/cachefs:100GiB), got {text!r}")
    return SsdTier(path, parse_size(size))


def _size(text: str, flag: str) -> int:
    return parse_size(text)


def _duration(text: str, flag: str) -> float:
    return parse_duration(text)


def _address_or_off(text: str, flag: str) -> str | None:
    return None if text == "off" else text


_TRISTATE = {"auto": None, "on": True, "off": False}


def _tristate(text: str, flag: str) -> bool | None:
    return _TRISTATE[text]


SIZE = Kind("SIZE", _size)
DURATION = Kind("DURATION", _duration)
COUNT = Kind("N", _count, argparse_type=int)
DIR = Kind("DIR", _text)
ADDRESS = Kind("HOST:PORT", _text)
#: An address, or "off": none.
OPTIONAL_ADDRESS = Kind("HOST:PORT", _address_or_off)
NAME = Kind("NAME", _text)
MODE = Kind("MODE", parse_mode)
ID = Kind("N", parse_id)
SSD = Kind("DIR:SIZE", _ssd)
#: "auto" (None: decided at start from what is installed), "on" (True) or "off" (False).
TRISTATE = Kind(None, _tristate, choices=tuple(_TRISTATE))
FLAG = Kind(None, _text, action="store_true")
TOGGLE = Kind(None, _text, action="toggle")


def choice(*names: str) -> Kind:
    return Kind(None, _text, choices=names)


@dataclass(frozen=True)
class Option:
    """How one setting is given on the command line, and how it is documented."""

    flag: str  # "--ram"
    kind: Kind
    typed: str | None  # the default as a user would type it; None: a default in words
    help: str  # markdown: `code` in backticks (the README shows them, --help drops them)
    shown: Callable[[], str]  # the default, in markdown, as the README and --help show it
    commands: frozenset[str]
    required: bool = False

    @property
    def flags(self) -> list[str]:
        if self.kind.action == "toggle":
            return [self.flag, "--no-" + self.flag.removeprefix("--")]
        return [self.flag]


def option(
    flag: str,
    kind: Kind,
    default: str | None,
    help: str,
    *,
    shown: str | Callable[[], str] | None = None,
    value: Any = None,
    factory: Callable[[], Any] | None = None,
    commands: frozenset[str] = BOTH,
    required: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option.

    ``default``: the default as a user would type it (shown in backticks, and parsed here into
    the field's default). Without it the field defaults to ``value``, or to ``factory()``, and
    ``shown`` says in words what that is (a callable: looked up only when shown)."""
    if default is not None:
        value = kind.convert(default, flag)
        shown = f"`{default}`"
    elif shown is None:
        shown = "required" if required else "none"
    text = shown if callable(shown) else _constant(shown)
    metadata = {"option": Option(flag, kind, default, help, text, commands, required)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=value, metadata=metadata)


def _constant(text: str) -> Callable[[], str]:
    def shown() -> str:
        return text

    return shown


def options_of(settings: type[Any], command: str | None = None) -> Iterator[tuple[str, Option]]:
    """(field name, option) of each setting given on the command line, in declaration order;
    with ``command``, only the options of that command."""
    for item in fields(settings):
        found = item.metadata.get("option")
        if isinstance(found, Option) and (command is None or command in found.commands):
            yield item.name, found


def option_cell(option: Option) -> str:
    placeholder = option.kind.metavar
    if option.kind.choices:
        placeholder = "{" + ",".join(option.kind.choices) + "}"  # as argparse writes them
    return ", ".join(
        f"`{flag} {placeholder}`" if placeholder else f"`{flag}`" for flag in option.flags
    )


def markdown_table(settings: type[Any], command: str, *, only: bool = False) -> str:
    """The README's option table of ``command``. ``only``: just the options no other command
    of the class has (`cachefs worker`'s table lists what it adds to `cachefs up`'s)."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for _name, found in options_of(settings, command):
        if only and len(found.commands) > 1:
            continue
        rows.append(f"| {option_cell(found)} | {found.shown()} | {found.help} |")
    return "\n".join(rows) + "\n"


def default_ram_dir(state_dir: str) -> str:
    """A per-state-directory folder on tmpfs, so several workers on one machine never collide."""
    tag = xxhash.xxh3_64_hexdigest(os.path.abspath(state_dir).encode())[:12]
    return f"/dev/shm/cachefs-{tag}"


@dataclass(frozen=True)
class SsdTier:
    path: str
    capacity: int


@dataclass(frozen=True)
class Following:
    """What a worker that follows a coordinator needs, all given (:meth:`WorkerConfig.cluster`)."""

    coordinator: str  # its URL
    token: str  # bearer token of the coordinator and the peer endpoints
    listen: str  # HOST:PORT of this node's peer block server


def _read_start() -> int:
    """Object-store GETs in flight when reads begin (the adaptive limit's starting point)."""
    from cachefs.store.concurrency import READ_BOUNDS

    return READ_BOUNDS.initial


def _preload_start() -> int:
    from cachefs.store.concurrency import PRELOAD_BOUNDS

    return PRELOAD_BOUNDS.initial


def _preload_ceiling() -> int:
    from cachefs.store.concurrency import PRELOAD_BOUNDS

    return PRELOAD_BOUNDS.ceiling


# Apply to entries whose source records no owner: S3/OSS objects, the mount root.
_KEPT = "`file://` datasets keep their source's"


@dataclass
class WorkerConfig:
    """Every setting of a worker (`cachefs up`; `cachefs worker` adds the cluster's). The
    global options `--state`, `--coordinator` and `--token-file` give ``state_dir``,
    ``coordinator`` and ``token``."""

    state_dir: str
    mountpoint: str = option(
        "--mount", DIR, "/mnt/cachefs", "mountpoint; each dataset is a directory under it"
    )
    ram_capacity: int = option(
        "--ram",
        SIZE,
        "2GiB",
        "RAM tier capacity (files on tmpfs); never exceeded, counting whole tmpfs pages as "
        "`du` does",
    )
    ram_dir: str | None = option(
        "--ram-dir",
        DIR,
        None,
        "RAM tier directory, on tmpfs",
        shown="`/dev/shm/cachefs-<hash of state dir>`",
    )
    ram_reserve: int = option(
        "--ram-reserve", SIZE, "0", "RAM-tier bytes that no eviction ever removes"
    )
    # option() returns a dataclasses.field, as field() does: no shared default.
    ssd: SsdTier | None = option(  # noqa: RUF009
        "--ssd",
        SSD,
        None,
        "SSD tier directory and capacity, e.g. `/var/cache/cachefs:100GiB`",
        shown="none",
    )
    ssd_reserve: int = option(
        "--ssd-reserve", SIZE, "0", "SSD-tier bytes that no eviction ever removes"
    )
    admission: str = option(
        "--admission",
        choice("avoid-eviction", "lru"),
        "avoid-eviction",
        "`avoid-eviction`: when full, read through without evicting (stable hit ratio for "
        "epoch-cyclic reads); `lru`: evict least recently used",
    )
    promote: bool = option(
        "--promote",
        FLAG,
        None,
        "copy SSD hits into RAM (off = the paper's CACHE, not CACHE_PROMOTE)",
        shown="off",
        value=False,
    )
    entry_timeout: float = option(
        "--entry-timeout", DURATION, "1h", "how long the kernel caches lookups"
    )
    attr_timeout: float = option(
        "--attr-timeout", DURATION, "1h", "how long the kernel caches attributes"
    )
    max_tasks: int = option(
        "--max-tasks",
        COUNT,
        "64",
        "concurrent FUSE requests (pyfuse3's analogue of `max_idle_threads`)",
    )
    # More processes reading the one FUSE connection (cachefs/fs/serving.py): each answers
    # from its own native table in C and forwards the rest to the worker. 1 by default: on the
    # one machine measured (2 cores) two processes were slower in every pass (README,
    # "Serving the mount from more processes"); a default from the cores waits for a curve
    # measured on a larger machine.
    fuse_processes: int = option(
        "--fuse-processes",
        COUNT,
        "1",
        "processes serving the mount: the worker and N-1 serving processes, each reading the "
        "same FUSE connection (a clone of its `/dev/fuse`) and answering READs of RAM-tier "
        "blocks in C; what they cannot answer they hand to the worker (needs the patched "
        "pyfuse3 and `--fuse-passthrough off`; 1 by default, see the README)",
    )
    # FUSE's default (128 KiB) splits every file larger than that into several READ requests;
    # 1 MiB (the largest request libfuse negotiates) lets a typical training sample arrive in one.
    readahead: int = option(
        "--readahead",
        SIZE,
        "1MiB",
        "kernel readahead of the mount (`0`: leave the kernel's); 1 MiB, the largest request "
        "libfuse negotiates, lets a typical training sample arrive in one READ (lowered to the "
        "native READ path's largest spliced READ where pipes hold less than 1 MiB)",
    )
    store_threads: int = option(
        "--store-threads",
        COUNT,
        None,
        "object-store GETs in flight at first; adaptive from there (more while the store "
        "keeps up, halved when it answers 503/SlowDown; "
        '`cachefs_store_concurrency{purpose="read"}`)',
        shown=lambda: f"`{_read_start()}`",
        factory=_read_start,
    )
    allow_other: bool = option(
        "--allow-other",
        TOGGLE,
        None,
        "let every local user use the mount, as far as the mode bits allow; "
        "`--no-allow-other`: only the worker's user",
        shown="on",
        value=True,
    )
    uid: int | None = option(
        "--uid",
        ID,
        None,
        f"owner of object-store (S3, OSS) entries and of the mount root; {_KEPT}",
        shown="the worker's",
    )
    gid: int | None = option(
        "--gid",
        ID,
        None,
        f"group of object-store entries and of the mount root; {_KEPT}",
        shown="the worker's",
    )
    file_mode: int = option(
        "--file-mode",
        MODE,
        f"{DEFAULT_FILE_MODE:04o}",
        f"octal mode of object-store files; no write bits: the mount is read-only; {_KEPT}",
    )
    dir_mode: int = option(
        "--dir-mode",
        MODE,
        f"{DEFAULT_DIR_MODE:04o}",
        f"octal mode of object-store directories and of the mount root; {_KEPT}",
    )
    no_open: bool | None = option(
        "--fuse-no-open",
        TRISTATE,
        "auto",
        "FUSE no-open mode: no OPEN/RELEASE, page cache kept across opens, warm reads never "
        "reach Python (`auto`: on with the patched pyfuse3 `scripts/setup.sh` builds)",
    )
    # READs of RAM-tier blocks answered in C by the patched pyfuse3 (cachefs/fs/native_reads.py).
    fast_read: bool | None = option(
        "--fuse-fast-read",
        TRISTATE,
        "auto",
        "answer READs of RAM-tier blocks in C inside the patched pyfuse3, every chunk checked "
        "(once while its block file is unchanged; spliced after that), without Python (`auto`: "
        "on with that pyfuse3 in no-open mode; `off`: every READ in Python, as with stock "
        "pyfuse3)",
    )
    # The kernel reads a cached small file's block file itself (FUSE passthrough, Linux >= 6.9;
    # cachefs_fast_read.c "passthrough"): it serves a block file as it is between checks, as
    # splicing does ("splicing"). Off by default: a file a reader holds open keeps its evicted
    # block's space until it is closed (see docs/architecture.md).
    passthrough: bool | None = option(
        "--fuse-passthrough",
        TRISTATE,
        "off",
        "hand files whose one block is in the RAM tier to the kernel (FUSE passthrough, Linux "
        ">= 6.9): first reads then cost an OPEN and a RELEASE answered in C and no copy through "
        "the worker; needs the native path (`auto`: when the kernel grants it)",
    )
    # Off unless asked: a fixed default port would make a second worker on the machine fail
    # to start (the control socket always serves /metrics).
    metrics_listen: str | None = option(
        "--metrics",
        OPTIONAL_ADDRESS,
        None,
        "also serve Prometheus `/metrics` on TCP there; it is always on the control socket, so "
        "that workers sharing a machine never share a port",
        shown="off",
    )
    node: str = option(
        "--node",
        NAME,
        None,
        "this node's name (what the coordinator and the other workers call it)",
        shown="the host name",
        factory=socket.gethostname,
    )

    # --- cluster mode (`cachefs worker`): follow a coordinator, serve and read peers' blocks --
    coordinator: str | None = None  # URL (--coordinator); None = single node (`cachefs up`)
    token: str | None = None  # bearer token of the coordinator and the peer endpoints
    listen: str | None = option(
        "--listen",
        ADDRESS,
        None,
        "this node's peer block server: the address other workers dial for peer reads (this "
        "node's own address and a port, not 0.0.0.0)",
        commands=frozenset({WORKER}),
        required=True,
    )
    gpus: int = option(
        "--gpus",
        COUNT,
        "8",
        "GPUs of this node, reported to the coordinator for job placement",
        commands=frozenset({WORKER}),
    )
    heartbeat_interval_s: float = option(
        "--heartbeat-interval",
        DURATION,
        "2s",
        "time between two heartbeats to the coordinator",
        commands=frozenset({WORKER}),
    )
    peer_timeout_s: float = option(
        "--peer-timeout",
        DURATION,
        "2s",
        "bound on one peer read: a dead or stalled peer costs at most this once, then reads "
        "go to the store",
        commands=frozenset({WORKER}),
    )
    preload_processes: int = option(
        "--preload-processes",
        COUNT,
        "2",
        "fetcher processes for preloads, so that the FUSE process keeps its core (`0`: fetch "
        "in threads of the worker)",
        commands=frozenset({WORKER}),
    )

    # --- not options: tuned here ----------------------------------------------------------
    # Blocks in flight per node during a preload: where the adaptive limit starts, and its
    # ceiling (cachefs/store/concurrency.py: it grows while the store keeps up, halves when it
    # answers "slow down").
    preload_concurrency: int = field(default_factory=_preload_start)
    preload_concurrency_max: int = field(default_factory=_preload_ceiling)
    fill_concurrency: int = 8  # blocks in flight per node while filling a copy from peers
    prefetch_queue_files: int = 20_000  # hinted files waiting; past it the oldest are dropped
    # Hinted blocks being fetched at once: enough to hide a store's latency (tens of ms per
    # GET), half of the store's starting limit so FUSE misses keep the other half.
    prefetch_concurrency: int = 16

    def cluster(self) -> Following | None:
        """The coordinator this worker follows, with what that needs; None on a single node.
        A ConfigError if it follows one without --listen or a token."""
        if not self.coordinator:
            return None
        if not self.listen or not self.token:
            raise ConfigError("a worker that follows a coordinator needs --listen and a token")
        return Following(self.coordinator, self.token, self.listen)

    @property
    def socket_path(self) -> str:
        return os.path.join(self.state_dir, "worker.sock")

    @property
    def ram_path(self) -> str:
        return self.ram_dir or default_ram_dir(self.state_dir)

    @property
    def readahead_kib(self) -> int:
        return self.readahead // 1024

    @property
    def permissions(self) -> MountPermissions:
        """Owner and modes of entries whose source records none (cachefs/fs/permissions.py);
        an owner not given is the worker's."""
        owner = {
            name: value
            for name, value in (("uid", self.uid), ("gid", self.gid))
            if value is not None
        }
        return MountPermissions(**owner, file_mode=self.file_mode, dir_mode=self.dir_mode)


if __name__ == "__main__":  # python -m cachefs.settings up|worker: the README's table
    command = sys.argv[1] if len(sys.argv) > 1 else UP
    print(markdown_table(WorkerConfig, command, only=command == WORKER), end="")
