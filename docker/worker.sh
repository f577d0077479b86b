#!/bin/sh
# The compose stack's worker (CPU or GPU): waits for the Prefect and MLflow servers, then runs a Prefect process
# worker. Its name, also in the environment as CSE_WORKER_NAME (tasks/train.py records it as the MLflow tag
# `worker`), is $CSE_WORKER_NAME, else "$CSE_WORKER_PREFIX-<container hostname>" (distinct per replica).
set -eu
python /opt/cse/docker/wait_for.py "$PREFECT_API_URL/health" "$MLFLOW_TRACKING_URI/health"
export CSE_WORKER_NAME="${CSE_WORKER_NAME:-${CSE_WORKER_PREFIX:-cse}-$(hostname)}"
exec prefect worker start --pool "${CSE_WORKER_POOL:-local}" --name "$CSE_WORKER_NAME" \
  --limit "${CSE_WORKER_LIMIT:-2}" --type process
