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

# The false-alarm rate of a sampling test on vLLM's server in the tests that expect it to pass.
# The server draws without per-request seeds, so what it draws depends on how it schedules the
# rows, and CPU load (two test workers) changes that: a correct engine then fails at the test's
# alpha, 0.01 by default (it did, once: p 0.0033 against 0.0033 on a domain whose plain control
# passed). At 1e-4 the suite's five such tests give a false alarm in about one run in 2,000; the
# defect they are there for still fails far below it (vLLM's unmended CPU sampler at T 0.7 top-p
# 0.9: p computed as 0 at positions 1-2, tests/test_vllm_server.py).
PASSING_ALPHA = 1e-4
