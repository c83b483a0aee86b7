# specdec-rollout: one image for the Airflow services, the MLflow server and the `specdec` CLI.
# CPU by default. For the GPU worker, build with the CUDA build of torch, e.g.
#   docker build --build-arg TORCH_SPEC="torch==2.11.0" --build-arg TORCH_INDEX_URL=<your CUDA wheel index> .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    SPECDEC_HOME=/data/specdec AIRFLOW_HOME=/opt/airflow

RUN apt-get update && apt-get install -y --no-install-recommends libpq5 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 50000 specdec \
    && mkdir -p /data/specdec /opt/airflow && chown -R specdec /data /opt/airflow

WORKDIR /opt/specdec
COPY pyproject.toml constraints.txt README.md ./
COPY specdec_core ./specdec_core
COPY tasks ./tasks
COPY sql ./sql
# torch first: a bare `torch` requirement would pull the newest CUDA build
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"; \
    else pip install "$TORCH_SPEC"; fi \
    && grep -v '^torch==' constraints.txt > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt .
COPY dags /opt/airflow/dags

USER specdec
