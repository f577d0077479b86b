#!/usr/bin/env bash
# The main job on the embedded single-machine defaults: Prefect server (SQLite) + a local process
# worker + MLflow on SQLite and a local artifact folder. Runs the pipeline's deployments through the
# worker, then prints the results and where to browse them. Services stay up for browsing;
# `scripts/services.sh down` stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

bash scripts/services.sh up

source scripts/run_deployment.sh

run ingest/default
run train-d2cse/smoke-demo
# what the numbers above are (config/presets.py smoke_line): a pipeline check on a sample, not the paper's training
python -c 'from cse.config.methods import DEFAULT_METHOD; from cse.config.presets import smoke_line; print(smoke_line(DEFAULT_METHOD, "smoke-demo"))'

python -m cse.ops.cli report
# the smoke job's experiment in MLflow's model-training view, with the STS columns (tracking/run_pages.py)
# (the MLflow UI's address is the settings': http://127.0.0.1:$CSE_MLFLOW_PORT, or CSE_MLFLOW_UI_URL)
MLFLOW_PAGE=$(python -c 'import sys
from cse.config.methods import DEFAULT_METHOD
from cse.storage.settings import get_settings
from cse.tracking.run_pages import experiment_url
from cse.tracking.store import experiment_ids
ids, ui = experiment_ids([DEFAULT_METHOD]), get_settings().mlflow_ui_url
print(experiment_url(ui, ids[0]) if ids else ui)' 2>/dev/null || echo "http://127.0.0.1:$CSE_MLFLOW_PORT")
cat <<MSG

Browse:
  Prefect UI  http://$CSE_PREFECT_HOST:$CSE_PREFECT_PORT
  MLflow UI   mlflow ui --backend-store-uri "$MLFLOW_TRACKING_URI" --host 127.0.0.1 --port $CSE_MLFLOW_PORT
              then open $MLFLOW_PAGE
  SQL         cse sql "SELECT label, sts_avg FROM evaluations_all"   (views: wiki1m, nli, sts, tokens, evaluations, ...)
From any shell with the venv activated (source .venv/bin/activate; docs/quickstart.md):
  cse run train-d2cse/smoke -p 'overrides={"learning_rate": 0.05}'    cse deployments    cse report
Ports: Prefect $CSE_PREFECT_PORT (CSE_PREFECT_PORT), MLflow UI $CSE_MLFLOW_PORT (CSE_MLFLOW_PORT); remembered in
  $CSE_HOME/services.env for new shells. Set either before \`make main\` to use another port.
Stop the services with: bash scripts/services.sh down
MSG
