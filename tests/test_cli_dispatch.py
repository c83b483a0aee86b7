"""The `specdec` command line dispatches lazily (tasks.cli.parsers): the whole parser is built from
light modules, and a command's own module -- with the steps, the engine, MLflow or Airflow it
imports at its top -- is imported only when that command runs."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from tasks.cli.app import build_parser
from tasks.cli.parsers import Command

from .helpers import REPO

# the modules that implement the commands: none is imported to build or print the parser
COMMAND_MODULES = ("tasks.cli.compare", "tasks.cli.config", "tasks.cli.data", "tasks.cli.draft",
                   "tasks.cli.engine", "tasks.cli.engine_checks", "tasks.cli.evaluation",
                   "tasks.cli.main_job", "tasks.cli.monitor", "tasks.cli.profile")
HEAVY = ("torch", "transformers", "mlflow", "airflow", "great_expectations", "pandas", "matplotlib")


def _leaves(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(the words naming each command, its parser) for every command the parser runs."""
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]  # noqa: SLF001
    if not actions:
        yield words, parser
        return
    for name, child in actions[0].choices.items():
        yield from _leaves(child, (*words, name))


def test_the_help_and_parsing_every_command_import_no_command_module_nor_a_heavy_package():
    code = ("import sys\nfrom tasks.cli.app import build_parser, main\n"
            "for argv in (['--help'], ['config', '--help'], ['draft', 'train', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as exc:\n        assert exc.code == 0, argv\n"
            "build_parser().parse_args(['config', 'promote', '1'])\n"
            "build_parser().parse_args(['draft', 'train', '--kind', 'eagle3', '--layer-ids', '2,4,6'])\n"
            f"print(sorted(m for m in sys.modules if m in {COMMAND_MODULES + HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: specdec" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_every_command_names_a_function_of_its_module_and_its_help_parses(capsys):
    leaves = list(_leaves(build_parser()))
    assert len(leaves) >= 30
    for words, parser in leaves:
        func = parser.get_default("func")
        assert isinstance(func, Command), words
        module = func.path.partition(":")[0]
        assert module in COMMAND_MODULES, (words, func)
        assert callable(func.resolve()), (words, func)
        with pytest.raises(SystemExit) as parsed:
            build_parser().parse_args([*words, "--help"])
        assert parsed.value.code == 0, words
    capsys.readouterr()


def test_a_command_runs_the_function_its_path_names():
    command = Command("tasks.cli.engine:decimals")
    assert command.resolve() is importlib.import_module("tasks.cli.engine").decimals
    assert command(1.234) == "1.23"
    assert repr(command) == "Command('tasks.cli.engine:decimals')"
