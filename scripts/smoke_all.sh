#!/usr/bin/env bash
# Every method's smoke deployment, then the D2CSE ablation matrix and three seeds with smoke settings, then the
# comparison with the published numbers — all through the worker on the embedded services (CPU: about an hour).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
bash scripts/services.sh up
source scripts/run_deployment.sh

for method in d2cse simcse dcpcse diffcse diffaug; do
  run "train-$method/smoke"
done
run ablate-d2cse/smoke
run seeds/smoke
run compare/default -p 'tags={"preset": "smoke"}'
python -m cse.ops.cli report
