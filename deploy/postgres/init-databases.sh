#!/bin/bash
# Runs once, when the PostgreSQL volume is first initialised: one database and one role per
# system. Airflow, specdec and MLflow each migrate their own schema with Alembic, so they must
# never share a database. Passwords come from the environment (.env), never from this file.
set -euo pipefail
create() {  # create ROLE DATABASE PASSWORD
  psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname postgres \
       -v role="$1" -v db="$2" -v pw="$3" <<'SQL'
CREATE ROLE :"role" LOGIN PASSWORD :'pw';
CREATE DATABASE :"db" OWNER :"role";
SQL
}
create airflow airflow "$AIRFLOW_DB_PASSWORD"
create specdec specdec "$SPECDEC_DB_PASSWORD"
create mlflow mlflow "$MLFLOW_DB_PASSWORD"
