"""The `specdec` command line: one module per command group, the shared argument and output
helpers in `common`. `main` is the console entry point (`specdec = "tasks.cli:main"`).

Importing this package stays light: the root parser and every command group's parser
(tasks.cli.app, tasks.cli.parsers) are imported only when `main` runs, so one command's module
(tasks.cli.data, tasks.cli.prompts) is imported without them; `main` then imports only the module
of the command it runs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command; the exit status."""
    # imported here: a command module (tasks.cli.data) is imported without the whole CLI
    from .app import main as run

    return run(argv)


__all__ = ["main"]
