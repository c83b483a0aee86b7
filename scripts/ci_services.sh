#!/usr/bin/env bash
# The services the integration tests need, set up as CI does (.ci/run and `make test-all` call
# this, so it is written once): Debian's PostgreSQL on loopback with the specdec role and the
# specdec_test database, Debian's chromium (Playwright drives it; no browser download), Debian's
# redis-server (the Celery broker of tests/test_celery.py, started on loopback by the test) and
# docker-compose (validates docker-compose.yml with its profiles; no engine is needed for that).
# Installs what is missing with apt-get (sudo unless root); idempotent.
#
# Sourced (`. scripts/ci_services.sh`): sets up the services and exports SPECDEC_TEST_POSTGRES_URL,
# SPECDEC_REQUIRE_BROWSER=1 and SPECDEC_REQUIRE_CELERY=1 into the calling shell.
# Run with a command (`bash scripts/ci_services.sh make test`): the same, then runs the command.
set -euo pipefail

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

# Debian's postgresql: installed if missing, its cluster listening on 127.0.0.1 only
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi
PG_VERSION=$(ls /usr/lib/postgresql | sort -n | tail -1)
if ! $SUDO pg_lsclusters -h | awk -v v="$PG_VERSION" '$1 == v && $2 == "main"' | grep -q .; then
    $SUDO pg_createcluster "$PG_VERSION" main
fi
PG_CONF="/etc/postgresql/$PG_VERSION/main/postgresql.conf"
changed=0
if ! grep -q "^listen_addresses = '127.0.0.1'" "$PG_CONF"; then
    $SUDO sed -i "s/^#\?listen_addresses.*/listen_addresses = '127.0.0.1'/" "$PG_CONF"
    changed=1
fi
PG_PORT=$($SUDO pg_lsclusters -h | awk -v v="$PG_VERSION" '$1 == v && $2 == "main" {print $3}')
PG_STATUS=$($SUDO pg_lsclusters -h | awk -v v="$PG_VERSION" '$1 == v && $2 == "main" {print $4}')
# start it when down; restart only when the listen address had to change (others may be using it)
if [ "$PG_STATUS" != "online" ]; then
    $SUDO pg_ctlcluster "$PG_VERSION" main start
elif [ "$changed" = 1 ]; then
    $SUDO pg_ctlcluster "$PG_VERSION" main restart
fi
for _ in $(seq 1 30); do
    pg_isready -q -h 127.0.0.1 -p "$PG_PORT" && break
    sleep 1
done
pg_isready -h 127.0.0.1 -p "$PG_PORT"

as_postgres() { $SUDO runuser -u postgres -- "$@"; }
if ! as_postgres psql -p "$PG_PORT" -tAc "SELECT 1 FROM pg_roles WHERE rolname = 'specdec'" | grep -q 1; then
    as_postgres psql -p "$PG_PORT" -qc "CREATE ROLE specdec LOGIN PASSWORD 'specdec'"
fi
if ! as_postgres psql -p "$PG_PORT" -tAc "SELECT 1 FROM pg_database WHERE datname = 'specdec_test'" | grep -q 1; then
    as_postgres createdb -p "$PG_PORT" -O specdec specdec_test
fi
export SPECDEC_TEST_POSTGRES_URL="postgresql+psycopg://specdec:specdec@127.0.0.1:${PG_PORT}/specdec_test"

# Debian's chromium for the browser test (Playwright drives it; no browser download)
if ! command -v chromium >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
export SPECDEC_REQUIRE_BROWSER=1

# Debian's redis-server (the Celery broker of tests/test_celery.py, started on loopback by the test)
# and docker-compose (validates docker-compose.yml with its profiles; no engine is needed for that)
if ! command -v redis-server >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        redis-server docker-compose >/dev/null
fi
export SPECDEC_REQUIRE_CELERY=1

if [ "${BASH_SOURCE[0]}" = "$0" ] && [ "$#" -gt 0 ]; then
    exec "$@"
fi
