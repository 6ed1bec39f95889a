"""The worker's garbage-collector tuning (cachefs/worker.py ``tune_gc``); a running worker's
is checked in tests/e2e/test_worker.py."""

from __future__ import annotations

import gc

from cachefs.status import frozen_objects
from cachefs.worker import tune_gc


def test_tune_gc_freezes_what_is_alive_and_later_cycles_are_still_collected():
    before = gc.get_threshold()
    try:
        gc.unfreeze()
        alive = [object(), {"kept": []}]  # tracked containers, alive when the worker serves
        tune_gc()
        assert gc.get_freeze_count() >= 1
        assert frozen_objects() == gc.get_freeze_count()  # what `cachefs status` shows
        assert gc.get_threshold() == before  # young collections as before
        assert not any(obj is alive[1] for obj in gc.get_objects())  # out of every generation
        cycle: list = []
        cycle.append(cycle)  # a cycle made later is still collected
        del cycle
        assert gc.collect() >= 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
