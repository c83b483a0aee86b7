"""Helpers every command group shares: the common options and JSON output."""

from __future__ import annotations

import argparse
import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..db.store import Store
from ..errors import InvalidValue
from ..registry.registry import Registry
from .console import emit

MAX_DAYS = 100_000                   # about 274 years: the most days any window or age may span
EARLIEST_TIME = datetime(2000, 1, 1)
MAX_K = 32                           # the largest K a run may plan (setting plan_k_max's bound)


def days(option: str):
    """An argparse type: a number of days from 0 to MAX_DAYS, else InvalidValue naming `option`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 <= value <= MAX_DAYS):
            raise InvalidValue(f"{option} {text[:40]!r}: give a number of days from 0 to {MAX_DAYS:,}")
        return value
    return parse


def k_value(option: str):
    """An argparse type: a K from 1 to MAX_K, else InvalidValue naming `option`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= MAX_K:
            raise InvalidValue(f"{option} {text[:40]!r}: give a whole number from 1 to {MAX_K}")
        return value
    return parse


def utc_time(option: str):
    """An argparse type: an ISO 8601 time (naive: UTC; an offset is converted) from
    EARLIEST_TIME on, as a naive UTC datetime; else InvalidValue naming `option`."""
    def parse(text: str) -> datetime:
        stripped = text.strip()
        try:
            value = datetime.fromisoformat(stripped[:-1] + "+00:00" if stripped[-1:] in "zZ" else stripped)
            if value.tzinfo is not None:
                value = value.astimezone(timezone.utc).replace(tzinfo=None)
        except (ValueError, OverflowError):
            value = None
        if value is None or value < EARLIEST_TIME:
            raise InvalidValue(f"{option} {text[:40]!r}: give an ISO 8601 time in UTC from "
                               f"{EARLIEST_TIME:%Y-%m-%d} on, e.g. 2026-01-31T12:00:00")
        return value
    return parse


def output_file(option: str):
    """An argparse type: a file path to write, whose folder exists and which is not itself a
    folder; else InvalidValue naming `option`."""
    def parse(text: str) -> str:
        path = Path(text)
        if not text.strip() or path.is_dir():
            raise InvalidValue(f"{option} {text[:80]!r} is a folder: give a file path to write")
        if not path.parent.is_dir():
            raise InvalidValue(f"{option} {text[:80]!r}: the folder {str(path.parent)[:80]!r} does "
                               "not exist; create it or give another path")
        return text
    return parse


def json_object(option: str):
    """An argparse type: a JSON object, else InvalidValue naming `option`."""
    def parse(text: str) -> dict:
        try:
            value = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidValue(f"{option} {text[:40]!r} is not JSON ({exc}); give a JSON object, "
                               "e.g. '{\"max_per_domain\": 20}'") from None
        except ValueError as exc:            # Python's integer-conversion limit
            raise InvalidValue(f"{option}: {exc}; give a JSON object of the run's Params") from None
        if not isinstance(value, dict):
            raise InvalidValue(f"{option} {text[:40]!r}: give a JSON object of the run's Params, "
                               "e.g. '{\"max_per_domain\": 20}'")
        return value
    return parse


def url_arg(parser: argparse.ArgumentParser) -> None:
    """--url: specdec's database."""
    parser.add_argument("--url", default=None,
                        help="database URL (default: $SPECDEC_DATABASE_URL, else "
                             "sqlite:///$SPECDEC_HOME/specdec.db)")


def open_store(args, settings=None):
    """The command's Store: --url (else the settings', else the default), its database checked to
    be migrated (tasks.db.store.Store.open): where a command resolves the database, once."""
    return Store.open(getattr(args, "url", None), settings)


def open_registry(args, store=None):
    """The command's Registry: --tracking-uri (else $MLFLOW_TRACKING_URI, else the default under
    $SPECDEC_HOME), never `store`'s database (tasks.registry.registry.Registry.open): where a
    command resolves the tracking store, once. Nothing is contacted until it is used."""
    return Registry.open(getattr(args, "tracking_uri", None), store)


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
