"""The training stages as Prefect tasks (tasks/train.py): their names in the UI and their retry rule."""

from __future__ import annotations

from types import SimpleNamespace

import requests

from cse.tasks.train import RETRIES, evaluate_test, evaluate_transfer, export_model, fit_job, retry_on_outage


def test_each_stage_is_its_own_task_and_only_the_later_stages_retry():
    assert [t.name for t in (fit_job, evaluate_test, evaluate_transfer, export_model)] == [
        "fit",
        "evaluate-test",
        "evaluate-transfer",
        "export",
    ]
    assert fit_job.retries == 0  # a rerun resumes at the last saved step; a deterministic failure would repeat
    for stage in (evaluate_test, evaluate_transfer, export_model):
        assert stage.retries == RETRIES > 0 and stage.retry_condition_fn is retry_on_outage


def test_the_later_stages_retry_a_tracking_outage_only():
    def state(exc):
        return SimpleNamespace(data=exc)

    assert retry_on_outage(None, None, state(requests.exceptions.ConnectionError("connection refused")))
    assert not retry_on_outage(None, None, state(RuntimeError("the model registry refused the model")))
    assert not retry_on_outage(None, None, state(ValueError("bad checkpoint")))
    assert not retry_on_outage(None, None, state(None))
