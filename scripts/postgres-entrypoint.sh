#!/bin/sh
# Entrypoint of the dev overlay's PostgreSQL image made by scripts/cluster-images, with the
# environment of the official postgres image: on an empty PGDATA it creates the cluster with
# superuser POSTGRES_USER (password POSTGRES_PASSWORD, scram-sha-256 over TCP) and database
# POSTGRES_DB; then it runs the server in the foreground, listening on every address.
# Runs under busybox sh as whatever non-root user the Pod sets.
set -eu
: "${PGDATA:=/var/lib/postgresql/data/pgdata}"
: "${POSTGRES_USER:=postgres}"
: "${POSTGRES_DB:=$POSTGRES_USER}"
[ -n "${POSTGRES_PASSWORD:-}" ] || { echo "postgres-entrypoint: POSTGRES_PASSWORD is empty" >&2; exit 1; }

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  busybox mkdir -p "$PGDATA"
  busybox chmod 0700 "$PGDATA"
  pwfile="$(busybox mktemp)"
  # The password goes through a 0600 file, never a command line.
  printf '%s' "$POSTGRES_PASSWORD" >"$pwfile"
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C \
    --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  busybox rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  if [ "$POSTGRES_DB" != postgres ]; then
    echo "CREATE DATABASE \"$POSTGRES_DB\" OWNER \"$POSTGRES_USER\";" |
      postgres --single -D "$PGDATA" -j postgres >/dev/null
  fi
  echo "postgres-entrypoint: created the cluster in $PGDATA (database $POSTGRES_DB)" >&2
fi
unset POSTGRES_PASSWORD
exec postgres -D "$PGDATA" -c listen_addresses='*' -c jit=off -c unix_socket_directories=/var/run/postgresql
