#!/bin/sh
# One-shot setup of a fresh Prefect server (the compose service `prefect-setup`, the same steps as
# scripts/team.sh): work pools `local` and `gpu` (and $CSE_WORKER_POOL), the global concurrency limit `gpu`, the
# crashed-run automation,
# and `prefect deploy --all` from the image's checkout (/opt/cse: prefect.yaml's pull step records it as the
# working directory, where the workers, same image, find the flows). Idempotent.
set -eu
python /opt/cse/docker/wait_for.py "$PREFECT_API_URL/health"
cd /opt/cse
export PWD=/opt/cse
# the work pools, the `gpu` limit and the crashed-run automation (ops/prefect_setup.py; a pool a starting worker
# created meanwhile is kept)
python -m cse.ops.prefect_setup --pool local --pool gpu --pool "${CSE_WORKER_POOL:-local}" \
  --pool "${CSE_GPU_WORKER_POOL:-gpu}" --limit "gpu=${CSE_GPU_SLOTS:-1}" --automation
prefect --no-prompt deploy --all
echo "prefect-setup: pools, concurrency limit gpu and deployments registered at $(printf '%s' "$PREFECT_API_URL" | sed -E 's#(://[^/@:[:space:]]*):[^/@[:space:]]+@#\1:***@#g')"
