"""The end-to-end tier: tests that start real FUSE (or bind, tmpfs) mounts, `cachefs` worker,
coordinator or CSI plugin processes (harness/processes.py, tests/worker_process.py,
tests/cluster_process.py), or server processes: moto (the ``moto_s3`` and ``fault_proxy``
fixtures), etcd, a peer owner, prometheus, the benchmarks' stores.

Mirrors the packages (tests/e2e/fs/, tests/e2e/cluster/, ...). A package (this file) so that a
test package split across the tiers has one name in each (unit.cluster, e2e.cluster)."""
