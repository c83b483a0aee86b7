"""`specdec main-job`'s parser (run by tasks.cli.main_job)."""

from __future__ import annotations

from ..common import json_object
from . import Command


def register(sub) -> None:
    parser = sub.add_parser("main-job", help="the README's main job: specdec_evaluate through Airflow's "
                                             "dag.test() on the embedded default and shipped traffic")
    parser.add_argument("--no-promote", action="store_true", help="register only (alias challenger)")
    parser.add_argument("--conf", type=json_object("--conf"), default=None, help="JSON run conf for specdec_evaluate's Params")
    parser.set_defaults(func=Command("tasks.cli.main_job:cmd_main_job"))
