"""The `specdec` command line: one module per command group, the shared argument and output
helpers in `common`. `main` is the console entry point (`specdec = "tasks.cli:main"`).

Importing this package stays light: the root parser (which loads the engine, hence torch) is
imported only when `main` runs, so the data commands' modules can be imported without torch.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command; the exit status."""
    # imported here: a command module (tasks.cli.data) is imported without the whole CLI
    from .app import main as run

    return run(argv)


__all__ = ["main"]
