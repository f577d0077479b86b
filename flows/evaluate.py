"""Flow `evaluate`: score an encoder or a training checkpoint on STS (dev or the seven test tasks) or, with
`mode: transfer`, on SentEval's seven transfer tasks (deployment `evaluate/transfer`)."""

from __future__ import annotations

from prefect import flow

from cse.config.evaluation import EvalConfig
from cse.flows.deployment_params import deployment_merged
from cse.tasks.evaluate import EvalSummary, evaluate_task
from cse.tasks.preflight import preflight_evaluate

# The deployment default: the one pretrained model reachable offline, mean pooling.
DEFAULT_CONFIG = EvalConfig(model="packaged:minilm", pooler="avg")


@flow(name="evaluate", log_prints=True)
def evaluate(config: EvalConfig = DEFAULT_CONFIG) -> EvalSummary:
    """Evaluate a model on the STS tasks and print the result row.

    Args:
        config: the evaluation configuration (in a deployment run, merged into the deployment's).

    Returns:
        The evaluation summary.
    """
    (config,) = deployment_merged(config=config)
    preflight_evaluate(config)  # the model and device, before any work (tasks/preflight.py)
    summary = evaluate_task(config)
    print(summary.table_row)
    print(f"evaluation {summary.evaluation_id}  MLflow run {summary.mlflow_run_id}")
    return summary
