"""The `specdec` command line's parsers, one module per command group, each naming the function
that runs a subcommand by the dotted path of the module that implements it (`Command`).

Building the whole parser -- `specdec --help`, a command's --help, parsing any command line --
loads these light modules only: a command's module (and the engine, MLflow or Airflow it imports
at its top) is imported when that command runs.
"""

from __future__ import annotations

import importlib


class Command:
    """A subcommand's function named "package.module:function": its module is imported when the
    command runs, not when the parser is built."""

    def __init__(self, path: str):
        self.path = path

    def resolve(self):
        """The function itself (importing its module)."""
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, args) -> int:
        return self.resolve()(args)

    def __repr__(self) -> str:
        return f"Command({self.path!r})"
