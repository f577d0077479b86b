"""The training engine: plain PyTorch plus the project's `config/`, `storage/`, `models/` and `evaluation/`.

Nothing here imports Prefect or MLflow: tracking and orchestration inject their callbacks and context managers
(tasks/train.py, the `fit` task; tasks/distributed_train.py, the torchrun entry point of each rank).

- `cse.training.rows`: `TrainingRows` (batches from the token and corruption datasets, a corruption variant per view
  and epoch) and `epoch_order` (the row order of an epoch, a pure function of seed and epoch);
- `cse.training.loop`: the loop itself (`Phase`, `LoopConfig`, `LoopResult`, `Trainer`, `TrainingInterrupted`,
  `set_seed`): AdamW + linear decay, dev-set selection, resume state in the files `cse.storage.runs.ResumeState` names;
- `cse.training.resume`: the resume state read back (`load_resume_state`) and snapshotted for writing
  (`snapshot_state`; `cse.training.state_writer` writes it);
- `cse.training.job`: one training job from its `TrainConfig` (`run_key`, `resolve_precision`, `build_model`,
  `training_phases`, `load_training_rows`, `transfer_evaluator`, `fit`);
- `cse.training.generator`: fitting a masked-LM generator on a tokens corpus (`fit_masked_lm`, `split_rows`);
- `cse.training.distributed`: a job on several processes under torchrun (`DistributedJob`, `torchrun_command`,
  `launch`, `init_process_group`, `train_rank`, `rank_main`).
"""

from cse import refuse_bare_name

refuse_bare_name(__name__)
