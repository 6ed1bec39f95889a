"""One source for every setting: the README's option tables of `cachefs up`, `cachefs worker` and
`cachefs coordinator` are the tables their settings classes write (cachefs/settings.py,
coordinator/settings.py), and the CLI takes its options, defaults and help from the same
classes."""

from __future__ import annotations

import difflib
import importlib.util
import os
import subprocess
import sys
from dataclasses import fields

import pytest

from cachefs.cli import build_parser
from cachefs.commands.options import plain
from cachefs.commands.worker import worker_config
from cachefs.settings import UP, WORKER, WorkerConfig, markdown_table, options_of

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO_ROOT, "README.md")


def readme_table(heading: str) -> str:
    """The first table after ``heading`` (a whole line of the README), as written."""
    with open(README) as f:
        lines = f.read().split("\n")
    assert heading in lines, f"README.md has no heading {heading!r}"
    rows = []
    for line in lines[lines.index(heading) + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    assert rows, f"README.md has no table under {heading!r}"
    return "\n".join(rows) + "\n"


def assert_same_table(heading: str, generated: str, regenerate: str) -> None:
    written = readme_table(heading)
    diff = "\n".join(
        difflib.unified_diff(
            written.splitlines(), generated.splitlines(), "README.md", "settings", lineterm=""
        )
    )
    assert written == generated, f"{heading}: the README's table differs ({regenerate}):\n{diff}"


def test_the_readme_tables_of_up_and_worker_are_the_settings():
    assert_same_table(
        "### `cachefs up` options",
        markdown_table(WorkerConfig, UP),
        "python -m cachefs.settings up prints the table",
    )
    assert_same_table(
        "### `cachefs worker` options",
        markdown_table(WorkerConfig, WORKER, only=True),
        "python -m cachefs.settings worker prints the table",
    )


def test_the_readme_table_of_the_coordinator_is_its_settings():
    if importlib.util.find_spec("coordinator.settings") is None:
        pytest.skip("the coordinator has no settings class (coordinator/settings.py) yet")
    from coordinator import settings

    assert_same_table(
        "### `cachefs coordinator` options",
        settings.markdown_table(),
        "python -m coordinator.settings prints the table",
    )


def test_every_option_not_given_keeps_the_settings_default():
    """The CLI writes no default of its own: a worker started with no option gets exactly the
    class's defaults, and each option given reaches its field."""
    for command, extra in ((UP, []), (WORKER, ["--listen", "10.0.0.5:7701"])):
        args = build_parser().parse_args(["--state", "/tmp/s", command, *extra])
        config = worker_config(args)
        expected = WorkerConfig(state_dir="/tmp/s", **({"listen": extra[1]} if extra else {}))
        assert config == expected, command
    args = build_parser().parse_args(
        ["--state", "/tmp/s", "up", "--ram", "3GiB", "--entry-timeout", "2m", "--max-tasks", "9"]
    )
    config = worker_config(args)
    assert (config.ram_capacity, config.entry_timeout, config.max_tasks) == (3 << 30, 120.0, 9)


def test_each_default_written_as_text_parses_to_the_field_default():
    """A default shown in backticks is what a user would type: given as the option, it gives
    the same value as not giving it."""
    defaults = WorkerConfig(state_dir="/tmp/s")
    typed = 0
    for name, option in options_of(WorkerConfig):
        if option.typed is not None:
            assert option.shown() == f"`{option.typed}`"
            value = option.kind.convert(option.typed, option.flag)
            assert value == getattr(defaults, name), option.flag
            typed += 1
    assert typed >= 15


def test_only_the_cluster_and_tuning_fields_are_no_options():
    """Every setting a user may change is an option; the others are named here on purpose."""
    not_options = {item.name for item in fields(WorkerConfig)} - {
        name for name, _ in options_of(WorkerConfig)
    }
    assert not_options == {
        "state_dir",  # --state, a global option
        "coordinator",  # --coordinator, a global option
        "token",  # --token-file or CACHEFS_TOKEN
        "preload_concurrency",
        "preload_concurrency_max",
        "fill_concurrency",
        "prefetch_queue_files",
        "prefetch_concurrency",
    }


def test_help_shows_the_settings_help_and_defaults():
    done = subprocess.run(
        [sys.executable, "-m", "cachefs", "worker", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": REPO_ROOT, "COLUMNS": "1000"},
    )
    text = " ".join(done.stdout.split())  # argparse wraps and indents
    for _name, option in options_of(WorkerConfig, WORKER):
        wanted = " ".join(plain(option.help).split())
        if not option.required:
            wanted += f" (default: {plain(option.shown())})"
        assert wanted in text, option.flag
