"""The suite's report: targets, a markdown page and PNG plots, from the results dict alone.

Everything here is a pure function of the JSON that ``run.py`` writes, so a report can be
rendered again from a saved ``results.json`` (``python -m bench report DIR``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

SYSTEM_ORDER = ("tmpfs", "cachefs", "s3fs", "rclone", "boto3")
PASS_TITLES = {
    "cold": "first epoch, cold (every file from the store)",
    "after_preload": "first epoch after `cachefs preload` (page cache dropped)",
    "warm": "later epochs (warm)",
}
TARGET_READERS = 4
WARM_VS_TMPFS = 0.7
WARM_VS_PEERS = 10.0
PRELOAD_VS_BOTO3 = 5.0
EMULATOR_VS_TMPFS = 0.8


# --- targets ---------------------------------------------------------------------------------


def small_pass(results: dict, system: str, name: str, threads: int) -> dict | None:
    passes = (results.get("small") or {}).get("passes", [])
    return next(
        (p for p in passes if (p["system"], p["name"], p["threads"]) == (system, name, threads)),
        None,
    )


def _target(name: str, value: float | None, threshold: float, unit: str = "x") -> dict:
    met = None if value is None else value >= threshold
    return {"target": name, "value": value, "threshold": threshold, "unit": unit, "met": met}


def _ratio(a: dict | None, b: dict | None, key: str = "files_per_s") -> float | None:
    if not a or not b or not b[key]:
        return None
    return a[key] / b[key]


def evaluate(results: dict) -> list[dict]:
    """The targets, each with its value (None when a part did not run)."""
    r = TARGET_READERS
    warm = small_pass(results, "cachefs", "warm", r)
    rows = [
        _target(
            f"warm small files >= {WARM_VS_TMPFS}x tmpfs direct, {r} readers",
            _ratio(warm, small_pass(results, "tmpfs", "warm", r)),
            WARM_VS_TMPFS,
        )
    ]
    for peer in ("s3fs", "rclone"):
        rows.append(
            _target(
                f"warm small files >= {WARM_VS_PEERS:g}x {peer} (warm), {r} readers",
                _ratio(warm, small_pass(results, peer, "warm", r)),
                WARM_VS_PEERS,
            )
        )
    rows.append(
        _target(
            f"first epoch after preload >= {PRELOAD_VS_BOTO3:g}x direct boto3 reads, {r} readers",
            _ratio(
                small_pass(results, "cachefs", "after_preload", r),
                small_pass(results, "boto3", "cold", r),
            ),
            PRELOAD_VS_BOTO3,
        )
    )
    emulator = results.get("emulator") or {}
    tmpfs_n = largest(emulator.get("tmpfs"))
    emulator_variants = {
        "cachefs": "warm",
        "cachefs_ram_tier": "page cache and dentries dropped before each trial",
        "cachefs_ram_tier_listed": "samples listed, then page cache dropped before each trial",
    }
    for variant, what in emulator_variants.items():
        if variant not in emulator and variant == "cachefs_ram_tier_listed":
            continue  # results from before this variant existed
        n = largest(emulator.get(variant))
        value = None if n is None or not tmpfs_n else n / tmpfs_n
        rows.append(
            _target(
                f"emulator: accelerators kept >= 90 % busy, cachefs ({what}) >= "
                f"{EMULATOR_VS_TMPFS}x tmpfs",
                value,
                EMULATOR_VS_TMPFS,
            )
        )
    for row in (results.get("thrash") or {}).get("targets", []):
        target = _target(row["target"], row["value"], row["threshold"], row.get("unit", "x"))
        if row["threshold"] <= 0:  # informational (lru): a number, no verdict
            target["met"] = None
        rows.append(target)
    return rows


def largest(run: dict | None) -> int | None:
    return None if not run else run["search"]["largest_accelerators"]


# --- markdown --------------------------------------------------------------------------------


def render_markdown(results: dict, plots: Sequence[str] = ()) -> str:
    m = results["machine"]
    lines = [
        f"# cachefs benchmark suite — {results['date']} (preset `{results['preset']['name']}`)",
        "",
        f"- machine: {m['nproc']} cores ({m['cpu']}), {m['memory_bytes'] / 2**30:.1f} GiB, "
        f"kernel {m['kernel']}, Python {m['python']}",
        f"- command: `{results['command']}` (from the repository root, as root)",
        f"- cachefs at {_git(results)}; started {results['started']}, {results['wall_s'] / 60:.0f} "
        f"min; load average before {_load(results['load_before'])}, after "
        f"{_load(results['load_after'])}",
        f"- store: {_backend(results)}",
        "",
        "## Targets (measured side by side in this run; never asserted in tests)",
        "",
        "| target | value | threshold | met |",
        "|---|---:|---:|---|",
    ]
    for row in evaluate(results):
        value = "—" if row["value"] is None else f"{row['value']:.2f}{row['unit']}"
        met = "—" if row["met"] is None else ("PASS" if row["met"] else "FAIL")
        lines.append(f"| {row['target']} | {value} | {row['threshold']:g}{row['unit']} | {met} |")
    lines += _small_section(results)
    lines += _large_section(results)
    lines += _metadata_section(results)
    lines += _emulator_section(results)
    lines += _thrash_section(results)
    lines += _multinode_section(results)
    lines += _systems_section(results)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})"
                                         for p in plots]  # fmt: skip
    if results.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {note}" for note in results["notes"]]
    return "\n".join(lines) + "\n"


def _small_section(results: dict) -> list[str]:
    small = results.get("small")
    if not small:
        return []
    s = small["sizes"]
    lines = [
        "",
        "## Small files (ImageNet-like)",
        "",
        f"{small['files']:,} files, {small['bytes'] / 1e9:.2f} GB, mean {s['mean'] / 1e3:.0f} KB, "
        f"median {s['median'] / 1e3:.0f} KB, in class directories; one shuffled order; each "
        f"reader takes every N-th file (open, read to the end, close). Cold passes read a "
        f"shuffled subset of {small['cold_files']:,} files (every read goes to the store); the "
        "others read every file, except s3fs and rclone, whose warm passes read the same subset "
        "(s3fs sends a HEAD to the store on every open, so a full warm pass takes many minutes). "
        "Warm passes re-read their files right before the timed run. "
        "Lengths of all files and the sha256 of 200 files are checked in every run. "
        "`store GETs` = object GETs the proxy forwarded during the kept run.",
        "",
        "| pass | system | readers | files/s | MB/s | vs tmpfs warm | store GETs | runs (s) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name in PASS_TITLES:
        for system in SYSTEM_ORDER:
            for p in small["passes"]:
                if (p["name"], p["system"]) != (name, system):
                    continue
                tmpfs = small_pass(results, "tmpfs", "warm", p["threads"])
                ratio = _ratio(p, tmpfs)
                lines.append(
                    f"| {PASS_TITLES[name]} | {system} | {p['threads']} | "
                    f"{p['files_per_s']:,.0f} | {1000 * p['gb_per_s']:,.1f} | "
                    f"{'' if ratio is None else f'{ratio:.3f}x'} | "
                    f"{p['worker_delta'].get('store_gets', '')} | "
                    f"{', '.join(f'{t:.2f}' for t in p['all_seconds'])} |"
                )
    if small.get("preload"):
        pl = small["preload"]
        lines += [
            "",
            f"`cachefs preload` of the whole dataset: {pl['objects']:,} objects in "
            f"{pl['seconds']:.1f} s = {pl['objects_per_s']:,.0f} objects/s, "
            f"{pl['mb_per_s']:.1f} MB/s (request to `completed`).",
        ]
    return lines


def _large_section(results: dict) -> list[str]:
    big = results.get("large")
    if not big:
        return []
    sizes = ", ".join(f"{s['size'] >> 20}" for s in big["shards"])
    lines = [
        "",
        "## Large files (TFRecord-like shards)",
        "",
        f"{len(big['shards'])} shards ({sizes} MiB; {big['bytes'] / 1e9:.2f} GB). Sequential: "
        "each reader reads whole shards start to end in 1 MiB `read()`s (reader t takes shards "
        "t, t+N, ...). Strided: 1 MiB at every 8 MiB (1/8 of the bytes). boto3 reads ranges of "
        f"{big['s3_range_bytes'] >> 20} MiB. Every byte read is checked (xxh3 per 1 MiB chunk).",
        "",
        "| pattern | readers | system | state | MB/s | s | store GETs |",
        "|---|---:|---|---|---:|---:|---:|",
    ]
    for run in sorted(big["runs"], key=lambda r: (r["pattern"], r["readers"],
                                                   SYSTEM_ORDER.index(r["system"]))):  # fmt: skip
        lines.append(
            f"| {run['pattern']} | {run['readers']} | {run['system']} | {run['state']} | "
            f"{run['mb_per_s']:,.1f} | {run['seconds']:.2f} | {run['store_gets']} |"
        )
    return lines


def _metadata_section(results: dict) -> list[str]:
    meta = results.get("metadata")
    if not meta:
        return []
    lines = [
        "",
        "## Metadata (find / stat)",
        "",
        f"The big namespace: {meta['entries']:,} files in ImageNet's class directories, served "
        f"by cachefs from a local `file://` source (the `dataset add` lists it and builds the "
        f"snapshot: {meta['cachefs_add_s']:.1f} s); tmpfs is the same tree read directly. The "
        f"peers list a smaller namespace ({meta['peer_entries']:,} zero-byte objects) from the "
        "store, and so does cachefs for comparison. Cold = page cache, dentries and inodes "
        "dropped first (for s3fs/rclone also their own caches).",
        "",
        "| namespace | system | walk cold, entries/s | walk warm, entries/s | `find`, s "
        "| stat, files/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    rows = [("big", "tmpfs", meta.get("tmpfs")), ("big", "cachefs", meta.get("cachefs"))]
    rows += [("store", name, m) for name, m in meta.get("peers", {}).items()]
    for namespace, system, m in rows:
        if not m:
            continue
        lines.append(
            f"| {namespace} | {system} | {m['walk_cold']['entries_per_s']:,.0f} | "
            f"{m['walk_warm']['entries_per_s']:,.0f} | {m['find']['seconds']:.2f} | "
            f"{m['stat']['files_per_s']:,.0f} |"
        )
    rss = [("before the add", meta.get("rss_before_add")), ("after the add",
           meta.get("rss_after_add")), ("after the walks", meta.get("rss_after_walk"))]  # fmt: skip
    lines += [
        "",
        "cachefs worker RSS: "
        + "; ".join(f"{what} {r['VmRSS'] / 2**20:,.0f} MiB" for what, r in rss if r)
        + (f" (peak {rss[-1][1]['VmHWM'] / 2**20:,.0f} MiB)" if rss[-1][1] else ""),
    ]
    return lines


def _emulator_section(results: dict) -> list[str]:
    runs = results.get("emulator")
    if not runs:
        return []
    first = next(iter(runs.values()))
    w, d = first["workload"], first["dataset"]
    demand = w["demand_samples_per_s_per_accelerator"]
    lines = [
        "",
        "## Training-input emulator (MLPerf Storage ResNet-50 shape)",
        "",
        f"{d['samples']:,} samples of {d['sample_size']:,} B; per accelerator batch "
        f"{w['batch']}, {1000 * w['compute_s']:.1f} ms of compute per batch (scale "
        f"{w['scale']:g} of 400 / 224 ms: the same {demand:,.0f} samples/s per accelerator), "
        f"{w['batches']} batches per trial, {w['readers']} reader threads each, one process per "
        "accelerator. Largest N whose mean utilisation is >= 90 %. Each trial starts after "
        "the quiet-CPU wait and the preparation its row names.",
        "",
        "| data path | before each trial | largest N | vs tmpfs | utilisation by N |",
        "|---|---|---:|---:|---|",
    ]
    tmpfs_n = largest(runs.get("tmpfs"))
    for name, run in runs.items():
        n = largest(run)
        ratio = f"{n / tmpfs_n:.2f}x" if tmpfs_n else "—"
        trials = ", ".join(
            f"{t['accelerators']}: {t['mean_utilisation']:.0%}" for t in run["trials"]
        )
        lines.append(f"| {name} | {_trial_preparation(run)} | {n} | {ratio} | {trials} |")
    return lines


def _trial_preparation(run: dict) -> str:
    workload = run["workload"]
    if workload.get("drop_caches"):
        return "page cache dropped"
    if workload.get("warm_up"):
        return "every sample read once"
    return "nothing"


def _thrash_section(results: dict) -> list[str]:
    thrash = results.get("thrash")
    if not thrash:
        return []
    lines = [
        "",
        "## Thrash: the dataset is twice the cache, 3 shuffled epochs",
        "",
        "| policy | capacity/size | epoch | hit ratio | files/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for policy, run in thrash["policies"].items():
        for epoch in run["epochs"]:
            lines.append(
                f"| {policy} | {run['capacity_ratio']:.2f} | {epoch['epoch']} | "
                f"{epoch['hit_ratio']:.3f} | {epoch['files_per_s']:,.0f} |"
            )
    return lines


def _multinode_section(results: dict) -> list[str]:
    multi = results.get("multinode")
    if not multi:
        return []
    lines = [
        "",
        "## Multi-node: 3 workers, local vs peer-tier reads",
        "",
        f"`{multi['command']}` ({multi['dataset']['files']:,} files; its own moto, no delay "
        "proxy; full report in `cluster_bench.md`).",
        "",
    ]
    raw, preload = multi.get("backend_raw_get"), multi.get("preload")
    if raw and preload:
        lines += [
            f"Preload of 100 %: {preload['objects_per_s']:,.0f} objects/s against "
            f"{raw['objects_per_s']:,.0f} raw GETs/s at the same {raw['in_flight']} in flight "
            f"({preload['objects_per_s'] / raw['objects_per_s']:.2f}x).",
            "",
        ]
    lines += [
        "| node | local tier files/s | peer tier files/s | all files, files/s |",
        "|---|---:|---:|---:|",
    ]
    for node in multi.get("node_summary", []):
        lines.append(
            f"| {node['node']} | {node.get('local_files_per_s', 0):,.0f} | "
            f"{node.get('peer_files_per_s', 0):,.0f} | {node.get('all_files_per_s', 0):,.0f} |"
        )
    return lines


def _systems_section(results: dict) -> list[str]:
    lines = ["", "## How each system ran", ""]
    for name, info in results.get("systems", {}).items():
        shown = {k: v for k, v in info.items() if k != "flags"}
        lines.append(f"- **{name}**: `{shown}`")
        for flag, why in (info.get("flags") or {}).items():
            lines.append(f"  - `{flag}`: {why}")
    return lines


def _git(results: dict) -> str:
    git = results.get("git") or {}
    dirty = " (with uncommitted changes)" if git.get("uncommitted_changes") else ""
    return f"{git.get('head', '?')}{dirty}"


def _load(load: Sequence[float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def _backend(results: dict) -> str:
    b = (results.get("systems") or {}).get("backend") or {}
    bandwidth = b.get("bandwidth_per_connection") or 0
    shown = f"{bandwidth / 2**20:.0f} MiB/s per connection" if bandwidth else "no bandwidth cap"
    return (
        f"{b.get('store', '?')}, behind the delay proxy: {b.get('first_byte_ms', '?')} ms to "
        f"the first byte, {shown}"
    )


# --- plots -----------------------------------------------------------------------------------


def write_plots(results: dict, out_dir: str) -> list[str]:
    """PNG plots next to the report; returns their paths (none when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for name, draw in (
        ("small_files.png", _plot_small),
        ("large_files.png", _plot_large),
        ("emulator.png", _plot_emulator),
        ("thrash.png", _plot_thrash),
    ):
        figure = draw(plt, results)
        if figure is None:
            continue
        path = os.path.join(out_dir, name)
        figure.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(figure)
        written.append(path)
    return written


def _plot_small(plt, results: dict):
    small = results.get("small")
    if not small:
        return None
    names = [n for n in PASS_TITLES if any(p["name"] == n for p in small["passes"])]
    figure, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        passes = [p for p in small["passes"] if p["name"] == name]
        # tmpfs has only warm passes: it is drawn on every panel as the limit.
        limit = [p for p in small["passes"] if p["system"] == "tmpfs"]
        for system in SYSTEM_ORDER:
            mine = sorted((p for p in passes + (limit if name != "warm" else [])
                           if p["system"] == system), key=lambda p: p["threads"])  # fmt: skip
            if mine:
                ax.plot([p["threads"] for p in mine], [p["files_per_s"] for p in mine],
                        marker="o", label=system)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(PASS_TITLES[name].replace("`", ""), fontsize=9)
        ax.set_xlabel("reader threads")
        ax.set_ylabel("files/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle("Small files: files/s (log scale)")
    return figure


def _plot_large(plt, results: dict):
    big = results.get("large")
    if not big:
        return None
    labels = sorted({(r["pattern"], r["readers"], r["state"]) for r in big["runs"]})
    figure, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(SYSTEM_ORDER)
    for i, system in enumerate(SYSTEM_ORDER):
        values = []
        for label in labels:
            run = next((r for r in big["runs"] if (r["pattern"], r["readers"], r["state"]) ==
                        label and r["system"] == system), None)  # fmt: skip
            values.append(run["mb_per_s"] if run else 0)
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=system)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels([f"{p}\n{n} readers, {s}" for p, n, s in labels], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("MB/s")
    ax.set_title("Large shards: MB/s (log scale)")
    ax.legend(fontsize=8)
    return figure


def _plot_emulator(plt, results: dict):
    runs = results.get("emulator")
    if not runs:
        return None
    figure, ax = plt.subplots(figsize=(7, 4))
    for name, run in runs.items():
        trials = sorted(run["trials"], key=lambda t: t["accelerators"])
        ax.plot([t["accelerators"] for t in trials], [t["mean_utilisation"] for t in trials],
                marker="o", label=f"{name} (N={largest(run)})")  # fmt: skip
    ax.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("emulated accelerators")
    ax.set_ylabel("mean utilisation")
    ax.set_title("Training-input emulator: utilisation by N (target line 90 %)")
    ax.legend(fontsize=8)
    return figure


def _plot_thrash(plt, results: dict):
    thrash = results.get("thrash")
    if not thrash:
        return None
    figure, ax = plt.subplots(figsize=(6, 4))
    capacity = None
    for policy, run in thrash["policies"].items():
        epochs = run["epochs"]
        ax.plot([e["epoch"] for e in epochs], [e["hit_ratio"] for e in epochs], marker="o",
                label=policy)  # fmt: skip
        capacity = run["capacity_ratio"]
    if capacity is not None:
        ax.axhline(capacity, color="grey", linestyle="--", linewidth=1, label="capacity/size")
    ax.set_xlabel("epoch")
    ax.set_ylabel("hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title("Thrash: dataset = 2x cache")
    ax.legend(fontsize=8)
    return figure
