"""Benchmarks, data generators, peer comparisons, the cluster simulator (cachefs never
imports this package)."""
