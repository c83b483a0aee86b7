"""The CLI's rich console: the terminal's width on a terminal, 200 columns when writing to a file
or pipe (logs, CI), where rich would otherwise wrap tables at 80 columns."""

from __future__ import annotations

import sys

from rich.console import Console


def make_console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 200)
