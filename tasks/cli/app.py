"""The `specdec` command line: the root parser (each command group's parser from its module in
tasks.cli.parsers), logging, and one line for each known failure. A command's own module is
imported only when that command runs (tasks.cli.parsers.Command): the start-up stays light."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from rich.markup import escape

from specdec_core.errors import SpecDecError

from ..db.engine import database_error, is_disk_full, resolve_database_url
from ..errors import InvalidValue, SpecdecTaskError
from ..masking import mask_text, printable
from ..paths import check_identifier
from ..registry.mlflow_scope import SUPPRESS_RUN_URL_ENV, mlflow_settings
from .console import MaskingStream, flush_stdout, make_console
from .parsers import compare, config, data, draft, engine, evaluation, main_job, monitor
from .prompts import PromptFileError

errors = make_console(stderr=True)     # errors and warnings: stdout carries only results


def build_parser() -> argparse.ArgumentParser:
    """The whole `specdec` parser, built from the light parser modules (tasks.cli.parsers): a
    command's own module is imported only when it runs."""
    parser = argparse.ArgumentParser(prog="specdec", description="The `specdec` command line.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (compare, data, evaluation, config, main_job, draft, engine, monitor):
        group.register(sub)
    return parser


class _MaskingFilter(logging.Filter):
    """Hides URL credentials in every log record (tasks.masking)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, ()
        return True


def main(argv: list[str] | None = None) -> int:
    # stdout carries results only, and no command prints a password: MLflow's own run links (the
    # tracking URI as given, credentials included) are switched off with MLflow's documented
    # setting, whatever the environment says, for this command only (the process's environment is
    # not written), and anything else written to stdout or stderr while the command runs has its
    # URL credentials masked.
    # An uncaught error (a bug to report) has its traceback printed here, while stderr still
    # masks: printed by the interpreter after main() returns, it would show the URLs in its
    # message (SQL parameters included) as they are.
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = MaskingStream(sys.stdout), MaskingStream(sys.stderr)
    try:
        with mlflow_settings(forced={SUPPRESS_RUN_URL_ENV: True}):
            return _main(argv)
    except Exception:
        traceback.print_exc()
        flush_stdout()
        return 1
    except KeyboardInterrupt:       # Ctrl-C: one line, not the traceback of wherever it landed
        errors.print("[red]error:[/red] Interrupted: stopped by Ctrl-C (SIGINT); what was committed "
                     "is kept: run the command again to go on (an import skips the rows it stored)")
        return 130
    finally:
        sys.stdout, sys.stderr = streams


def _main(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except InvalidValue as exc:     # a value the option's type refused: one line, before any work
        errors.print(f"[red]error:[/red] InvalidValue: {escape(printable(mask_text(str(exc)), keep_newlines=True))}")
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_MaskingFilter())
    if not args.verbose:    # urllib3's per-retry warnings: the error line says it once
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        # MLflow logs its store's database errors with their traceback before raising them
        # (a full disk: 70 lines); the error line says it once, -v shows them
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    try:
        if getattr(args, "run_id", None) is not None:     # every command's run id, one rule
            check_identifier(args.run_id, "run id")
        status = args.func(args)
    except (SpecDecError, PromptFileError, SpecdecTaskError) as exc:
        errors.print(f"[red]error:[/red] {type(exc).__name__}: {escape(printable(mask_text(str(exc)), keep_newlines=True))}")
        status = 2
    except Exception as exc:    # MLflow's own refusals, a full disk: one line, credentials hidden
        status = _known_failure(exc, args)
    flush_stdout()      # a reader that stopped early (`| head`) changes no exit status
    return status


def _known_failure(exc: Exception, args) -> int:
    """2 with one line on stderr for MLflow's refusals and a full disk (database or files);
    anything else is re-raised (a traceback: a bug to report)."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException) and not is_disk_full(exc):
        errors.print(f"[red]error:[/red] MLflow: {escape(printable(mask_text(' '.join(str(exc.message).split()))[:500]))}")
        return 2
    if not is_disk_full(exc):
        raise exc
    if isinstance(exc, OSError):
        where = f" writing {exc.filename}" if exc.filename else ""
        errors.print(f"[red]error:[/red] DiskFull: disk full{escape(printable(mask_text(where)))} ({escape(printable(exc.strerror or str(exc)))}); "
                     "free space there, then run the command again: a run or import repeats by its id")
        return 2
    try:
        url = resolve_database_url(getattr(args, "url", None))
    except SpecdecTaskError:
        url = "(the configured database)"
    failure = database_error(url, exc)
    errors.print(f"[red]error:[/red] {type(failure).__name__}: {escape(printable(mask_text(str(failure)), keep_newlines=True))}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
