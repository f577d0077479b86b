#!/bin/sh
# One-shot setup of a fresh Prefect server (the compose service `prefect-setup`, the same steps as
# scripts/team.sh): work pools `local` and `gpu` (and $CSE_WORKER_POOL), the global concurrency limit `gpu`,
# and `prefect deploy --all` from the image's checkout (/opt/cse: prefect.yaml's pull step records it as the
# working directory, where the workers, same image, find the flows). Idempotent.
set -eu
python /opt/cse/docker/wait_for.py "$PREFECT_API_URL/health"
cd /opt/cse
export PWD=/opt/cse
# a worker starting meanwhile creates its pool itself: "already exists" is success (the second inspect)
for pool in $(printf '%s\n' local gpu "${CSE_WORKER_POOL:-local}" "${CSE_GPU_WORKER_POOL:-gpu}" | sort -u); do
  prefect work-pool inspect "$pool" >/dev/null 2>&1 || prefect work-pool create "$pool" --type process \
    || prefect work-pool inspect "$pool" >/dev/null
done
prefect global-concurrency-limit inspect gpu >/dev/null 2>&1 \
  || prefect global-concurrency-limit create gpu --limit "${CSE_GPU_SLOTS:-1}" \
  || prefect global-concurrency-limit inspect gpu >/dev/null
prefect --no-prompt deploy --all
echo "prefect-setup: pools, concurrency limit gpu and deployments registered at $(printf '%s' "$PREFECT_API_URL" | sed -E 's#(://[^/@:[:space:]]*):[^/@[:space:]]+@#\1:***@#g')"
