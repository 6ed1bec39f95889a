"""`cachefs --version` and `cachefs completion SHELL` (cachefs/cli.py).

The completion scripts are shtab's, generated from the CLI's own argparse parser. The bash
script is loaded into a real bash and its registered completion function is called the way
bash calls it on TAB (COMP_WORDS, COMP_CWORD, COMP_LINE, COMP_POINT set; COMPREPLY read back).
zsh completes only inside a line editor's completion widget, so the zsh script is checked for
what can be seen without a terminal: it parses, and `eval` after `compinit` registers its
function for `cachefs`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import shtab

import cachefs
from cachefs import cli

ROOT = Path(__file__).resolve().parents[2]
CACHEFS = [sys.executable, "-m", "cachefs"]

# Completes COMP_LINE ($2) with the completion script ($1) the way bash does on TAB: the
# function that `complete -p cachefs` names gets (command, current word, previous word).
BASH_COMPLETE = r"""
source "$1" || exit 3
read -r -a spec <<< "$(complete -p cachefs)" || exit 4
function=""
for ((i = 0; i < ${#spec[@]}; i++)); do [[ ${spec[i]} == -F ]] && function=${spec[i+1]}; done
[[ -n $function ]] || exit 5
COMP_LINE=$2
COMP_POINT=${#COMP_LINE}
read -r -a COMP_WORDS <<< "$COMP_LINE"
[[ $COMP_LINE == *" " ]] && COMP_WORDS+=("")
COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
COMPREPLY=()
"$function" cachefs "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}"
printf '%s\n' "${COMPREPLY[@]}"
"""


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CACHEFS, *args], capture_output=True, text=True, timeout=120, cwd=cwd or ROOT
    )


def subcommands(*path: str) -> list[str]:
    """The subcommands the real parser accepts after ``cachefs *path``."""
    parser = cli.build_parser()
    for word in (None, *path):
        if word is not None:
            parser = subparsers(parser).choices[word]
    return list(subparsers(parser).choices)


def subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


# --- --version ---------------------------------------------------------------------------------


def test_version_prints_the_installed_version_and_exits_0():
    installed = importlib.metadata.version(cachefs.DISTRIBUTION_NAME)
    for command in (CACHEFS, [str(Path(sys.executable).with_name("cachefs"))]):
        done = subprocess.run(
            [*command, "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, f"cachefs {installed}\n", "")


def test_the_installed_version_is_the_projects_and_the_packages():
    """pyproject.toml's version, the installed metadata and ``cachefs.__version__`` (what the
    worker's status and the CSI plugin report) are one: a bump that misses one fails here."""
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert importlib.metadata.version(cachefs.DISTRIBUTION_NAME) == declared == cachefs.__version__


def test_the_distribution_name_is_the_one_the_code_looks_up():
    """pyproject.toml's [project] name is cachefs.DISTRIBUTION_NAME (what --version reads), and
    it is not "cachefs": that name on the public package index is an unrelated project."""
    declared = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    assert declared == cachefs.DISTRIBUTION_NAME != "cachefs"
    assert importlib.metadata.distribution(declared).entry_points.select(
        group="console_scripts", name="cachefs"
    )


def test_version_from_a_source_tree_that_was_never_installed(monkeypatch):
    """No installed distribution (``PYTHONPATH=. python -m cachefs`` in a checkout): the
    package's own ``__version__``. The metadata lookup is replaced by one that finds nothing;
    its real side is the test above, on the installed package."""

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli.installed_version() == cachefs.__version__


def test_version_needs_no_subcommand_and_other_options_still_need_one():
    assert run_cli("--state", "/nonexistent", "--version").returncode == 0
    done = run_cli("--state", "/nonexistent")
    assert done.returncode == 2 and "required: command" in done.stderr


# --- completion --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bash_script(tmp_path_factory) -> Path:
    done = run_cli("completion", "bash")
    assert done.returncode == 0, done.stderr
    path = tmp_path_factory.mktemp("completion") / "cachefs.bash"
    path.write_text(done.stdout)
    return path


def complete_in_bash(script: Path, line: str, cwd: Path | None = None) -> list[str]:
    """The candidates bash offers for TAB at the end of ``line``."""
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_COMPLETE, "complete", str(script), line],
        capture_output=True, text=True, timeout=120, cwd=cwd or ROOT,
    )  # fmt: skip
    assert done.returncode == 0 and done.stderr == "", (done.returncode, done.stderr)
    return [word for word in done.stdout.splitlines() if word]


def test_bash_completes_subcommands(bash_script):
    assert complete_in_bash(bash_script, "cachefs dat") == ["dataset"]
    assert complete_in_bash(bash_script, "cachefs dataset a") == ["add"]
    assert complete_in_bash(bash_script, "cachefs dataset ") == subcommands("dataset")
    assert complete_in_bash(bash_script, "cachefs job r") == ["renew", "release"]
    assert set(complete_in_bash(bash_script, "cachefs ")) == set(subcommands())
    assert complete_in_bash(bash_script, "cachefs dataset x") == []  # nothing starts with x


def test_bash_completes_options_and_choices(bash_script):
    assert complete_in_bash(bash_script, "cachefs --ver") == ["--version"]
    assert complete_in_bash(bash_script, "cachefs completion ") == list(cli.COMPLETION_SHELLS)
    assert complete_in_bash(bash_script, "cachefs up --admission ") == ["avoid-eviction", "lru"]
    assert "--first-byte-timeout" in complete_in_bash(bash_script, "cachefs dataset add --f")


def test_bash_completes_paths_where_an_option_takes_one(bash_script, tmp_path):
    (tmp_path / "state-a").mkdir()
    (tmp_path / "state-b").mkdir()
    (tmp_path / "secret-token").write_text("t")
    assert sorted(complete_in_bash(bash_script, "cachefs up --state s", tmp_path)) == [
        "state-a",
        "state-b",
    ]  # directories only
    # files, and directories to descend into
    assert sorted(complete_in_bash(bash_script, "cachefs --token-file s", tmp_path)) == [
        "secret-token",
        "state-a",
        "state-b",
    ]
    assert complete_in_bash(bash_script, "cachefs --token-file se", tmp_path) == ["secret-token"]


def test_zsh_script_parses_and_registers_its_function(tmp_path):
    done = run_cli("completion", "zsh")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#compdef cachefs\n")
    for word in subcommands():
        assert f"{word}:" in done.stdout, f"zsh script misses the subcommand {word}"
    zsh = shutil.which("zsh")
    if zsh is None:
        pytest.skip("zsh is not installed (scripts/setup.sh installs it)")
    script = tmp_path / "_cachefs"
    script.write_text(done.stdout)
    assert subprocess.run([zsh, "-n", str(script)], timeout=120).returncode == 0
    registered = subprocess.run(
        [zsh, "-f", "-c", 'autoload -U compinit && compinit -u -D && eval "$(<$1)" && '
         'print -r -- "${_comps[cachefs]}"', "zsh", str(script)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert registered.stdout.strip() == "_shtab_cachefs", registered


@pytest.mark.parametrize(
    "shell, registration", [("fish", "complete -c cachefs"), ("tcsh", "complete cachefs")]
)
def test_fish_and_tcsh_scripts_are_produced(shell, registration):
    """Produced and registering completions for `cachefs`; not run (neither shell is here)."""
    done = run_cli("completion", shell)
    assert done.returncode == 0 and registration in done.stdout, done.stderr


def test_the_shells_offered_are_shtabs_and_others_are_refused_in_one_line():
    assert set(cli.COMPLETION_SHELLS) <= set(shtab.SUPPORTED_SHELLS)
    done = run_cli("completion", "powershell")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = [line for line in done.stderr.splitlines() if "error" in line]
    assert line.startswith(
        "cachefs completion: error: argument shell: invalid choice: 'powershell'"
    )
