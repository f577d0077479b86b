#!/usr/bin/env bash
# The team stack: PostgreSQL, a Prefect server and an MLflow tracking server on it, N process workers.
#
# Usage: scripts/team.sh up|down|status|restart-postgres
#
# `up` is idempotent (what runs already is kept) and starts, in order, the services named in
# $CSE_TEAM_SERVICES (default: all of them; a GPU host that only adds workers to a stack running
# elsewhere sets CSE_TEAM_SERVICES=workers and points PREFECT_API_URL / MLFLOW_TRACKING_URI at it);
# the Prefect and MLflow server processes are launched together, then set up and waited for in that order:
#   postgres  initdb into $CSE_PG_DATA (first time), postgres on $CSE_PG_LISTEN:$CSE_PG_PORT with a generated
#             password kept in $CSE_PG_PASSWORD_FILE (0600), databases $CSE_PG_PREFECT_DB and $CSE_PG_MLFLOW_DB
#             (CSE_PG_MANAGED=0: use an existing server at $CSE_PG_HOST:$CSE_PG_PORT, only create the databases)
#   prefect   `prefect server start` on PostgreSQL (asyncpg), work pools `local` and `gpu`, the global
#             concurrency limit `gpu`, the crashed-run automation, `prefect deploy --all` or the deployments
#             named in $CSE_DEPLOYMENTS (in the background while the other services start; `up` waits for it)
#   mlflow    `mlflow server` on PostgreSQL with the artifact store $CSE_MLFLOW_ARTIFACTS_DESTINATION
#             (a folder, or s3://… / any store MLflow's artifact repositories read, credentials from the
#             usual AWS_* / MLFLOW_S3_ENDPOINT_URL variables)
#   workers   $CSE_WORKERS process workers on $CSE_WORKER_POOL, each with its own name (also in the env
#             as CSE_WORKER_NAME, which tasks/train.py records as the MLflow tag `worker`) and, with
#             CSE_WORKER_GPUS="0 1 …", its own CUDA_VISIBLE_DEVICES and GPU concurrency limit
# `down` stops what this script started (process groups and their descendants, postgres via pg_ctl);
# `status` lists the services.
#
# Every address, credential and path comes from the environment (defaults below, README "Running for a
# team"); nothing lands in prefect.yaml, in the code or in MLflow params. Servers bind to 127.0.0.1 unless
# CSE_PG_LISTEN / CSE_PREFECT_HOST / CSE_MLFLOW_LISTEN say otherwise. Passwords never appear on a command
# line: the servers get them through their environment.
#
# | variable | default |
# |---|---|
# | CSE_TEAM_HOME | $CSE_HOME/team (run/ holds pid files and logs) |
# | CSE_TEAM_SERVICES | "postgres prefect mlflow workers" |
# | CSE_PG_DATA | $CSE_TEAM_HOME/pgdata |
# | CSE_PG_HOST / CSE_PG_LISTEN / CSE_PG_PORT | 127.0.0.1 / $CSE_PG_HOST / 5432 |
# | CSE_PG_USER | cse (the cluster's superuser, owner of both databases) |
# | CSE_PG_PASSWORD_FILE | $CSE_TEAM_HOME/secrets/pg_password (generated, 0600); CSE_PG_PASSWORD overrides it |
# | CSE_PG_PREFECT_DB / CSE_PG_MLFLOW_DB | prefect / mlflow |
# | CSE_PG_ALLOW_CIDR | (none) extra pg_hba.conf `host` line, e.g. 10.0.0.0/8, when CSE_PG_LISTEN is not loopback |
# | CSE_PG_OS_USER | postgres (postgres refuses to run as root: as root the cluster runs as this user) |
# | CSE_PG_BIN | the folder of `pg_ctl` on PATH |
# | CSE_PREFECT_HOST / CSE_PREFECT_PORT | 127.0.0.1 / 4200 (scripts/env.sh) |
# | PREFECT_API_DATABASE_CONNECTION_URL | postgresql+asyncpg://$CSE_PG_USER:${PREFECT_API_DATABASE_PASSWORD}@$CSE_PG_HOST:$CSE_PG_PORT/$CSE_PG_PREFECT_DB |
# | CSE_MLFLOW_LISTEN / CSE_MLFLOW_HOST / CSE_MLFLOW_PORT | 127.0.0.1 / $CSE_MLFLOW_LISTEN / 5000 |
# | CSE_MLFLOW_WORKERS | 2 (server processes) |
# | CSE_MLFLOW_ARTIFACTS_DESTINATION | $CSE_TEAM_HOME/mlartifacts |
# | MLFLOW_BACKEND_STORE_URI | postgresql+psycopg://$CSE_PG_USER:<password>@$CSE_PG_HOST:$CSE_PG_PORT/$CSE_PG_MLFLOW_DB |
# | MLFLOW_TRACKING_URI | http://$CSE_MLFLOW_HOST:$CSE_MLFLOW_PORT (what workers and clients use) |
# | CSE_WORKERS | number of words in CSE_WORKER_GPUS, else 2 |
# | CSE_WORKER_NAMES | "$CSE_WORKER_PREFIX-1 … -N" |
# | CSE_WORKER_PREFIX | `hostname -s` |
# | CSE_DEPLOYMENTS | (none: every deployment of prefect.yaml) the ones to register, e.g. "train-d2cse/default sweep/default" |
# | CSE_WORKER_POOL / CSE_WORKER_LIMIT | local / 2 (an experiment parent holds one slot while its children run) |
# | CSE_WORKER_GPUS | (none) one GPU set per worker, e.g. "0 1 2 3" (a GPU each) or "0,1 2,3" (two each): the worker's CUDA_VISIBLE_DEVICES, and its own concurrency limit gpu-<name> with a slot per GPU (CSE_GPU_SLOT) |
# | CSE_START_TIMEOUT | 180 seconds per service |
set -euo pipefail
cd "$(dirname "$0")/.."

export CSE_HOME="${CSE_HOME:-$PWD/.cse}"
CSE_TEAM_HOME="${CSE_TEAM_HOME:-$CSE_HOME/team}"
CSE_TEAM_SERVICES="${CSE_TEAM_SERVICES:-postgres prefect mlflow workers}"
CSE_PG_DATA="${CSE_PG_DATA:-$CSE_TEAM_HOME/pgdata}"
CSE_PG_MANAGED="${CSE_PG_MANAGED:-1}"
CSE_PG_HOST="${CSE_PG_HOST:-127.0.0.1}"
CSE_PG_LISTEN="${CSE_PG_LISTEN:-$CSE_PG_HOST}"
CSE_PG_PORT="${CSE_PG_PORT:-5432}"
CSE_PG_USER="${CSE_PG_USER:-cse}"
CSE_PG_PASSWORD_FILE="${CSE_PG_PASSWORD_FILE:-$CSE_TEAM_HOME/secrets/pg_password}"
CSE_PG_PREFECT_DB="${CSE_PG_PREFECT_DB:-prefect}"
CSE_PG_MLFLOW_DB="${CSE_PG_MLFLOW_DB:-mlflow}"
CSE_PG_OS_USER="${CSE_PG_OS_USER:-postgres}"
CSE_MLFLOW_LISTEN="${CSE_MLFLOW_LISTEN:-127.0.0.1}"
CSE_MLFLOW_HOST="${CSE_MLFLOW_HOST:-$CSE_MLFLOW_LISTEN}"
CSE_MLFLOW_PORT="${CSE_MLFLOW_PORT:-5000}"
CSE_MLFLOW_WORKERS="${CSE_MLFLOW_WORKERS:-2}"
CSE_MLFLOW_ARTIFACTS_DESTINATION="${CSE_MLFLOW_ARTIFACTS_DESTINATION:-$CSE_TEAM_HOME/mlartifacts}"
CSE_WORKER_POOL="${CSE_WORKER_POOL:-local}"
CSE_WORKER_LIMIT="${CSE_WORKER_LIMIT:-2}"
CSE_WORKER_GPUS="${CSE_WORKER_GPUS:-}"
CSE_START_TIMEOUT="${CSE_START_TIMEOUT:-180}"
case "$CSE_MLFLOW_ARTIFACTS_DESTINATION" in
  *://*) ;;
  *) mkdir -p "$CSE_MLFLOW_ARTIFACTS_DESTINATION"
     CSE_MLFLOW_ARTIFACTS_DESTINATION="$(cd "$CSE_MLFLOW_ARTIFACTS_DESTINATION" && pwd)"
     # experiments the pipeline creates (tasks/tracking.py) keep their artifacts in the same shared folder
     export CSE_MLFLOW_ARTIFACTS="${CSE_MLFLOW_ARTIFACTS:-$CSE_MLFLOW_ARTIFACTS_DESTINATION}" ;;
esac
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-http://$CSE_MLFLOW_HOST:$CSE_MLFLOW_PORT}"
source scripts/env.sh

RUN="$CSE_TEAM_HOME/run"
mkdir -p "$RUN"

DEPLOY_PID=""  # `prefect deploy` runs in the background while MLflow and the workers start (deploy_wait)
die() {
  echo "team.sh: $*" >&2
  if [ -n "$DEPLOY_PID" ]; then kill "$DEPLOY_PID" 2>/dev/null || true; fi
  exit 1
}
# mask URI user-info as cse.storage.secrets.redact does: the password (to the last @ before the host) or a token
redact() { printf '%s' "$1" | sed -E -e 's|(://[^/?#:[:space:]]*):[^/?#[:space:]]*@|\1:***@|g' -e 's|://[^/?#:[:space:]]+@|://***@|g'; }
has() { case " $CSE_TEAM_SERVICES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
valid_name() { [[ "$1" =~ ^[A-Za-z_][A-Za-z0-9_]*$ ]] || die "not a plain SQL identifier: $1"; }

# --- processes: a pid file holds "PID START_TIME", so a recycled pid is never taken for ours -------------
pidfile() { echo "$RUN/$1.pid"; }
start_time() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | awk '{print $20}'; }  # field 22, after "(comm)"
svc_pid() {  # the pid of a running service started by this script, else nothing
  local f; f="$(pidfile "$1")"
  [ -f "$f" ] || return 1
  local pid st; read -r pid st <"$f" || return 1
  [ -n "$pid" ] && [ "$(start_time "$pid")" = "$st" ] && echo "$pid"
}
running() { svc_pid "$1" >/dev/null; }
record() { echo "$2 $(start_time "$2")" >"$(pidfile "$1")"; }
tree() {  # a pid and all its descendants
  local c; echo "$1"
  for c in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree "$c"; done
}
stop_svc() {  # TERM the service's process group and every descendant (flow runs may have their own session)
  local pid pids p alive
  if pid="$(svc_pid "$1")"; then
    pids="$(tree "$pid" | tr '\n' ' ')"
    kill -TERM -- "-$pid" 2>/dev/null || true
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 1 "${CSE_STOP_TIMEOUT:-30}"); do
      alive=0
      for p in $pids; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 1
    done
    kill -KILL -- "-$pid" 2>/dev/null || true
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    echo "stopped $1"
  fi
  rm -f "$(pidfile "$1")"
}
wait_http() {  # wait_http URL NAME LOG
  for _ in $(seq 1 "$CSE_START_TIMEOUT"); do
    curl -fsS "$1" >/dev/null 2>&1 && return 0
    running "$2" || { tail -n 40 "$3" >&2; die "$2 exited during start (log: $3)"; }
    sleep 1
  done
  tail -n 40 "$3" >&2
  die "$2 did not answer at $1 within ${CSE_START_TIMEOUT}s (log: $3)"
}
retry() {  # retry NAME CMD...: a just-started server may still be settling
  local name="$1"; shift
  local i; for i in 1 2 3 4 5; do
    if "$@" >"$RUN/setup.log" 2>&1; then return 0; fi
    sleep $((i * 2))
  done
  cat "$RUN/setup.log" >&2
  die "could not set up $name"
}

# --- PostgreSQL --------------------------------------------------------------------------------------------
pg_bin() {
  if [ -n "${CSE_PG_BIN:-}" ]; then echo "$CSE_PG_BIN"; return; fi
  local ctl
  if ctl="$(command -v pg_ctl)"; then dirname "$(readlink -f "$ctl")"; return; fi
  # Debian's postgresql package keeps its binaries off PATH, under /usr/lib/postgresql/<version>/bin
  ctl="$(ls -d /usr/lib/postgresql/*/bin/pg_ctl 2>/dev/null | sort -V | tail -n 1)"
  [ -n "$ctl" ] || die "pg_ctl not found: install PostgreSQL or set CSE_PG_BIN"
  dirname "$ctl"
}
as_pg() {  # postgres, initdb and pg_ctl refuse to run as root
  if [ "$(id -u)" = 0 ]; then runuser -u "$CSE_PG_OS_USER" -- "$@"; else "$@"; fi
}
PG_PASSWORD=""
load_password() {  # sets PG_PASSWORD (not exported: only the servers get it, through their environment)
  [ -n "$PG_PASSWORD" ] && return 0
  if [ -n "${CSE_PG_PASSWORD:-}" ]; then PG_PASSWORD="$CSE_PG_PASSWORD"; return 0; fi
  if [ ! -s "$CSE_PG_PASSWORD_FILE" ]; then
    [ "$CSE_PG_MANAGED" = 1 ] || die "no password: write it to $CSE_PG_PASSWORD_FILE or set CSE_PG_PASSWORD"
    mkdir -p "$(dirname "$CSE_PG_PASSWORD_FILE")"
    chmod 700 "$(dirname "$CSE_PG_PASSWORD_FILE")"
    (umask 077; od -An -N24 -tx1 /dev/urandom | tr -d ' \n' >"$CSE_PG_PASSWORD_FILE")
  fi
  chmod 600 "$CSE_PG_PASSWORD_FILE"
  PG_PASSWORD="$(tr -d '\n' <"$CSE_PG_PASSWORD_FILE")"
  [ -n "$PG_PASSWORD" ] || die "empty password in $CSE_PG_PASSWORD_FILE"
}
pg_running() { [ -s "$CSE_PG_DATA/PG_VERSION" ] && as_pg "$(pg_bin)/pg_ctl" -D "$CSE_PG_DATA" status >/dev/null 2>&1; }
psql_admin() {  # psql_admin SQL: as the cluster's superuser over TCP (the password in psql's environment only)
  PGPASSWORD="$PG_PASSWORD" PGCONNECT_TIMEOUT=10 psql -X -q -h "$CSE_PG_HOST" -p "$CSE_PG_PORT" -U "$CSE_PG_USER" \
    -d postgres -v ON_ERROR_STOP=1 -tAc "$1"
}

pg_up() {
  valid_name "$CSE_PG_USER"; valid_name "$CSE_PG_PREFECT_DB"; valid_name "$CSE_PG_MLFLOW_DB"
  local bin; bin="$(pg_bin)"
  load_password
  if [ "$CSE_PG_MANAGED" = 1 ]; then
    if [ ! -s "$CSE_PG_DATA/PG_VERSION" ]; then
      mkdir -p "$CSE_PG_DATA"
      chmod 700 "$CSE_PG_DATA"
      [ "$(id -u)" = 0 ] && chown "$CSE_PG_OS_USER:" "$CSE_PG_DATA"
      as_pg test -w "$CSE_PG_DATA" \
        || die "$CSE_PG_DATA is not writable by OS user $(if [ "$(id -u)" = 0 ]; then echo "$CSE_PG_OS_USER"; else id -un; fi) (every parent folder must be searchable)"
      # initdb reads the superuser's password from a file: a private one, readable by the cluster's OS user only
      local pwdir rc=0; pwdir="$(mktemp -d)"
      [ "$(id -u)" = 0 ] && chown "$CSE_PG_OS_USER:" "$pwdir"
      printf '%s\n' "$PG_PASSWORD" | as_pg sh -c 'umask 077; cat >"$1"' sh "$pwdir/pw"
      as_pg "$bin/initdb" -D "$CSE_PG_DATA" -U "$CSE_PG_USER" --auth=scram-sha-256 --pwfile="$pwdir/pw" \
        -E UTF8 --locale=C >"$RUN/initdb.log" 2>&1 || rc=$?
      rm -rf "$pwdir"
      [ "$rc" = 0 ] || { cat "$RUN/initdb.log" >&2; die "initdb failed"; }
      if [ -n "${CSE_PG_ALLOW_CIDR:-}" ]; then
        echo "host all all $CSE_PG_ALLOW_CIDR scram-sha-256" | as_pg tee -a "$CSE_PG_DATA/pg_hba.conf" >/dev/null
      fi
    fi
    if ! pg_running; then
      # TCP only (no Unix socket: its path would depend on the data folder's length and permissions)
      as_pg "$bin/pg_ctl" -D "$CSE_PG_DATA" -l "$CSE_PG_DATA/server.log" -w -t "$CSE_START_TIMEOUT" \
        -o "-h $CSE_PG_LISTEN -p $CSE_PG_PORT -k ''" start >"$RUN/pg_ctl.log" 2>&1 \
        || { cat "$RUN/pg_ctl.log" >&2; as_pg tail -n 40 "$CSE_PG_DATA/server.log" >&2 || true; die "postgres did not start"; }
    fi
  fi
  for _ in $(seq 1 "$CSE_START_TIMEOUT"); do
    "$bin/pg_isready" -q -h "$CSE_PG_HOST" -p "$CSE_PG_PORT" && break
    sleep 1
  done
  local db
  for db in "$CSE_PG_PREFECT_DB" "$CSE_PG_MLFLOW_DB"; do
    [ "$(psql_admin "SELECT 1 FROM pg_database WHERE datname = '$db'")" = 1 ] || psql_admin "CREATE DATABASE $db"
  done
  echo "PostgreSQL: $CSE_PG_HOST:$CSE_PG_PORT (databases $CSE_PG_PREFECT_DB, $CSE_PG_MLFLOW_DB; password in $CSE_PG_PASSWORD_FILE)"
}

pg_down() {
  [ "$CSE_PG_MANAGED" = 1 ] || return 0
  if pg_running; then
    as_pg "$(pg_bin)/pg_ctl" -D "$CSE_PG_DATA" -m fast -w -t 60 stop >/dev/null 2>&1 || {
      local pm; pm="$(head -n 1 "$CSE_PG_DATA/postmaster.pid" 2>/dev/null || true)"
      [ -n "$pm" ] && kill -KILL "$pm" 2>/dev/null || true
    }
    echo "stopped postgres"
  fi
}

# --- Prefect server -----------------------------------------------------------------------------------------
prefect_start() {  # the server process, unless it runs already (prefect_up waits for it)
  if ! running prefect; then
    load_password
    local url="postgresql+asyncpg://$CSE_PG_USER:\${PREFECT_API_DATABASE_PASSWORD}@$CSE_PG_HOST:$CSE_PG_PORT/$CSE_PG_PREFECT_DB"
    PREFECT_API_DATABASE_CONNECTION_URL="${PREFECT_API_DATABASE_CONNECTION_URL:-$url}" \
    PREFECT_API_DATABASE_PASSWORD="$PG_PASSWORD" \
      setsid prefect server start --host "$CSE_PREFECT_HOST" --port "$CSE_PREFECT_PORT" \
      >"$RUN/prefect.log" 2>&1 </dev/null &
    record prefect $!
  fi
}

prefect_up() {
  prefect_start
  wait_http "$PREFECT_API_URL/health" prefect "$RUN/prefect.log"
  # the work pools, the `gpu` limit and the crashed-run automation, in one process (ops/prefect_setup.py)
  retry "work pools, concurrency limit gpu, crashed-run automation" python -m cse.ops.prefect_setup \
    --pool local --pool gpu --pool "$CSE_WORKER_POOL" --limit "gpu=${CSE_GPU_SLOTS:-1}" --automation
  # the deployments need their work pools only: registered in the background from here on (deploy_wait)
  local which=(--all) name
  if [ -n "${CSE_DEPLOYMENTS:-}" ]; then
    which=()
    for name in $CSE_DEPLOYMENTS; do which+=(--name "$name"); done
  fi
  prefect --no-prompt deploy "${which[@]}" >"$RUN/deploy.log" 2>&1 </dev/null &
  DEPLOY_PID=$!
  echo "Prefect: $(redact "$PREFECT_API_URL") on PostgreSQL database $CSE_PG_PREFECT_DB (log: $RUN/prefect.log)"
}

deploy_wait() {  # `up` returns once the deployments are registered
  [ -n "$DEPLOY_PID" ] || return 0
  local pid="$DEPLOY_PID"; DEPLOY_PID=""
  wait "$pid" || { cat "$RUN/deploy.log" >&2; die "prefect deploy failed (log: $RUN/deploy.log)"; }
  echo "deployments: ${CSE_DEPLOYMENTS:-all of prefect.yaml} (log: $RUN/deploy.log)"
}

# --- MLflow tracking server ---------------------------------------------------------------------------------
mlflow_start() {  # the server process, unless it runs already (mlflow_up waits for it)
  if ! running mlflow; then
    load_password
    # the backend URI holds the password: passed in the environment (mlflow's --backend-store-uri reads
    # MLFLOW_BACKEND_STORE_URI), never on the command line
    # MLflow's server-side jobs (GenAI evaluation, trace roll-ups: seven huey consumer processes, each importing
    # MLflow) are not used by the pipeline: off unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION says otherwise
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION="${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}" \
    MLFLOW_BACKEND_STORE_URI="${MLFLOW_BACKEND_STORE_URI:-postgresql+psycopg://$CSE_PG_USER:$PG_PASSWORD@$CSE_PG_HOST:$CSE_PG_PORT/$CSE_PG_MLFLOW_DB}" \
      setsid mlflow server --host "$CSE_MLFLOW_LISTEN" --port "$CSE_MLFLOW_PORT" --workers "$CSE_MLFLOW_WORKERS" \
      --artifacts-destination "$CSE_MLFLOW_ARTIFACTS_DESTINATION" >"$RUN/mlflow.log" 2>&1 </dev/null &
    record mlflow $!
  fi
}

mlflow_up() {
  mlflow_start
  wait_http "http://$CSE_MLFLOW_HOST:$CSE_MLFLOW_PORT/health" mlflow "$RUN/mlflow.log"
  case "$MLFLOW_TRACKING_URI" in
    http://*|https://*) ;;
    *) echo "team.sh: warning: MLFLOW_TRACKING_URI=$(redact "$MLFLOW_TRACKING_URI") does not point at the tracking server" >&2 ;;
  esac
  echo "MLflow: http://$CSE_MLFLOW_HOST:$CSE_MLFLOW_PORT on PostgreSQL database $CSE_PG_MLFLOW_DB, artifacts in $CSE_MLFLOW_ARTIFACTS_DESTINATION"
}

# --- workers --------------------------------------------------------------------------------------------------
worker_names() {
  if [ -n "${CSE_WORKER_NAMES:-}" ]; then echo "$CSE_WORKER_NAMES"; return; fi
  local gpus n i; read -r -a gpus <<<"$CSE_WORKER_GPUS"
  n="${CSE_WORKERS:-${#gpus[@]}}"
  [ "$n" -gt 0 ] 2>/dev/null || n=2
  for i in $(seq 1 "$n"); do printf '%s ' "${CSE_WORKER_PREFIX:-$(hostname -s)}-$i"; done
}

workers_up() {
  local names gpus i name limits=() sets=() slots=()
  read -r -a names <<<"$(worker_names)"
  read -r -a gpus <<<"$CSE_WORKER_GPUS"
  for i in "${!names[@]}"; do  # each worker's GPU set and GPU slot
    name="${names[$i]}"
    [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || die "bad worker name: $name"
    sets[i]="" slots[i]="${CSE_GPU_SLOT:-gpu}"
    if [ "${#gpus[@]}" -gt 0 ]; then
      # this worker's GPU set and its own concurrency limit (one slot per GPU): its training jobs queue
      # on it, so two jobs never share one of its GPUs, whatever the worker's flow-run limit
      sets[i]="${gpus[$((i % ${#gpus[@]}))]}"
      [[ "${sets[i]}" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "bad GPU set in CSE_WORKER_GPUS: ${sets[i]}"
      slots[i]="gpu-$name"
      running "worker-$name" || limits+=(--limit "${slots[i]}=$(tr ',' '\n' <<<"${sets[i]}" | wc -l)")
    fi
  done
  if [ "${#limits[@]}" -gt 0 ]; then  # the new workers' limits, in one process (ops/prefect_setup.py)
    retry "concurrency limits of the GPU workers" python -m cse.ops.prefect_setup "${limits[@]}"
  fi
  for i in "${!names[@]}"; do
    name="${names[$i]}"
    running "worker-$name" && continue
    (
      export CSE_WORKER_NAME="$name" CSE_GPU_SLOT="${slots[i]}"
      if [ -n "${sets[i]}" ]; then export CUDA_VISIBLE_DEVICES="${sets[i]}"; fi
      exec setsid prefect worker start --pool "$CSE_WORKER_POOL" --name "$name" --limit "$CSE_WORKER_LIMIT" --type process
    ) >"$RUN/worker-$name.log" 2>&1 </dev/null &
    record "worker-$name" $!
  done
  for name in "${names[@]}"; do  # a worker is up once it has announced itself
    for _ in $(seq 1 "$CSE_START_TIMEOUT"); do
      grep -q "started" "$RUN/worker-$name.log" 2>/dev/null && break
      running "worker-$name" || { tail -n 40 "$RUN/worker-$name.log" >&2; die "worker $name exited"; }
      sleep 1
    done
    grep -q "started" "$RUN/worker-$name.log" || die "worker $name did not start (log: $RUN/worker-$name.log)"
    echo "worker $name on pool $CSE_WORKER_POOL (limit $CSE_WORKER_LIMIT) log: $RUN/worker-$name.log"
  done
}

up() {
  if has postgres; then pg_up; fi
  # both servers start at once: MLflow's start (its schema migrations on a new database) overlaps Prefect's
  # start and setup; MLflow is then waited for after Prefect, as before
  if has prefect; then prefect_start; fi
  if has mlflow; then mlflow_start; fi
  if has prefect; then prefect_up; fi
  if has mlflow; then mlflow_up; fi
  if has workers; then workers_up; fi
  deploy_wait
}

down() {
  local f name
  for f in "$RUN"/worker-*.pid; do
    [ -e "$f" ] || continue
    name="$(basename "$f" .pid)"
    stop_svc "$name"
  done
  stop_svc mlflow
  stop_svc prefect
  pg_down
}

status() {
  local f name
  if [ "$CSE_PG_MANAGED" = 1 ]; then
    if pg_running; then echo "postgres: running ($CSE_PG_HOST:$CSE_PG_PORT)"; else echo "postgres: stopped"; fi
  fi
  for name in prefect mlflow; do
    if running "$name"; then echo "$name: running"; else echo "$name: stopped"; fi
  done
  for f in "$RUN"/worker-*.pid; do
    [ -e "$f" ] || continue
    name="$(basename "$f" .pid)"
    if running "$name"; then echo "$name: running"; else echo "$name: stopped"; fi
  done
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  restart-postgres) pg_down; pg_up ;;  # maintenance: the servers reconnect, running sweeps go on or resume
  *) echo "usage: $0 up|down|status|restart-postgres" >&2; exit 2 ;;
esac
