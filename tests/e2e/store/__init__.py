"""Tests of cachefs.store and of the shared test servers in tests/fakes."""
