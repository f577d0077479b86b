#!/bin/sh
# Entry point of docker/Dockerfile.postgres: the official postgres image's conventions, cut down.
# First start (empty $PGDATA): initdb with $POSTGRES_USER as superuser and $POSTGRES_PASSWORD (scram-sha-256 for
# TCP, from anywhere the container network lets through), creates $POSTGRES_DB and runs the
# /docker-entrypoint-initdb.d/*.sh scripts (sourced, with psql on the local socket) under a temporary server that
# listens on no TCP address. Then postgres runs in the foreground as OS user postgres.
set -eu
: "${POSTGRES_USER:=postgres}" "${POSTGRES_DB:=$POSTGRES_USER}"
[ -n "${POSTGRES_PASSWORD:-}" ] || { echo "postgres_entrypoint: POSTGRES_PASSWORD is not set" >&2; exit 1; }
as_pg() { setpriv --reuid=postgres --regid=postgres --init-groups -- "$@"; }
mkdir -p "$PGDATA" /var/run/postgresql
chown postgres: "$PGDATA" /var/run/postgresql
chmod 700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pw="$(mktemp)"; chown postgres: "$pw"; chmod 600 "$pw"
  printf '%s\n' "$POSTGRES_PASSWORD" >"$pw"
  as_pg initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pw" --auth-local=trust --auth-host=scram-sha-256 \
    -E UTF8 --locale=C >/dev/null
  rm -f "$pw"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  as_pg pg_ctl -D "$PGDATA" -w -o "-c listen_addresses='' -k /var/run/postgresql" start >/dev/null
  export PGHOST=/var/run/postgresql PGUSER="$POSTGRES_USER"
  if [ "$POSTGRES_DB" != postgres ]; then
    psql -X -q -d postgres -v ON_ERROR_STOP=1 -c "CREATE DATABASE \"$POSTGRES_DB\""
  fi
  for f in /docker-entrypoint-initdb.d/*.sh; do
    [ -e "$f" ] || continue
    echo "postgres_entrypoint: running $f"
    . "$f"
  done
  unset PGHOST PGUSER
  as_pg pg_ctl -D "$PGDATA" -m fast -w stop >/dev/null
fi
if [ "${1:-}" = postgres ]; then
  shift
  exec setpriv --reuid=postgres --regid=postgres --init-groups -- postgres -D "$PGDATA" \
    -c listen_addresses="${POSTGRES_LISTEN:-*}" -k /var/run/postgresql "$@"
fi
exec "$@"
