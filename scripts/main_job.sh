#!/usr/bin/env bash
# The main job on the embedded single-machine defaults: Prefect server (SQLite) + a local process
# worker + MLflow on SQLite and a local artifact folder. Runs the pipeline's deployments through the
# worker, then prints the results and where to browse them. Services stay up for browsing;
# `scripts/services.sh down` stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

bash scripts/services.sh up

run() {  # run a deployment through the worker and fail if it does not complete
  echo "==> prefect deployment run $*"
  prefect deployment run "$@" --watch --watch-timeout "${CSE_WATCH_TIMEOUT:-3600}" >"$CSE_HOME/run/last_run.log" 2>&1 || {
    tail -n 40 "$CSE_HOME/run/last_run.log" >&2
    echo "deployment run $1 failed; worker log: $CSE_HOME/run/worker.log" >&2
    exit 1
  }
  tail -n 1 "$CSE_HOME/run/last_run.log"
}

run ingest/default
run train-d2cse/smoke

python -m flows.cli report
cat <<MSG

Browse:
  Prefect UI  http://$CSE_PREFECT_HOST:$CSE_PREFECT_PORT
  MLflow UI   mlflow ui --backend-store-uri "$MLFLOW_TRACKING_URI" --host 127.0.0.1 --port 5000
  DuckDB      duckdb "$CSE_HOME/data/catalog.duckdb"   (views: wiki1m, nli, sts, tokens, corruption, manifests, ...)
Stop the services with: bash scripts/services.sh down
MSG
