"""Issue 23 items 3, 4 and 7 at the training task: a run whose loss turns non-finite ends FAILED with nothing
registered or exported; a finished job's cache hit is verified (its best checkpoint against the sizes and hashes
recorded at save, its recorded result) and a damaged one is quarantined and retrained, or re-evaluated when only the
record is damaged; a damaged resume state is named, quarantined, and training restarts; fewer rows than a batch are
refused at the job's start. One tiny SimCSE job on a small data root built once for the module."""

from __future__ import annotations

import json
import logging

import mlflow
import pytest

from cse.config.training import resolve_train_config
from cse.storage.layout import DataRoot
from cse.storage.runs import ResumeState, RunDir
from cse.storage.settings import get_settings
from tests.reliability.conftest import STEPS

# the job's stage tasks run here outside a flow (standalone task runs), whose logs Prefect cannot send to its API
pytestmark = pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs:UserWarning")


def _versions(run_id: str) -> list:
    return mlflow.MlflowClient().search_model_versions(f"run_id = '{run_id}'")


def test_a_run_whose_loss_turns_non_finite_fails_and_nothing_is_registered(job):
    """The campaign's NaN model came from `learning_rate = inf` (now refused by the config); a finite but absurd
    learning rate diverges the same way: the task stops at the first non-finite loss, naming the step."""
    from cse.training.loop import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match=r"training stopped at step 2 of 2 \(phase 'main'\): the loss is nan"):
        job(learning_rate=1e30)
    [run] = mlflow.search_runs(
        experiment_names=["simcse"], output_format="list", max_results=1, order_by=["attributes.start_time DESC"]
    )
    assert run.info.status == "FAILED" and _versions(run.info.run_id) == []
    job_dir = RunDir.at(run.data.tags["run_dir"])
    assert job_dir.result() is None and not job_dir.export.exists()


def test_a_finished_jobs_damage_is_found_on_the_cache_hit(job, caplog):
    first = job()
    job_dir = RunDir.at(first.run_dir)
    recorded = json.loads((job_dir.path / "result.json").read_text())["best_files"]
    assert {"weights.safetensors", "cse_model.json"} <= recorded.keys()
    assert job().run_id == first.run_id  # intact: the cached result

    # only the record is damaged: the checkpoint and the training state are intact, so the job is evaluated and
    # recorded again, resuming at its last step (no training step runs again)
    (job_dir.path / "result.json").write_text('{"run_id": ')
    with caplog.at_level(logging.WARNING):
        again = job()
    assert again.resumed_from == STEPS and again.steps == STEPS and again.run_id == first.run_id
    assert "its recorded result is damaged" in caplog.text and "evaluating and recording it again" in caplog.text
    assert list((job_dir.path / "quarantine").glob("result-*/result.json"))

    # the campaign's case: a truncated best checkpoint; the cache hit used to return it (exit 0)
    weights = job_dir.best / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        retrained = job()
    assert f"{weights}: 1000 bytes" in caplog.text and "training it again" in caplog.text
    assert retrained.resumed_from is None and retrained.steps == STEPS and retrained.run_id != first.run_id
    [moved] = (get_settings().home / "quarantine" / "runs" / "simcse").iterdir()
    assert (moved / job_dir.path.name / "best" / "weights.safetensors").stat().st_size == 1000
    assert json.loads((moved / "quarantine.json").read_text())["problems"][0].startswith(str(weights))
    from cse.models.checkpoint import load_checkpoint

    load_checkpoint(retrained.best_checkpoint)  # intact again


def test_a_failed_export_fails_only_the_export_task_and_the_rerun_does_not_train_again(job):
    """The stages are separate Prefect tasks: an export that fails (here the MLflow model logging) leaves a
    completed `fit` task and a failed `export` task, the training state finished (resume state at the last step, no
    `result.json`) and the run tagged with the failed stage; the rerun resumes at the last step (no training step
    runs again) and exports."""
    import cse.flows.train as stages
    from cse.tracking.job_stages import FAILED_STAGE_TAG

    ended: dict[str, str] = {}

    def note(task, task_run, state):
        ended[task.name] = state.type.value

    def refuse(*args, **kwargs):
        raise RuntimeError("the model registry refused the model")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stages, "fit_job", stages.fit_job.with_options(on_completion=[note], on_failure=[note]))
        mp.setattr(stages, "export_model", stages.export_model.with_options(on_completion=[note], on_failure=[note]))
        mp.setattr("cse.tasks.train.log_encoder_model", refuse)
        with pytest.raises(RuntimeError, match="the model registry refused the model"):
            job()
    assert ended == {"fit": "COMPLETED", "export": "FAILED"}
    [run] = mlflow.search_runs(
        experiment_names=["simcse"], output_format="list", max_results=1, order_by=["attributes.start_time DESC"]
    )
    assert run.info.status == "FAILED" and run.data.tags[FAILED_STAGE_TAG] == "export"
    job_dir = RunDir.at(run.data.tags["run_dir"])
    assert job_dir.result() is None and json.loads(job_dir.resume_state.progress.read_text())["step"] == STEPS

    again = job()
    assert again.run_id == run.info.run_id and again.resumed_from == STEPS and again.steps == STEPS  # not trained again
    rerun = mlflow.get_run(again.run_id)
    assert rerun.info.status == "FINISHED" and FAILED_STAGE_TAG not in rerun.data.tags
    assert len(_versions(again.run_id)) == 1 and job_dir.result()["run_id"] == again.run_id


def _tiny_trainer(state_folder, stop_after=None):
    from tests.training.test_resume_state import _trainer

    return _trainer(ResumeState(state_folder), stop_after=stop_after)


@pytest.mark.parametrize("damage", ["truncate trainable", "flip a byte of optimizer.pt", "garbage progress"])
def test_a_damaged_resume_state_is_named_quarantined_and_training_restarts(damage, tmp_path, caplog):
    """The campaign's case (a truncated `trainable.safetensors`: every rerun failed with safetensors' `incomplete
    metadata`, naming no file) and two new ones: a flipped byte (same size: found by the hash recorded at write) and
    an unreadable progress file."""
    from cse.training.loop import TrainingInterrupted

    state = ResumeState(tmp_path / "state")
    with pytest.raises(TrainingInterrupted):
        _tiny_trainer(state.folder, stop_after=2).run()
    target = {
        "truncate trainable": state.trainable,
        "flip a byte of optimizer.pt": state.optimizer,
        "garbage progress": state.progress,
    }[damage]
    data = bytearray(target.read_bytes())
    if damage.startswith("truncate"):
        data = data[:20]
    elif damage.startswith("flip"):
        data[len(data) // 2] ^= 0xFF
    else:
        data = bytearray(b"{ step: ")
    target.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="cse.training.loop"):
        result = _tiny_trainer(state.folder).run()
    assert result.resumed_from is None and result.steps == 4  # restarted from step 0, finished
    assert f"resume state file {target} is damaged" in caplog.text and "restarts from step 0" in caplog.text
    [moved] = (tmp_path / "quarantine").iterdir()
    assert (moved / "state" / target.name).read_bytes() == bytes(data)
    assert json.loads(state.progress.read_text())["step"] == 4  # a fresh, good state


def test_fewer_rows_than_a_batch_are_refused_at_the_jobs_start(data_root, tiny_bert_dir, monkeypatch):
    from cse.training.job import load_training_rows

    folder, refs = data_root
    monkeypatch.setenv("CSE_DATA_ROOT", str(folder))
    cfg = resolve_train_config(
        "smoke", {"backbone": str(tiny_bert_dir), "batch_size": 8, "max_train_sentences": 5}, method="simcse"
    )
    root = DataRoot(folder)
    with pytest.raises(
        ValueError,
        match=rf"tokens dataset {refs['tokens'].key} \({root.dataset_dir('tokens', refs['tokens'].key)}\) "
        r"has 5 training rows, fewer than one batch \(batch_size = 8\)",
    ):
        load_training_rows(cfg, root, refs["tokens"], None, None, pad_id=0)
    rows, _ = load_training_rows(cfg.model_copy(update={"batch_size": 4}), root, refs["tokens"], None, None, pad_id=0)
    assert len(rows) == 5
