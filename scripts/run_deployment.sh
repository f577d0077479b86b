# Sourced by the job scripts: `run NAME [prefect deployment run options]` runs a deployment through the worker,
# waits for it, and exits non-zero (printing the run's log tail) unless it completes.
run() {
  echo "==> prefect deployment run $*"
  local log="$CSE_HOME/run/last_run.log"
  prefect deployment run "$@" --watch --watch-timeout "${CSE_WATCH_TIMEOUT:-3600}" >"$log" 2>&1 || {
    tail -n 40 "$log" >&2
    echo "deployment run $1 failed; worker log: $CSE_HOME/run/worker.log" >&2
    exit 1
  }
  tail -n 1 "$log"
}
