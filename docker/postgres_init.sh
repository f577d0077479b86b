#!/bin/sh
# /docker-entrypoint-initdb.d/ script of the compose stack's postgres (official image or docker/Dockerfile.postgres):
# creates the MLflow database beside $POSTGRES_DB (the Prefect one). Runs once, on an empty data folder.
set -eu
db="${CSE_PG_MLFLOW_DB:-mlflow}"
case "$db" in *[!A-Za-z0-9_]*|"") echo "postgres_init: not a plain SQL identifier: $db" >&2; exit 1 ;; esac
if [ "$(psql -X -tA -d postgres -U "$POSTGRES_USER" -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
  psql -X -q -d postgres -U "$POSTGRES_USER" -v ON_ERROR_STOP=1 -c "CREATE DATABASE $db"
fi
