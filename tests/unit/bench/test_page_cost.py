"""bench/page_cost.py run small on a real directory: every row measured, the new-page cost
derived from them, free page reporting read from this kernel's /sys when it has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bench import page_cost
from harness.processes import REPO_ROOT


def test_a_small_run_measures_every_row_and_reads_the_kernels_reporting(tmp_path, capsys):
    assert page_cost.main(["--files", "20", "--size", "10000", "--dir", str(tmp_path),
                           "--repeats", "2"]) == 0  # fmt: skip
    out, table = capsys.readouterr()
    result = json.loads(out)
    assert result["pages"] == -(-10000 // page_cost.PAGE)
    for name in ("create_write", "overwrite", "anon"):
        assert len(result["all_us_per_op"][name]) == 2
        assert result["rows"][name]["us_per_op"] == min(result["all_us_per_op"][name]) > 0
        assert f"| {name} |" in table
    rows = result["rows"]
    expected = (rows["create_write"]["us_per_op"] - rows["overwrite"]["us_per_op"]) / result[
        "pages"
    ]
    assert result["new_page_us"] == expected
    assert result["page_reporting"]["on"] == os.path.isdir(page_cost.REPORTING)
    assert os.listdir(tmp_path) == []  # its scratch files are gone


def test_backing_free_pages_takes_the_memory_and_gives_it_back():
    """In a fresh process (its peak not raised by earlier tests): the peak grows by the 64 MiB
    written, the resident size does not keep them."""
    script = (
        "from bench import page_cost\n"
        "def kib(field):\n"
        "    with open('/proc/self/status') as f:\n"
        "        return int(next(l for l in f if l.startswith(field)).split()[1])\n"
        "before = (kib('VmHWM:'), kib('VmRSS:'))\n"
        "assert page_cost.back_free_pages(64 << 20) > 0\n"
        "print(kib('VmHWM:') - before[0], kib('VmRSS:') - before[1])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    peak_growth, rss_growth = (int(v) for v in done.stdout.split())
    assert peak_growth >= 60 * 1024
    assert rss_growth < 16 * 1024


def test_backing_free_pages_never_takes_more_than_is_available(monkeypatch):
    monkeypatch.setattr(page_cost, "available_bytes", lambda: page_cost.BACK_PAGES_MARGIN)
    assert page_cost.back_free_pages(1 << 40) == 0.0  # nothing left above the margin
    monkeypatch.setattr(
        page_cost, "available_bytes", lambda: page_cost.BACK_PAGES_MARGIN + (8 << 20)
    )
    assert page_cost.back_free_pages(1 << 40) > 0  # 8 MiB, not a TiB


def test_available_memory_is_read_from_the_kernel():
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < page_cost.available_bytes() <= total


def test_a_pass_is_backed_with_a_quarter_more_than_it_reads_and_the_slack(monkeypatch):
    asked = []
    monkeypatch.setattr(page_cost, "back_free_pages", lambda n: asked.append(n) or 0.5)
    assert page_cost.back_pages_for_pass(400 << 20) == 0.5
    assert asked == [(500 << 20) + page_cost.BACK_PAGES_SLACK]
