"""The MLflow run of a training job across its later stages (test evaluation, transfer evaluation, export).

The fit stage opens the job's run and ends it when training ends (cse.tracking.training_runs `training_run`). Each later stage is
its own Prefect task; `job_stage` makes the job's run the active run again for that stage (the evaluation recorders
and the model logging write to the active run), so the stage's results land on the same run. A stage that raises
ends the run FAILED and tags it `cse.failed_stage` = the stage, so MLflow says which stage failed (the training
itself finished); the tag is removed when that stage later succeeds (the job's rerun).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlflow

from cse.tracking.spool import is_unreachable
from cse.tracking.store import configure_mlflow

FAILED_STAGE_TAG = "cse.failed_stage"


def retry_on_outage(_task: Any, _task_run: Any, state: Any) -> bool:
    """Prefect's `retry_condition_fn` of the later stages: retry only when the exception says the tracking server
    could not be reached (an outage passes; a bug or bad data would fail the same way again)."""
    return isinstance(state.data, BaseException) and is_unreachable(state.data)


@contextmanager
def job_stage(run_id: str, stage: str) -> Iterator[str]:
    """Run the block with the training job's MLflow run `run_id` (the fit stage's) active again; yields `run_id`.

    The run ends FINISHED after the block, KILLED on an interrupt or a termination signal (any exception that is not an
    `Exception`: `KeyboardInterrupt`, Prefect's `TerminationSignal` for SIGTERM), FAILED on any other exception (which
    propagates); `stage` is written to the tag `cse.failed_stage` when the block raises.
    """
    configure_mlflow()
    client = mlflow.MlflowClient()
    try:
        with mlflow.start_run(run_id=run_id):
            try:
                yield run_id
            except BaseException as e:  # an interrupt ends the run KILLED; everything propagates
                if not isinstance(e, Exception):  # an interrupt or a termination signal (Prefect's SIGTERM)
                    mlflow.end_run(status="KILLED")
                raise
    except BaseException:  # any exit by exception marks the failed stage, then propagates
        client.set_tag(run_id, FAILED_STAGE_TAG, stage)
        raise
    if client.get_run(run_id).data.tags.get(FAILED_STAGE_TAG) == stage:  # an earlier attempt of this stage failed
        client.delete_tag(run_id, FAILED_STAGE_TAG)
