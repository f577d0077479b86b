#!/usr/bin/env bash
# Start/stop the embedded single-machine services: Prefect server (SQLite) and one process worker.
# The worker runs up to $CSE_WORKER_LIMIT flow runs at once (default 2: an experiment parent — ablate, seeds,
# sweep — occupies one slot while its children run in the other).
# Usage: scripts/services.sh up|down|status|worker     (sourced settings come from scripts/env.sh)
#   up      server, work pools, deployments, worker, and the Prefect profile `cse` of plain shells
#   worker  (re)start the worker only; like `up`, never a second worker for the same pool and API
#   down    stop both: the worker by SIGINT to its process group (a Prefect worker shuts down cleanly on it, in
#           seconds), the server by SIGTERM to its group, SIGTERM to their descendants outside the group (the flow
#           runs); SIGKILL after $CSE_STOP_TIMEOUT seconds (default 10); the pid file goes only once no process is left
# `up` remembers the ports in $CSE_HOME/services.env (CSE_PREFECT_PORT, CSE_MLFLOW_PORT): scripts/env.sh reads them
# back in a new shell, where those variables are unset.
# Logs ($CSE_HOME/run/server.log, worker.log) are appended to, each start after a marker line.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

WORKER_POOL="${CSE_WORKER_POOL:-local}"
STOP_TIMEOUT="${CSE_STOP_TIMEOUT:-10}"

# mask URI user-info as cse.storage.secrets.redact does: the password (to the last @ before the host) or a token
redact() { printf '%s' "$1" | sed -E -e 's|(://[^/?#:[:space:]]*):[^/?#[:space:]]*@|\1:***@|g' -e 's|://[^/?#:[:space:]]+@|://***@|g'; }
pidfile() { echo "$CSE_HOME/run/$1.pid"; }
signature() { case "$1" in server) echo "server start" ;; worker) echo "worker start" ;; esac; }
# the signal that stops a service cleanly: Prefect's worker shuts down on SIGINT (on SIGTERM it sent itself SIGINT
# only after its flow runs), the server's uvicorn on SIGTERM (a script's background job ignores SIGINT)
stop_signal() { case "$1" in worker) echo INT ;; *) echo TERM ;; esac; }
# the worker: `prefect worker start` through cse.ops.worker, which handles SIGHUP as SIGTERM (a clean shutdown)
WORKER_START=(python -m cse.ops.worker start)

alive() {  # alive PID...: those still running (a zombie is gone: it only waits to be reaped)
  [ $# -gt 0 ] || return 0
  ps -e -o pid=,stat= | awk -v want=" $* " 'index(want, " " $1 " ") && $2 !~ /^Z/ { print $1 }'
}

is_service() {  # is_service SVC PID: PID runs, and it is that service's command (not a reused pid)
  [ -n "$(alive "$2")" ] && ps -o args= -p "$2" 2>/dev/null | grep -- "$(signature "$1")" >/dev/null
}

running() { [ -f "$(pidfile "$1")" ] && is_service "$1" "$(cat "$(pidfile "$1")")"; }

tree_of() {  # tree_of PID: PID, the members of its process group and all their descendants, as they are now
  ps -e -o pid=,ppid=,pgid= | awk -v root="$1" '
    { kids[$2] = kids[$2] " " $1; if ($3 == root) seed = seed " " $1 }
    END {
      n = split(root seed, queue, " "); out = ""
      for (i = 1; i <= n; i++) {
        p = queue[i]; if (p == "" || (p in seen)) continue
        seen[p] = 1; out = out " " p
        m = split(kids[p], k, " "); for (j = 1; j <= m; j++) queue[++n] = k[j]
      }
      print out
    }'
}

outside_group() {  # outside_group PGID PID...: those of the PIDs whose process group is not PGID
  local g="$1"; shift
  [ $# -gt 0 ] || return 0
  ps -e -o pid=,pgid= | awk -v g="$g" -v want=" $* " 'index(want, " " $1 " ") && $2 != g { print $1 }'
}

workers_of_pool() {  # pids of `prefect worker start --pool POOL` (or `-m cse.ops.worker start`) processes of this API
  local pool="$1" pid
  ps -e -o pid=,args= | awk -v pool="$pool" '/(prefect |cse\.ops\.)worker start/ && ($0 ~ "--pool[ =]" pool "( |$)") { print $1 }' |
    while read -r pid; do
      [ -n "$(alive "$pid")" ] || continue
      # another checkout's (or a test's) worker serves another API: not ours. Without /proc the pool name decides.
      if [ -r "/proc/$pid/environ" ]; then
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -xF "PREFECT_API_URL=$PREFECT_API_URL" >/dev/null || continue
      fi
      echo "$pid"
    done
}

start_marker() {  # start_marker LOG COMMAND...: the line that opens a start's part of an appended log
  printf '\n===== %s start (pid %s): %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$$" "$(redact "${*:2}")" >>"$1"
}

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

start_worker() {
  local log="$CSE_HOME/run/worker.log" others
  mkdir -p "$CSE_HOME/run"
  if running worker; then
    echo "worker: already running (pid $(cat "$(pidfile worker)")): not starting a second one for pool $WORKER_POOL"
    return 0
  fi
  others="$(workers_of_pool "$WORKER_POOL" | tr '\n' ' ')"
  if [ -n "${others// /}" ]; then  # e.g. one whose pid file was lost: adopt it, so that `down` stops it
    set -- $others
    echo "$1" >"$(pidfile worker)"
    echo "worker: a worker for pool $WORKER_POOL is already running on $(redact "$PREFECT_API_URL") (pid $others): " \
         "not starting a second one; \`scripts/services.sh down\` stops it"
    return 0
  fi
  local cmd=("${WORKER_START[@]}" --pool "$WORKER_POOL" --limit "${CSE_WORKER_LIMIT:-2}")
  start_marker "$log" "${cmd[@]}"
  setsid "${cmd[@]}" >>"$log" 2>&1 </dev/null &
  echo $! >"$(pidfile worker)"
  echo "worker: started (pid $!, pool $WORKER_POOL, log $log)"
}

up() {
  mkdir -p "$CSE_HOME/run"
  # the ports, remembered beside the data root (scripts/env.sh and cse.storage.settings read them back)
  printf 'CSE_PREFECT_PORT=%s\nCSE_MLFLOW_PORT=%s\n' "$CSE_PREFECT_PORT" "$CSE_MLFLOW_PORT" >"$CSE_HOME/services.env"
  if ! running server; then
    local cmd=(prefect server start --host "$CSE_PREFECT_HOST" --port "$CSE_PREFECT_PORT")
    start_marker "$CSE_HOME/run/server.log" "${cmd[@]}"
    setsid "${cmd[@]}" >>"$CSE_HOME/run/server.log" 2>&1 </dev/null &
    echo $! >"$(pidfile server)"
  fi
  wait_for_api
  # the work pools, the `gpu` limit (one training job per GPU slot at a time: tasks/train.py occupies it while
  # training on CUDA) and the crashed-run automation, in one process (ops/prefect_setup.py)
  retry "work pools, concurrency limit gpu, crashed-run automation" python -m cse.ops.prefect_setup \
    --pool local --pool gpu --limit "gpu=${CSE_GPU_SLOTS:-1}" --automation
  prefect --no-prompt deploy --all >"$CSE_HOME/run/deploy.log" 2>&1 || { cat "$CSE_HOME/run/deploy.log" >&2; exit 1; }
  start_worker
  # plain shells (only the venv activated) reach this server through the Prefect profile `cse` (ops/prefect_profile.py)
  python -m cse.ops.prefect_profile || echo "could not write the Prefect profile: plain shells need \`source scripts/env.sh\`" >&2
  echo "Prefect UI: http://$CSE_PREFECT_HOST:$CSE_PREFECT_PORT   (worker log: $CSE_HOME/run/worker.log)"
  echo "Ports: Prefect $CSE_PREFECT_PORT (CSE_PREFECT_PORT), MLflow UI $CSE_MLFLOW_PORT (CSE_MLFLOW_PORT;" \
       "\`mlflow ui --port $CSE_MLFLOW_PORT\`), remembered in $CSE_HOME/services.env"
}

stop() {  # stop SVC: prints the truth; status 1 (pid file kept) when something is left running
  local svc="$1" pf pid pids left how sig waited
  sig="$(stop_signal "$svc")"
  how="SIG$sig"
  pf="$(pidfile "$svc")"
  if [ ! -f "$pf" ]; then echo "$svc: not running"; return 0; fi
  pid="$(cat "$pf")"
  if ! is_service "$svc" "$pid"; then
    rm -f "$pf"
    echo "$svc: not running (removed the stale pid file of pid $pid)"
    return 0
  fi
  pids="$(tree_of "$pid")"  # the flow runs a worker started run in sessions of their own: they are in its tree
  # its stop signal to the process group (when PID leads one); SIGTERM to the tree's processes outside the group (flow
  # runs in sessions of their own: their runs end as killed, resumable)
  if kill "-$sig" -- "-$pid" 2>/dev/null; then
    # shellcheck disable=SC2046
    kill -TERM $(outside_group "$pid" $pids) 2>/dev/null || true
  else
    # shellcheck disable=SC2086
    kill "-$sig" $pids 2>/dev/null || true
  fi
  waited=0
  while [ -n "$(alive $pids)" ] && [ "$waited" -lt "$((STOP_TIMEOUT * 5))" ]; do sleep 0.2; waited=$((waited + 1)); done
  if [ -n "$(alive $pids)" ]; then
    how="SIGKILL after ${STOP_TIMEOUT} s"
    pids="$pids $(tree_of "$pid")"
    kill -KILL -- "-$pid" 2>/dev/null || true
    # shellcheck disable=SC2086
    kill -KILL $(alive $pids) 2>/dev/null || true
    for _ in $(seq 1 25); do [ -n "$(alive $pids)" ] || break; sleep 0.2; done
  fi
  left="$(alive $pids | tr '\n' ' ')"
  if [ -n "${left// /}" ]; then
    echo "$svc: NOT stopped: still running after SIGKILL: pid ${left% } (pid file $pf kept)" >&2
    return 1
  fi
  rm -f "$pf"
  echo "$svc: stopped ($how)"
}

down() {
  local status=0
  stop worker || status=1
  stop server || status=1
  return "$status"
}

case "${1:-}" in
  up) up ;;
  worker) start_worker ;;
  down) down ;;
  status) for s in server worker; do
            if running "$s"; then echo "$s: running (pid $(cat "$(pidfile "$s")"))"; else echo "$s: stopped"; fi
          done ;;
  *) echo "usage: $0 up|down|status|worker" >&2; exit 2 ;;
esac
