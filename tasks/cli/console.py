"""The CLI's rich console: the terminal's width on a terminal; when writing to a file or pipe
(logs, CI), tables get 200 columns (rich would otherwise wrap them at 80) and text lines are not
wrapped at all (a wrapped line can split a figure from its label)."""

from __future__ import annotations

import sys

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    if stream.isatty():
        return Console(stderr=stderr)
    return Console(width=200, soft_wrap=True, stderr=stderr)
