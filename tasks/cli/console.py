"""The CLI's output streams: results on stdout, errors and warnings on stderr, so that
`specdec config export > cfg.json` or `specdec report NAME --format csv | ...` carries only the
result.

The rich consoles have the terminal's width on a terminal; when writing to a file or pipe (logs,
CI), tables get 200 columns (rich would otherwise wrap them at 80) and text lines are not wrapped
at all (a wrapped line can split a figure from its label).

A reader that stops early (`specdec report NAME | head`) closes the pipe: the rest of the output is
dropped without a traceback and the command ends with its own exit status (Python's note on
SIGPIPE: stdout is pointed at os.devnull, so no later write and not the flush at exit fails again).
"""

from __future__ import annotations

import os
import sys

from rich.console import Console

from ..masking import mask_text


class MaskingStream:
    """A text stream whose every write has its URL credentials hidden (tasks.masking) before it
    reaches `stream`: what a library prints by itself (MLflow's run links, its log lines, Python
    warnings) shows no password. Everything else (fileno, isatty, flush, encoding) is the
    stream's own. A URL split over two writes is not recognised; Python-level writes only (a child
    process writing to the same file descriptor is not seen)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(mask_text(text) if isinstance(text, str) else text)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def discard_stdout() -> None:
    """The reader of stdout has gone: send the rest of stdout to os.devnull."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """rich's hook for a closed pipe (its default exits with status 1): drop the output, and
        let the command finish and return its own status."""
        self.quiet = True
        if not self.stderr:
            discard_stdout()


def make_console(stderr: bool = False, width: int | None = None) -> Console:
    """A console on stdout (results) or stderr (errors, warnings, notes); `width` fixes the width."""
    stream = sys.stderr if stderr else sys.stdout
    if width is not None:
        return _Console(width=width, stderr=stderr)
    if stream.isatty():
        return _Console(stderr=stderr)
    return _Console(width=200, soft_wrap=True, stderr=stderr)


def emit(text: str, end: str = "\n") -> None:
    """Write a result (JSON, CSV, text) to stdout as it is; a closed pipe drops it quietly."""
    try:
        sys.stdout.write(text + end)
        sys.stdout.flush()
    except BrokenPipeError:
        discard_stdout()


def flush_stdout() -> None:
    """Flush stdout before exit; a reader that has gone is not an error."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        discard_stdout()
