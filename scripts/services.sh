#!/usr/bin/env bash
# Start/stop the embedded single-machine services: Prefect server (SQLite) and one process worker.
# The worker runs up to $CSE_WORKER_LIMIT flow runs at once (default 2: an experiment parent — ablate, seeds,
# sweep — occupies one slot while its children run in the other).
# Usage: scripts/services.sh up|down|status       (sourced settings come from scripts/env.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

redact() { printf '%s' "$1" | sed -E 's#(://[^/@:[:space:]]*):[^/@[:space:]]+@#\1:***@#g'; }  # mask the password of user:password@ URIs
pidfile() { echo "$CSE_HOME/run/$1.pid"; }
running() { [ -f "$(pidfile "$1")" ] && kill -0 "$(cat "$(pidfile "$1")")" 2>/dev/null; }

wait_for_api() {
  for _ in $(seq 1 120); do
    if curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "Prefect server did not answer at $(redact "$PREFECT_API_URL") (log: $CSE_HOME/run/server.log)" >&2
  return 1
}

retry() {  # retry NAME CMD...: a just-started server may still be migrating its database
  local name="$1"; shift
  for i in 1 2 3 4 5; do
    if "$@" >"$CSE_HOME/run/setup.log" 2>&1; then return 0; fi
    sleep $((i * 2))
  done
  echo "could not set up $name:" >&2; cat "$CSE_HOME/run/setup.log" >&2
  return 1
}

up() {
  mkdir -p "$CSE_HOME/run"
  if ! running server; then
    setsid prefect server start --host "$CSE_PREFECT_HOST" --port "$CSE_PREFECT_PORT" \
      >"$CSE_HOME/run/server.log" 2>&1 < /dev/null &
    echo $! >"$(pidfile server)"
  fi
  wait_for_api
  for pool in local gpu; do
    retry "work pool $pool" sh -c "prefect work-pool inspect $pool >/dev/null 2>&1 || prefect work-pool create $pool --type process"
  done
  # one training job per GPU slot at a time (tasks/train.py occupies it while training on CUDA)
  retry "concurrency limit gpu" sh -c "prefect global-concurrency-limit inspect gpu >/dev/null 2>&1 || prefect global-concurrency-limit create gpu --limit ${CSE_GPU_SLOTS:-1}"
  retry "crashed-run automation" python -m ops.automations
  prefect --no-prompt deploy --all >"$CSE_HOME/run/deploy.log" 2>&1 || { cat "$CSE_HOME/run/deploy.log" >&2; exit 1; }
  if ! running worker; then
    setsid prefect worker start --pool local --limit "${CSE_WORKER_LIMIT:-2}" \
      >"$CSE_HOME/run/worker.log" 2>&1 < /dev/null &
    echo $! >"$(pidfile worker)"
  fi
  echo "Prefect UI: http://$CSE_PREFECT_HOST:$CSE_PREFECT_PORT   (worker log: $CSE_HOME/run/worker.log)"
}

down() {
  for svc in worker server; do
    if running "$svc"; then
      kill -TERM -- "-$(cat "$(pidfile "$svc")")" 2>/dev/null || kill -TERM "$(cat "$(pidfile "$svc")")" 2>/dev/null || true
      for _ in $(seq 1 30); do running "$svc" || break; sleep 1; done
    fi
    rm -f "$(pidfile "$svc")"
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) for s in server worker; do running "$s" && echo "$s: running" || echo "$s: stopped"; done ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
