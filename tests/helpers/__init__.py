"""Helpers shared by the test modules: plain functions, classes and constants, grouped by what they
help with. Fixtures stay in tests/conftest.py; a test module imports helpers from here and never
from another test module or from conftest.py (tests/test_suite_layout.py checks that).

    models      tiny random Llama models, saved as model directories; prompts for the decoder tests
    traffic     traffic rows and JSONL files; a tiny target's own traffic; the stored rows
    db          PostgreSQL schemas per test; reading and writing rows
    costs       hand-built cost tables and acceptance estimates for the planner
    evaluation  `evaluate` on a tiny target with small settings
    registry    the rows an evaluation leaves, registration; an MLflow server on loopback
    processes   processes and servers on loopback, stopped with their whole process group
    airflow     small settings and run conf for Airflow runs; waiting on services, their logs
    scripts     repository scripts (benchmarks/, scripts/) imported as modules
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
