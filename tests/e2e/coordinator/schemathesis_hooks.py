"""Schemathesis hooks for tests/e2e/coordinator/test_api_fuzz.py (loaded through
``SCHEMATHESIS_HOOKS``; not a test module).

``GET /v1/jobs/{job_id}?wait=S`` is a long-poll: for a suspended job it answers after S seconds
(up to 300), which would stall a time-bounded run on one request. A wait the spec allows is cut
to 1 second; one it forbids (negative, over 300, not a number) is sent as generated, so the
refusals are still tested.

The dataset the test registers before the run (its name in ``CACHEFS_FUZZ_KEPT_DATASET``) is
part of the cluster, as the live nodes are: jobs name it (the spec's examples do), so it must
outlive the run. A ``DELETE /v1/datasets/{name}`` of it is sent for a name no dataset has
(a 404); the datasets the fuzzer registers itself are deleted as generated. Without this, when
the fuzzer deleted it depended on the machine's speed (the time budget decides which cases
run), and after that no job could be served.
"""

from __future__ import annotations

import os
import re
from typing import Any

import schemathesis

LONG_POLL_LIMIT_S = 300  # the spec's maximum for ?wait=
LONG_POLL_IN_TESTS_S = 1.0
_PLAIN_NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
KEPT_DATASET = os.environ.get("CACHEFS_FUZZ_KEPT_DATASET")
NO_SUCH_DATASET = "no-such-dataset-kept-back-by-the-hooks"


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    """Every phase's calls pass here (map hooks see only the fuzzing phase's)."""
    _keep_dataset(case)
    _cut_long_poll(case)


def _keep_dataset(case: Any) -> None:
    if (
        KEPT_DATASET
        and case.method.upper() == "DELETE"
        and case.operation.path == "/v1/datasets/{name}"
        and (case.path_parameters or {}).get("name") == KEPT_DATASET
    ):
        case.path_parameters = {**case.path_parameters, "name": NO_SUCH_DATASET}


def _cut_long_poll(case: Any) -> None:
    query = case.query
    if not query or "wait" not in query:
        return
    wait = query["wait"]
    if isinstance(wait, str) and _PLAIN_NUMBER.fullmatch(wait):
        seconds = float(wait)  # a query value may come as the text it is sent as
    elif isinstance(wait, int | float) and not isinstance(wait, bool):
        seconds = wait
    else:
        return  # not a number: the server must refuse it as generated
    if 0 <= seconds <= LONG_POLL_LIMIT_S:  # False for NaN too
        query["wait"] = min(seconds, LONG_POLL_IN_TESTS_S)
