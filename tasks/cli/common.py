"""Helpers every command group shares: the common options and JSON output."""

from __future__ import annotations

import argparse
import json
import sys

from .console import emit


def url_arg(parser: argparse.ArgumentParser) -> None:
    """--url: specdec's database."""
    parser.add_argument("--url", default=None,
                        help="database URL (default: $SPECDEC_DATABASE_URL, else "
                             "sqlite:///$SPECDEC_HOME/specdec.db)")


def open_store(args, settings=None):
    """The command's Store: --url (else the settings', else the default), its database checked to
    be migrated (tasks.db.store.Store.open): where a command resolves the database, once."""
    # imported here: the CLI imports every command module at start-up; the database loads for
    # the commands that use it
    from ..db.store import Store

    return Store.open(getattr(args, "url", None), settings)


def tracking_uri_arg(parser: argparse.ArgumentParser) -> None:
    """--tracking-uri: the MLflow tracking store (and model registry)."""
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow (default: $MLFLOW_TRACKING_URI, else sqlite:///$SPECDEC_HOME/mlflow.db)")


class _DeprecatedAlias(argparse.Action):
    """An old option name: stores into the new option's dest and says so on stderr."""

    def __init__(self, option_strings, dest, replacement: str, **kwargs):
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {self.replacement}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def per_domain_args(parser: argparse.ArgumentParser, min_help: str, max_help: str) -> None:
    """--min-per-domain / --max-per-domain (the settings' names); the old --min / --max still work."""
    parser.add_argument("--min-per-domain", type=int, default=None, help=min_help)
    parser.add_argument("--max-per-domain", type=int, default=None, help=max_help)
    parser.add_argument("--min", dest="min_per_domain", type=int, action=_DeprecatedAlias,
                        replacement="--min-per-domain", help="deprecated: --min-per-domain")
    parser.add_argument("--max", dest="max_per_domain", type=int, action=_DeprecatedAlias,
                        replacement="--max-per-domain", help="deprecated: --max-per-domain")


def print_json(value) -> None:
    emit(json.dumps(value, indent=2, default=str))
