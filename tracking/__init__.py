"""The tracking seam: the only package that talks to MLflow and publishes results. Every other module calls these.

- `cse.tracking.store`: the tracking store (setup, errors said clearly, experiments, reading runs and artifacts back);
- `cse.tracking.stage_runs`: every stage run is an MLflow run (`stage_run`) and what a stage records on it;
- `cse.tracking.orphans`: stage runs left RUNNING by a killed process, closed as KILLED;
- `cse.tracking.provenance`: the git commit and the Prefect flow run of a run;
- `cse.tracking.lineage`: the datasets a run read, as MLflow dataset inputs (`cse.tracking.datasets` builds them);
- `cse.tracking.training_runs`: a training job's run (started or resumed), rank 0's callbacks;
- `cse.tracking.spool`: per-step metrics that survive an unreachable tracking server (the outage spool);
- `cse.tracking.group_runs`: the parent run of a group of children, a comparison's run;
- `cse.tracking.model_export`, `cse.tracking.model_card`: logged and registered models and their cards;
- `cse.tracking.reporting`: result tables as markdown/CSV and Prefect artifacts.
- `cse.tracking.run_pages`: what the MLflow pages show (model-training view, run names, STS descriptions).
"""

from cse import refuse_bare_name
from cse.tracking.redaction import install_redaction

refuse_bare_name(__name__)

install_redaction()  # every process that tracks anything masks credentials in its logs and MLflow's errors
