"""The processes that tests and benchmarks start: cachefs workers and coordinators, started with
the command line a user runs, and any other child process, each with its output in a log file
(harness/processes.py).

Not installed (pyproject.toml installs cachefs, coordinator and tf_dataset only): tests and
benchmarks import it from the checkout, whose root is on sys.path (pytest's ``pythonpath``;
``python -m bench.<name>`` run from the root). The mechanism is here once; each caller keeps its
own defaults: tests/worker_process.py and tests/cluster_process.py (the tests'), bench/read_bench.py
and bench/cluster_bench.py (the benchmarks')."""
