"""coordinator.pods: the pod settings the extender and the CacheScaler both read."""

from __future__ import annotations

from coordinator.pods import DATASET_KEY, JOB_KEY, job_id, setting


def test_an_annotation_wins_over_a_label_and_blanks_count_as_unset():
    meta = {"annotations": {DATASET_KEY: " coco "}, "labels": {DATASET_KEY: "imagenet"}}
    assert setting(meta, DATASET_KEY) == "coco"
    meta = {"annotations": {DATASET_KEY: "  "}, "labels": {DATASET_KEY: "imagenet"}}
    assert setting(meta, DATASET_KEY) == "imagenet"
    assert setting({"labels": {DATASET_KEY: 3}}, DATASET_KEY) is None  # not a string


def test_job_id_is_named_or_derived_from_the_owner():
    assert job_id({"labels": {JOB_KEY: "j1"}}, "ml", "p") == "j1"
    job_labels = {"labels": {"job-name": "old", "batch.kubernetes.io/job-name": "train"}}
    assert job_id(job_labels, "ml", "p") == "ml.train"
    owned = {"ownerReferences": [{"name": "rs", "controller": False}, {"name": "sts",
             "controller": True}]}  # fmt: skip
    assert job_id(owned, "", "p") == "default.sts"
    assert job_id({}, "ml", "pod-7") == "ml.pod-7"
    assert job_id({}, "ml", "") is None
