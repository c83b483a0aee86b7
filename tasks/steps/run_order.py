"""The order of an evaluation run, written once. The DAG (dags/specdec_evaluate.py, through
tasks.orchestration.airflow_glue.wire_in_order) and `specdec evaluate` (tasks.steps.evaluate)
both follow RUN_ORDER, and both treat a failing domain the same way: its step's failure is
recorded (the domain is off, the champion's setting kept), the other domains go on, and the run
fails at the end with DOMAINS_FAILED's words. Plain constants: a DAG file imports this at parse
time (no torch, no database).
"""

from __future__ import annotations

PER_DOMAIN = ("estimate", "confirm", "validate")      # per domain, in this order
RUN_ORDER = ("sample", "check", "profile", "per_domain", "finish", "engine_check", "register",
             "promote")


def domains_failed_text(failed: list[str]) -> str:
    """Why a run whose domain steps failed ends failed (the DAG's last task, the CLI's exit)."""
    return (f"domains {failed} failed (off in this config; the champion's setting is kept): see "
            "their tasks' logs and the domain_configs reasons")
