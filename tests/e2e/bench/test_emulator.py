"""bench/emulator.py without a mount: the sample plan, the data-path parser, the streams, the
utilisation math, the N search on fake measurements, and the accelerators against a real
temporary directory at a tiny scale (threads and processes). No timing assertions."""

from __future__ import annotations

import json
import os
import threading

import pytest
import xxhash

from bench.datagen import file_bytes, plan_dataset, write_local
from bench.delay_proxy import DelayProxy
from bench.emulator import (
    AcceleratorResult,
    DataPath,
    Samples,
    Workload,
    accelerator_streams,
    build_parser,
    check_present,
    filesystem_of,
    generate,
    largest_passing,
    main,
    parse_data_path,
    plan_samples,
    render_markdown,
    run_accelerator,
    run_benchmark,
    run_trial,
    summarise_trial,
    utilisation,
    warm_up,
)
from bench.read_bench import BenchmarkFailure

# --- the samples -----------------------------------------------------------------------------


def test_sample_plan_is_deterministic_equal_sized_and_uses_datagen_paths():
    plan = plan_samples(50, sample_size=5000, classes=5, seed=3)
    assert plan == plan_samples(50, sample_size=5000, classes=5, seed=3)
    assert plan != plan_samples(50, sample_size=5000, classes=5, seed=4)
    assert {spec.size for spec in plan.files} == {5000}
    assert [s.path for s in plan.files] == [
        s.path for s in plan_dataset(50, classes=5, seed=3).files
    ]
    assert len({os.path.dirname(s.path) for s in plan.files}) == 5
    assert plan.total_bytes == 50 * 5000
    assert plan_samples(3).files[0].size == 114_660  # MLPerf Storage's ResNet-50 sample
    assert plan_samples(10, sample_size=5000).files[:4] == plan_samples(4, sample_size=5000).files
    with pytest.raises(ValueError):
        plan_samples(10, sample_size=10)


def test_generated_samples_hold_the_generator_bytes(tmp_path):
    plan = plan_samples(12, sample_size=2000, classes=3, seed=1)
    assert main(["generate", f"dir:{tmp_path}", "--samples", "12", "--sample-size", "2000",
                 "--classes", "3", "--seed", "1"]) == 0  # fmt: skip
    samples = Samples.of(plan)
    for index, spec in enumerate(plan.files):
        data = (tmp_path / spec.path).read_bytes()
        assert data == file_bytes(spec, 1)
        samples.check(index, data)  # no exception
    with pytest.raises(BenchmarkFailure, match="content differs"):
        samples.check(0, b"x" + data[1:])
    with pytest.raises(BenchmarkFailure, match="expected 2000"):
        samples.check(0, data[:-1])


# --- data paths ------------------------------------------------------------------------------


def test_parse_data_path():
    assert parse_data_path("dir:/dev/shm/x") == DataPath("dir", "/dev/shm/x")
    assert parse_data_path("dir:rel").location == os.path.abspath("rel")
    assert parse_data_path("s3:http://127.0.0.1:5000/bucket/a/b/") == DataPath(
        "s3", "http://127.0.0.1:5000", "bucket", "a/b/"
    )
    assert parse_data_path("s3:https://s3.example.com/bucket") == DataPath(
        "s3", "https://s3.example.com", "bucket", ""
    )
    assert str(parse_data_path("s3:http://h:1/b/p")) == "s3:http://h:1/b/p/"
    for bad in ("", "dir:", "/tmp/x", "s3:bucket/prefix", "s3:http://h:1/", "nfs:/x"):
        with pytest.raises(ValueError):
            parse_data_path(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data", "s3:bucket"])


def test_filesystem_of_takes_the_longest_mount_point():
    mounts = (
        "/dev/root / ext4 rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "cachefs /mnt/cachefs fuse.cachefs rw 0 0\n"
        "x /mnt/cachefs2 fuse.s3fs rw 0 0\n"
    )
    assert filesystem_of("/dev/shm/samples", mounts) == "tmpfs"
    assert filesystem_of("/mnt/cachefs/imagenet", mounts) == "fuse.cachefs"
    assert filesystem_of("/mnt/cachefs2/x", mounts) == "fuse.s3fs"
    assert filesystem_of("/mnt/other", mounts) == "ext4"
    assert filesystem_of("/") != ""  # the real /proc/self/mounts


# --- workload, streams, utilisation ----------------------------------------------------------


def test_scale_shrinks_batch_and_compute_in_proportion():
    full = Workload.scaled(400, 0.224, 1.0, batches=10, readers=4, prefetch=1)
    assert (full.batch, full.compute_s) == (400, 0.224)
    small = Workload.scaled(400, 0.224, 0.1, batches=10, readers=4, prefetch=1)
    assert small.batch == 40 and small.compute_s == pytest.approx(0.0224)
    assert small.demand_samples_per_s == pytest.approx(full.demand_samples_per_s)
    tiny = Workload.scaled(400, 0.224, 0.0001, batches=1, readers=1, prefetch=0)
    assert tiny.batch == 1 and tiny.demand_samples_per_s == pytest.approx(400 / 0.224)
    assert full.samples_per_accelerator == 4000
    with pytest.raises(ValueError):
        Workload.scaled(400, 0.224, 0, batches=1, readers=1, prefetch=0)
    with pytest.raises(ValueError):
        Workload(4, 0.001, batches=1, readers=0, prefetch=1)


def test_streams_split_each_shuffled_epoch_between_accelerators():
    streams = accelerator_streams(100, 4, 25, seed=1)
    assert [len(s) for s in streams] == [25] * 4
    assert sorted(i for s in streams for i in s) == list(range(100))  # one epoch, disjoint
    assert streams[0] != sorted(streams[0])  # shuffled
    assert streams == accelerator_streams(100, 4, 25, seed=1)
    assert streams != accelerator_streams(100, 4, 25, seed=2)
    more = accelerator_streams(10, 3, 8, seed=1)  # 24 samples: 2.4 epochs
    every = [i for s in more for i in s]
    assert len(every) == 24 and set(every) == set(range(10))


def test_utilisation_math():
    assert utilisation(2.0, 4.0) == 0.5
    assert utilisation(0.0, 1.0) == 0.0
    assert utilisation(1.0, 0.0) == 0.0
    assert utilisation(1.0, 0.999) == 1.0  # clipped
    r = AcceleratorResult(0, batches=4, compute_s=4.0, first_wait_s=1.0, started=10, finished=16)
    assert r.wall_s == 6.0
    assert r.utilisation == pytest.approx(4 / 6)
    # After the first batch: 3 s of compute in 6 - 1 (first wait) - 1 (first compute) s.
    assert r.steady_utilisation(1.0) == pytest.approx(3 / 4)
    assert AcceleratorResult(0, batches=1, compute_s=1, finished=2).steady_utilisation(1) is None


def test_summarise_trial():
    workload = Workload(batch=10, compute_s=0.5, batches=2, readers=1, prefetch=1)
    results = [
        AcceleratorResult(0, 20, 2000, 2, 1.0, 0.5, 0.5, started=0.0, finished=2.0),
        AcceleratorResult(1, 20, 2000, 2, 1.0, 0.0, 0.0, started=0.5, finished=1.5),
    ]
    trial = summarise_trial(2, results, workload, dataset=80)
    assert trial["utilisation"] == [0.5, 1.0]
    assert trial["mean_utilisation"] == 0.75 and trial["min_utilisation"] == 0.5
    assert trial["seconds"] == 2.0
    assert trial["samples_per_s"] == 20.0 and trial["mb_per_s"] == 4000 / 2 / 1e6
    assert trial["demand_samples_per_s"] == 40.0
    assert trial["epochs"] == 0.5
    assert trial["mean_steady_utilisation"] == pytest.approx((0.5 / 1.0 + 1.0) / 2)


# --- the search ------------------------------------------------------------------------------


@pytest.mark.parametrize("max_n", [1, 2, 5, 16, 64, 100])
@pytest.mark.parametrize("capacity", [0, 1, 2, 3, 7, 8, 9, 31, 64, 1000])
def test_search_finds_the_largest_passing_n_in_few_trials(capacity, max_n):
    tried = []

    def passes(n: int) -> bool:
        assert 1 <= n <= max_n
        tried.append(n)
        return n <= capacity

    assert largest_passing(passes, max_n) == min(capacity, max_n)
    assert len(tried) == len(set(tried))  # never the same N twice
    assert len(tried) <= 2 * max_n.bit_length() + 1


def test_search_rejects_an_empty_range():
    with pytest.raises(ValueError):
        largest_passing(lambda n: True, 0)


# --- accelerators on a real directory --------------------------------------------------------

TINY = Workload(batch=4, compute_s=0.001, batches=5, readers=2, prefetch=1)


@pytest.fixture
def sample_dir(tmp_path):
    plan = plan_samples(30, sample_size=1500, classes=3, seed=2)
    write_local(str(tmp_path), plan)
    return tmp_path, plan


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_accelerators_read_every_sample_and_report_utilisation(sample_dir, mode):
    root, plan = sample_dir
    samples = Samples.of(plan)
    results = run_trial(DataPath("dir", str(root)), samples, 2, TINY, order_seed=1, mode=mode)
    assert [r.index for r in results] == [0, 1]
    for r in results:
        assert r.error == ""
        assert r.batches == 5 and r.samples == 20 and r.bytes == 20 * 1500
        assert r.compute_s == pytest.approx(0.005)
        assert 0.0 <= r.utilisation <= 1.0
        assert r.finished >= r.started
    trial = summarise_trial(2, results, TINY, len(samples.keys))
    assert trial["samples"] == 40 and 0.0 <= trial["mean_utilisation"] <= 1.0
    assert trial["epochs"] == pytest.approx(40 / 30)


def test_prefetch_zero_and_many_readers_still_read_in_batch_order(sample_dir):
    root, plan = sample_dir
    seen: list[int] = []
    lock = threading.Lock()
    data_path = DataPath("dir", str(root))
    original = data_path.opener

    class Recording(DataPath):
        def opener(self, threads):
            read = original(threads)
            index = {spec.path: spec.index for spec in plan.files}

            def record(key):
                with lock:
                    seen.append(index[key])
                return read(key)

            return record

    workload = Workload(batch=3, compute_s=0.0, batches=6, readers=5, prefetch=0)
    stream = accelerator_streams(30, 1, 18, seed=4)[0]
    result = run_accelerator(
        0,
        Recording("dir", str(root)),
        Samples.of(plan),
        stream,
        workload,
        threading.Barrier(1),
        threading.Event(),
    )
    assert result.error == "" and result.samples == 18 and result.batches == 6
    assert sorted(seen) == sorted(stream)
    # With no prefetch a reader never starts batch b+1 before batch b is complete.
    positions = {sample: p for p, sample in enumerate(stream)}
    batches = [positions[s] // 3 for s in seen]
    assert batches == sorted(batches)


def test_a_wrong_byte_aborts_the_trial(sample_dir):
    root, plan = sample_dir
    victim = root / plan.files[7].path
    data = bytearray(victim.read_bytes())
    data[100] ^= 1
    victim.write_bytes(bytes(data))
    workload = Workload(batch=5, compute_s=0.0, batches=6, readers=2, prefetch=1)  # all 30
    for mode in ("thread", "process"):
        with pytest.raises(BenchmarkFailure, match="content differs"):
            run_trial(
                DataPath("dir", str(root)), Samples.of(plan), 1, workload, order_seed=1, mode=mode
            )


def test_a_missing_sample_fails_the_trial(sample_dir):
    root, plan = sample_dir
    (root / plan.files[3].path).unlink()
    workload = Workload(batch=5, compute_s=0.0, batches=6, readers=2, prefetch=1)
    with pytest.raises(BenchmarkFailure, match="FileNotFoundError"):
        run_trial(
            DataPath("dir", str(root)), Samples.of(plan), 2, workload, order_seed=1, mode="thread"
        )


def test_warm_up_reads_and_checks_every_sample(sample_dir):
    root, plan = sample_dir
    samples = Samples.of(plan)
    warm_up(DataPath("dir", str(root)), samples, threads=3)  # all intact: no error
    last = root / plan.files[-1].path
    data = bytearray(last.read_bytes())
    data[-1] ^= 1
    last.write_bytes(bytes(data))
    with pytest.raises(BenchmarkFailure, match="content differs"):
        warm_up(DataPath("dir", str(root)), samples, threads=3)


def test_warm_up_and_drop_caches_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data", "dir:/x", "--warm-up", "--drop-caches"])
    assert "not allowed with" in capsys.readouterr().err


# --- the whole command, tiny -----------------------------------------------------------------


def test_the_command_searches_and_writes_json_and_markdown(tmp_path, capsys):
    data = tmp_path / "samples"
    save = tmp_path / "results"
    argv = [
        "--data", f"dir:{data}", "--generate", "--samples", "40", "--sample-size", "1024",
        "--classes", "4", "--batch", "4", "--compute", "1ms", "--batches", "3",
        "--readers", "2", "--max-accelerators", "3", "--target", "0", "--mode", "thread",
        "--quiet-wait", "0", "--save-dir", str(save),
    ]  # fmt: skip
    assert main(argv) == 0
    results = json.loads(capsys.readouterr().out)
    # Target 0 always passes: N = 1, 2, then 3 (the bound), and the bound is the answer.
    assert [t["accelerators"] for t in results["trials"]] == [1, 2, 3]
    assert [t["run"] for t in results["trials"]] == [1, 2, 3]
    assert results["search"]["largest_accelerators"] == 3
    assert results["search"]["bound_reached"] is True
    assert results["workload"]["batch"] == 4 and results["workload"]["compute_s"] == 0.001
    for t in results["trials"]:
        assert t["samples"] == t["accelerators"] * 12
        assert len(t["utilisation"]) == t["accelerators"]
        assert all(0.0 <= u <= 1.0 for u in t["utilisation"])
    assert results["command"].endswith("-m bench.emulator " + " ".join(argv))
    files = sorted(os.listdir(save))
    assert files == [f"{results['date']}.json", f"{results['date']}.md"]
    markdown = (save / files[1]).read_text()
    assert "| 3 |" in markdown and "Largest N with mean utilisation >= 0%: 3" in markdown


def test_the_command_refuses_missing_samples(tmp_path, capsys):
    code = main(["--data", f"dir:{tmp_path}", "--samples", "5", "--mode", "thread"])
    assert code == 1
    assert "bench.emulator generate" in capsys.readouterr().err


def test_listed_accelerators_are_measured_without_search(sample_dir):
    root, _ = sample_dir
    args = build_parser().parse_args(
        ["--data", f"dir:{root}", "--samples", "30", "--sample-size", "1500", "--classes", "3",
         "--seed", "2", "--batch", "2", "--compute", "0", "--batches", "2",
         "--accelerators", "2,1", "--target", "1.01", "--mode", "thread", "--quiet-wait", "0",
         "--warm-up"]
    )  # fmt: skip
    args.argv = []
    results = run_benchmark(args)
    assert results["workload"]["warm_up"] is True
    assert "every sample read once right before each trial" in render_markdown(results)
    assert [t["accelerators"] for t in results["trials"]] == [1, 2]
    assert results["search"]["largest_accelerators"] == 0  # nothing reaches 101 %
    assert "Largest N with mean utilisation >= 101%: 0" in render_markdown(results)


def test_markdown_lists_every_trial():
    trial = {
        "accelerators": 2,
        "mean_utilisation": 0.95,
        "min_utilisation": 0.93,
        "utilisation": [0.93, 0.97],
        "mean_steady_utilisation": None,
        "samples": 100,
        "bytes": 100 * 114_660,
        "seconds": 1.0,
        "samples_per_s": 100.0,
        "mb_per_s": 11.466,
        "demand_samples_per_s": 3571.0,
        "epochs": 1.0,
        "cpu_busy_during": 0.5,
        "run": 1,
    }
    results = {
        "date": "2026-01-02",
        "command": "python -m bench.emulator --data dir:/x",
        "machine": {"nproc": 2, "cpu": "x", "memory_bytes": 8 << 30, "kernel": "6", "python": "3"},
        "load_before": [0.1, 0.2, 0.3],
        "data_path": "dir:/x",
        "filesystem": "tmpfs",
        "dataset": {"samples": 100, "sample_size": 114_660, "classes": 10, "bytes": 1, "seed": 0},
        "workload": {
            "batch": 40,
            "compute_s": 0.0224,
            "batches": 10,
            "readers": 4,
            "prefetch": 1,
            "scale": 0.1,
            "unscaled_batch": 400,
            "unscaled_compute_s": 0.224,
            "demand_samples_per_s_per_accelerator": 1785.7,
            "mode": "process",
            "drop_caches": False,
        },
        "verification": "every sample",
        "trials": [trial],
        "search": {
            "target_utilisation": 0.9,
            "method": "m",
            "max_accelerators": 64,
            "largest_accelerators": 2,
            "bound_reached": False,
        },
        "notes": ["a note"],
    }
    text = render_markdown(results)
    assert "| 2 | 95.0% | 93.0% | — | 100 | 11.5 | 3,571 | 1.00 | 1.00 | 50% | 1 |" in text
    assert "- N=2: 0.930, 0.970" in text
    assert "(tmpfs)" in text and "- a note" in text
    assert xxhash.xxh3_64_intdigest(text.encode())  # plain text, no exception


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_an_accelerator_that_cannot_start_does_not_hang_the_others(sample_dir, mode):
    root, plan = sample_dir

    class Broken(DataPath):
        def opener(self, threads):
            raise OSError("no client")

    with pytest.raises(BenchmarkFailure, match="no client"):
        run_trial(Broken("dir", str(root)), Samples.of(plan), 3, TINY, order_seed=1, mode=mode)


def test_one_accelerator_failing_to_start_releases_the_others(sample_dir):
    root, plan = sample_dir
    calls = []

    class FailsOnce(DataPath):
        def opener(self, threads):
            calls.append(threads)
            if len(calls) == 2:
                raise OSError("no client")
            return super().opener(threads)

    with pytest.raises(BenchmarkFailure, match="no client"):
        run_trial(
            FailsOnce("dir", str(root)), Samples.of(plan), 3, TINY, order_seed=1, mode="thread"
        )


def test_s3_data_path_reads_through_the_delay_proxy(moto_s3):
    plan = plan_samples(20, sample_size=1500, classes=2, seed=5)
    print(generate(parse_data_path(f"s3:{moto_s3.endpoint}/cachefs-emulator-test/s"), plan, 4))
    samples = Samples.of(plan)
    with DelayProxy(moto_s3.endpoint, 0.001, bandwidth=10_000_000) as proxy:
        data_path = parse_data_path(f"s3:{proxy.url}/cachefs-emulator-test/s")
        check_present(data_path, samples)
        results = run_trial(data_path, samples, 2, TINY, order_seed=1, mode="thread")
        gets = proxy.stats()["object_gets"]
    assert [(r.samples, r.bytes, r.error) for r in results] == [(20, 30_000, "")] * 2
    assert gets == 40  # every sample read is one GET through the proxy (2 epochs of 20)
