# Embedded single-machine defaults (sourced by the scripts). Every value can be preset in the environment.
: "${VIRTUAL_ENV:=$PWD/.venv}"
export PATH="$VIRTUAL_ENV/bin:$PATH"
export CSE_HOME="${CSE_HOME:-$PWD/.cse}"
# The ports `scripts/services.sh up` used last for this CSE_HOME (its services.env, `NAME=port` lines): a new shell
# reaches the same server and prints links to the same MLflow port. A variable set in the environment wins.
if [ -f "$CSE_HOME/services.env" ]; then
  while IFS='=' read -r _name _port; do
    case "$_name=$_port" in
      CSE_PREFECT_PORT=*[!0-9]* | CSE_MLFLOW_PORT=*[!0-9]* | *=) ;;
      CSE_PREFECT_PORT=*) [ -n "${CSE_PREFECT_PORT:-}" ] || export CSE_PREFECT_PORT="$_port" ;;
      CSE_MLFLOW_PORT=*) [ -n "${CSE_MLFLOW_PORT:-}" ] || export CSE_MLFLOW_PORT="$_port" ;;
    esac
  done <"$CSE_HOME/services.env"
  unset _name _port
fi
export CSE_PREFECT_HOST="${CSE_PREFECT_HOST:-127.0.0.1}"
export CSE_PREFECT_PORT="${CSE_PREFECT_PORT:-4200}"
export CSE_MLFLOW_PORT="${CSE_MLFLOW_PORT:-5000}"
# The Prefect home of the calling shell, before the line below replaces it: where `services.sh up` writes the Prefect
# profile `cse` that lets a plain shell (only the venv activated) reach the server (ops/prefect_profile.py).
[ -n "${CSE_SHELL_PREFECT_HOME+x}" ] || export CSE_SHELL_PREFECT_HOME="${PREFECT_HOME:-}"
export PREFECT_HOME="${PREFECT_HOME:-$CSE_HOME/prefect}"
export PREFECT_API_URL="${PREFECT_API_URL:-http://$CSE_PREFECT_HOST:$CSE_PREFECT_PORT/api}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=1
export MLFLOW_TRACKING_URI="${MLFLOW_TRACKING_URI:-sqlite:///$CSE_HOME/mlflow.db}"
export TOKENIZERS_PARALLELISM=false
# Flow runs send a heartbeat every 30 s; the automation of ops/automations.py marks a run CRASHED after three
# missed ones (a killed worker), so rerunning its deployment resumes it.
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY="${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}"
# A server whose database restarts (a PostgreSQL maintenance restart) answers 500 for a moment: Prefect's clients
# (flow runs, workers) retry it as they retry 502/503, with back-off, instead of failing the flow run.
export PREFECT_CLIENT_RETRY_EXTRA_CODES="${PREFECT_CLIENT_RETRY_EXTRA_CODES:-500}"
# Offline machines read sources from the local mirror beside the checkout when it exists.
# Set CSE_SOURCE_MIRROR= (empty) to download the canonical files instead.
if [ -z "${CSE_SOURCE_MIRROR+x}" ] && [ -d "$PWD/../shared/data" ]; then
  export CSE_SOURCE_MIRROR="$(cd "$PWD/../shared/data" && pwd)"
fi
