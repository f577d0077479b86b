# Sourced by the job scripts: `run NAME [-p key=value ...]` runs a deployment through the worker (`cse run`, ops/deployments.py),
# waits for it, prints which stages were cache hits, and exits non-zero (printing the failing task's reason) unless it
# completes. CSE_WATCH_TIMEOUT (seconds, default 3600) bounds the wait.
run() {
  python -m cse.ops.cli run "$@" --timeout "${CSE_WATCH_TIMEOUT:-3600}" || {
    echo "deployment run $1 failed; worker log: $CSE_HOME/run/worker.log" >&2
    exit 1
  }
}
