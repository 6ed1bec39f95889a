"""bench/cluster_bench.py without a cluster: file classification by owner, counters and deltas,
the placement check, targets and notes, the verified reader (real files), the report writers.
No timing assertions, no processes started."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash

from bench.cluster_bench import (
    BenchmarkFailure,
    blocks_of,
    classify_by_owner,
    counter_delta,
    cpu_split,
    evaluate,
    node_summary,
    parse_proc_stat,
    placement_check,
    ram_per_node,
    read_files,
    reader_split,
    render_markdown,
    sanity_notes,
    timeline_summary,
    worker_counters,
    write_results,
)
from bench.datagen import plan_dataset
from cachefs.cache.base import shard_of
from cachefs.protocol import owner_table

NODES = ["n2", "n1", "n3"]  # unsorted on purpose: the cluster sorts them


def test_classification_partitions_files_and_agrees_with_the_owner_table():
    keys = [spec.path for spec in plan_dataset(500, classes=10).files]
    owned = classify_by_owner("imagenet", keys, NODES)
    assert set(owned) == {"n1", "n2", "n3"}
    assert sorted(i for indices in owned.values() for i in indices) == list(range(len(keys)))
    table = owner_table("imagenet", sorted(NODES))
    for node, indices in owned.items():
        assert all(table[shard_of(keys[i])] == node for i in indices)
    assert all(indices for indices in owned.values())  # 500 files reach every node


def test_classification_depends_on_the_dataset_name_and_keeps_empty_nodes():
    keys = [f"train/x/{i}.JPEG" for i in range(200)]
    assert classify_by_owner("a", keys, NODES) != classify_by_owner("b", keys, NODES)
    one = classify_by_owner("a", keys[:1], NODES)
    assert sorted(len(v) for v in one.values()) == [0, 0, 1]


def test_reader_split_covers_the_order_once():
    parts = reader_split([5, 3, 9, 1, 7], 2)
    assert parts == [[5, 9, 7], [3, 1]]
    assert reader_split([1], 3) == [[1], [], []]


def _status(ram=0, peer=0, store_gets=0, peer_ok=0, served_by_me=0):
    return {
        "reads": {
            "hits": {"ram": ram // 100, "ssd": 0, "recent": 0},
            "misses": peer // 100,
            "bytes_served": {"ram": ram, "ssd": 0, "recent": 0, "peer": peer, "store": 0},
        },
        "peers": {"requests": {"ok": peer_ok} if peer_ok else {}, "blocks_served": served_by_me},
        "store": {"requests": {"get:ok": store_gets, "list:ok": 3, "get:error": 1}},
    }


def test_worker_counters_and_delta():
    before = worker_counters(_status(ram=1000))
    after = worker_counters(_status(ram=1500, peer=300, store_gets=2, peer_ok=3))
    assert before["store_gets"] == 1  # get:error counts as a GET too, list does not
    delta = counter_delta(before, after)
    assert delta["served_ram"] == 500
    assert delta["served_peer"] == 300
    assert delta["peer_req_ok"] == 3  # appeared only after
    assert delta["store_gets"] == 2
    assert delta["serving_reads"] == delta["forwarded_reads"] == 0  # one process


def test_worker_counters_of_a_mount_served_by_several_processes():
    status = _status(ram=1000)
    status["fuse_fast_read"] = {"reads": 90, "serving_reads": 40, "serving_peer_reads": 25}
    status["fuse_processes"] = {"forwarded": {"read": 7, "lookup": 3}}
    counters = worker_counters(status)
    assert (counters["serving_reads"], counters["serving_peer_reads"]) == (40, 25)
    assert counters["forwarded_reads"] == 7


def _locality(cached: dict[str, int]) -> dict:
    return {
        "cached_bytes": sum(cached.values()),
        "nodes": [{"node": n, "cached_bytes": b} for n, b in cached.items()],
    }


def test_placement_check_matches_nodes_to_their_shares():
    sizes = [10, 20, 30, 40]
    owned = {"n1": [0, 3], "n2": [1, 2]}
    good = placement_check(_locality({"n1": 50, "n2": 50}), owned, sizes, 100)
    assert good["complete"] and good["all_nodes_match"]
    assert [r["files_owned"] for r in good["nodes"]] == [2, 2]
    swapped = placement_check(_locality({"n1": 60, "n2": 40}), owned, sizes, 100)
    assert swapped["complete"] and not swapped["all_nodes_match"]
    short = placement_check(_locality({"n1": 50}), owned, sizes, 100)
    assert not short["complete"]
    assert short["nodes"][1]["cached_bytes"] == 0


def test_read_files_verifies_length_and_hash(tmp_path):
    payloads = [bytes([i]) * (1000 + i) for i in range(6)]
    paths = []
    for i, data in enumerate(payloads):
        path = tmp_path / f"f{i}"
        path.write_bytes(data)
        paths.append(str(path))
    sizes = [len(d) for d in payloads]
    hashes = [xxhash.xxh3_64_intdigest(d) for d in payloads]
    run = read_files(paths, sizes, hashes, [4, 0, 2], 2)
    assert (run.files, run.bytes) == (3, sizes[4] + sizes[0] + sizes[2])
    assert read_files(paths, sizes, hashes, [], 4).files == 0

    (tmp_path / "f2").write_bytes(b"\0" * sizes[2])  # same length, other bytes
    with pytest.raises(BenchmarkFailure, match="f2: content differs"):
        read_files(paths, sizes, hashes, [2], 1)
    (tmp_path / "f2").write_bytes(b"short")
    with pytest.raises(BenchmarkFailure, match="f2: read 5 bytes"):
        read_files(paths, sizes, hashes, [0, 2], 1)


def test_ram_and_blocks_helpers():
    assert ram_per_node(220_000_000, 3, "auto") == "512MiB"
    assert ram_per_node(3 * 2**30, 3, "auto") == "2048MiB"
    assert ram_per_node(1, 3, "1GiB") == "1GiB"
    assert blocks_of(1, 4 << 20) == 1
    assert blocks_of((4 << 20) + 1, 4 << 20) == 2


def _read(node, kind, files, seconds, delta, store_gets=0):
    return {
        "node": node,
        "kind": kind,
        "readers": 4,
        "files": files,
        "bytes": files * 100,
        "blocks": files,
        "seconds": seconds,
        "files_per_s": files / seconds,
        "mb_per_s": files * 100 / seconds / 1e6,
        "cpu_busy_before": 0.1,
        "delta": delta,
        "store_gets_all_nodes": store_gets,
        "peer_blocks_served_by_others": delta.get("peer_req_ok", 0),
        "worker_cpu_ms_per_file": {"this_node": 0.5, "other_nodes": 0.25},
    }


def _results() -> dict:
    reads = [
        _read("n1", "local", 10, 0.01, {"served_ram": 1000, "hits_ram": 10}),
        _read("n1", "peer", 20, 0.1, {"served_peer": 2000, "peer_req_ok": 20, "misses": 20}),
        _read("n1", "all", 30, 0.11, {"served_ram": 1000, "served_peer": 2000, "peer_req_ok": 20}),
    ]
    sizes = [100] * 30
    owned = {"n1": list(range(10)), "n2": list(range(10, 30))}
    results = {
        "date": "2026-01-02",
        "command": ".venv/bin/python -m bench.cluster_bench --files 30",
        "git": {"head": "abc1234", "uncommitted_changes": True},
        "machine": {
            "nproc": 2,
            "cpu": "x",
            "memory_bytes": 8 << 30,
            "kernel": "6.1",
            "python": "3.11",
        },
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.0, 1.0],
        "dataset": {
            "files": 30,
            "classes": 1,
            "bytes": 3000,
            "mean_size": 100,
            "median_size": 100,
            "seed": 0,
            "block_size": 4 << 20,
        },
        "source": "s3: moto",
        "ram_per_node": "512MiB",
        "cluster": {
            "nodes": 2,
            "preload_processes": 2,
            "heartbeat_interval": "0.5s",
            "worker_args": "",
        },
        "readers": 4,
        "verification": "all",
        "backend_raw_get": {
            "processes": 4,
            "threads_per_process": 1,
            "in_flight": 4,
            "objects": 30,
            "bytes": 3000,
            "seconds": 0.15,
            "objects_per_s": 200.0,
            "mb_per_s": 0.02,
            "cpu_busy_before": 0.1,
            "cpu_busy_during": 0.95,
            "cpu_s": {"get_clients": 0.12, "moto": 0.15},
        },
        "preload": {
            "in_flight": 4,
            "objects": 30,
            "bytes": 3000,
            "seconds": 0.2,
            "objects_per_s": 150.0,
            "mb_per_s": 0.015,
            "coordinator_elapsed_s": 0.18,
            "first_object_done_s": 0.05,
            "timeline": [
                {"s": 0.0, "done": 0, "n1": 0, "n2": None},
                {"s": 1.01, "done": 12, "n1": 10, "n2": 20, "helper_processes": {"n1": 4, "n2": 4}},
            ],
            "cpu_busy_before": 0.1,
            "cpu_busy_during": 0.9,
            "cpu_s": {
                "worker_n1": 0.1,
                "worker_n1:children": 0.1,
                "worker_n2": 0.1,
                "coordinator": 0.03,
                "moto": 0.15,
            },
        },
        "placement": placement_check(_locality({"n1": 1000, "n2": 2000}), owned, sizes, 3000),
        "reads": reads,
        "node_summary": node_summary(reads),
        "worker_rss_bytes": {"n1": 100 << 20},
        "worker_fuse_no_open": {"n1": True, "n2": True},
    }
    results["targets"] = evaluate(results)
    results["notes"] = sanity_notes(results)
    return results


def test_targets_and_notes():
    results = _results()
    assert [round(t["value"], 3) for t in results["targets"]] == [0.75, 0.75, 0.2]
    assert results["targets"][2]["target"].startswith("n1: peer-tier files/s >= 0.7x")
    assert not any(t["met"] for t in results["targets"])
    assert results["notes"] == []  # every counter as expected

    bad = _results()
    bad["reads"][0]["delta"]["peer_req_ok"] = 2  # a "local" pass that went to peers
    bad["reads"][1]["delta"]["peer_req_failed"] = 1
    bad["reads"][2]["store_gets_all_nodes"] = 5
    notes = sanity_notes(bad)
    assert any("n1 local" in n and "2 peer reads" in n for n in notes)
    assert any("peer requests not ok: peer_req_failed 1" in n for n in notes)
    assert any("5 store GETs" in n for n in notes)
    assert evaluate({"preload": None}) == []

    crowded = _results()
    crowded["preload"]["timeline"][1]["helper_processes"]["n2"] = 13  # 6 process pools
    notes = sanity_notes(crowded)
    assert len(notes) == 1
    assert "expected at most 4" in notes[0] and "n2 13" in notes[0]


def test_node_summary_per_node():
    summary = node_summary(_results()["reads"])
    assert summary == [
        {
            "node": "n1",
            "local_files": 10,
            "local_files_per_s": pytest.approx(1000),
            "local_mb_per_s": pytest.approx(0.1),
            "peer_files": 20,
            "peer_files_per_s": pytest.approx(200),
            "peer_mb_per_s": pytest.approx(0.02),
            "all_files": 30,
            "all_files_per_s": pytest.approx(30 / 0.11),
            "all_mb_per_s": pytest.approx(3000 / 0.11 / 1e6),
        }
    ]


def test_markdown_and_files(tmp_path):
    results = _results()
    text = render_markdown(results)
    assert "| cachefs preload 100 % (2 nodes × 2 fetcher processes)" in text
    assert "| 4.0 / 5.0 | |" in text  # raw GET: client / moto CPU ms per object
    assert "| 11.0 / 5.0 | 0.75x |" in text
    assert "| cachefs preload | worker_n1:children | 3.33 |" in text
    assert "| n1 | local tier (files this node owns) | 10 |" in text
    assert "| 0 | 0 | 0.50 / 0.25 | 10% |" in text
    assert "| n1 | 1,000 | 200 | 0.20x | 273 |  |" in text
    assert "one worker holding every block (same run" not in text
    assert "| **all** | 30 | 3,000 | 3,000 | yes |" in text
    assert "FUSE no-open mode: on" in text
    assert "(`--no-back-pages`)" in text
    assert "(`--back-pages`)" in render_markdown({**results, "back_pages": True})
    assert (
        "| s | objects done | n1 fetched (helper processes) | n2 fetched (helper processes) |"
        in (text)
    )
    assert "| 0.0 | 0 | 0 | — |" in text
    assert "| 1.0 | 12 | 10 (4) | 20 (4) |" in text
    assert "`.venv/bin/python -m bench.cluster_bench --files 30`" in text

    written = write_results(results, json_path=None, save_dir=str(tmp_path / "out"))
    assert [p.rsplit("/", 1)[1] for p in written] == ["2026-01-02.json", "2026-01-02.md"]
    assert json.loads(Path(written[0]).read_text())["preload"]["objects"] == 30
    assert Path(written[1]).read_text() == text


def test_the_one_worker_reference_gives_each_node_its_all_files_ratio():
    results = _results()
    reference = _read("n1", "all", 30, 0.03, {"served_ram": 3000})
    results["one_node_reference"] = {
        "ram_per_node": "1GiB",
        "preload_objects_per_s": 300.0,
        "read": reference,
        "all_files_per_s": reference["files_per_s"],
    }
    targets = {t["target"]: t for t in evaluate(results)}
    target = targets["n1: all files/s >= 0.6x one worker holding every block"]
    assert target["value"] == pytest.approx((30 / 0.11) / 1000)
    assert not target["met"]
    text = render_markdown(results)
    assert "| n1 | 1,000 | 200 | 0.20x | 273 | 0.27x |" in text
    assert "| one worker holding every block (same run, RAM tier 1GiB) | | | | 1,000 | 1.00x |" in (
        text
    )
    assert "(30 files, 0.03 s, worker CPU 0.50 ms/file)" in text
    assert sanity_notes(results) == []
    reference["delta"]["misses"] = 3
    reference["store_gets_all_nodes"] = 3
    notes = sanity_notes(results)
    assert any("the one-worker reference: 3 misses" in n for n in notes)
    assert any("the one-worker reference: 3 store GETs" in n for n in notes)

    failed = _results()
    failed["one_node_reference"] = {"ram_per_node": "1GiB", "error": "BenchmarkFailure: boom"}
    assert not [t for t in evaluate(failed) if "one worker" in t["target"]]
    assert "the one-worker reference failed: BenchmarkFailure: boom" in sanity_notes(failed)
    assert "one worker holding every block (same run" not in render_markdown(failed)


def test_proc_stat_parsing_and_cpu_split():
    # the command name may hold spaces and parentheses
    text = "1234 (python -m (x)) S 1 777 777 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 3 0 1"
    assert parse_proc_stat(text) == (777, 300)
    assert cpu_split({"cpu_s": {"worker_n1": 1.0, "coordinator": 0.5, "moto": 2.0}}) == (1.5, 2.0)
    assert cpu_split({}) == (None, None)


def test_timeline_summary_finds_start_up_and_the_window_where_all_nodes_fetch():
    timeline = [
        {"s": 0.0, "done": 0, "n1": 0, "n2": 0},
        {"s": 1.0, "done": 0, "n1": 5, "n2": 0},
        {"s": 2.0, "done": 5, "n1": 10, "n2": 2},
        {"s": 3.0, "done": 12, "n1": 18, "n2": 8},
        {"s": 4.0, "done": 20, "n1": 20, "n2": None},  # a status that did not answer
        {"s": 5.0, "done": 30, "n1": 20, "n2": 10},
    ]
    summary = timeline_summary(timeline, {"n1": 20, "n2": 10})
    assert summary["nodes"]["n1"] == {
        "blocks_owned": 20,
        "first_fetch_by_s": 1.0,
        "all_fetched_by_s": 4.0,
    }
    assert summary["nodes"]["n2"]["first_fetch_by_s"] == 2.0
    assert summary["nodes"]["n2"]["all_fetched_by_s"] == 5.0
    window = summary["all_nodes_fetching"]
    assert (window["from_s"], window["to_s"], window["blocks"]) == (2.0, 3.0, 14)
    assert window["blocks_per_s"] == pytest.approx(14)
    assert timeline_summary(timeline[:2], {"n1": 20, "n2": 10})["all_nodes_fetching"] is None
