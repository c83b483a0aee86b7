"""Errors a user can cause in the pipeline steps, one type per kind; each message names the input
and the fix. The CLI prints them without a traceback."""

from __future__ import annotations


class SpecdecTaskError(Exception):
    """Base class of the user-facing errors raised by tasks/."""


class SettingsError(SpecdecTaskError, ValueError):
    """A setting (environment variable or settings file) is malformed."""


class DatabaseUnavailable(SpecdecTaskError, RuntimeError):
    """The database cannot be reached or does not exist."""


class DiskFull(DatabaseUnavailable):
    """The disk under the database (or under $SPECDEC_HOME) is full: nothing more can be written
    until space is freed (the rows written so far are kept; a re-run by run id replaces them)."""


class DatabaseNotMigrated(SpecdecTaskError, RuntimeError):
    """The database exists but its schema is missing or older than this code."""


class TrafficFileError(SpecdecTaskError, ValueError):
    """A traffic file cannot be read at all (missing, unknown format, bad CSV header)."""


class SampleError(SpecdecTaskError, ValueError):
    """A sampling request cannot be served (bad window, no traffic, unknown run)."""


class QualityGateFailed(SpecdecTaskError):
    """A table-level data-quality expectation failed: the run must stop.

    `summary` is the readable text; `failures` the failed expectations as JSON-able dicts.
    """

    def __init__(self, summary: str, failures: list[dict]):
        super().__init__(summary)
        self.summary = summary
        self.failures = failures


class UnknownReport(SpecdecTaskError, LookupError):
    """No SQL report of that name exists."""


class RegistryError(SpecdecTaskError, RuntimeError):
    """The tracking server / registry refused or the requested version does not exist."""


class RegistryUnavailable(RegistryError):
    """The MLflow tracking store cannot be reached (a retry may succeed)."""


class ServingEnvUnavailable(SpecdecTaskError, RuntimeError):
    """No serving environment (vLLM in its own virtual environment) is set up or configured."""


class ServingProbeError(SpecdecTaskError, RuntimeError):
    """The serving environment failed to answer (vLLM crashed, hung, or printed no answer)."""


class EngineTimeout(ServingProbeError):
    """A serving engine did not start or finish its replay in time (killed; its log is named)."""


class InvalidIdentifier(SpecdecTaskError, ValueError):
    """An identifier that names files under $SPECDEC_HOME (a run id, a draft id, a profile name)
    is malformed, or a path built from one would leave $SPECDEC_HOME."""


class InvalidValue(SpecdecTaskError):
    """A value given on the command line that cannot be used (not a number, not finite, out of
    range, not a time, not JSON): refused by name, with the fix, before any work. Not a
    ValueError, so that argparse passes it on instead of rewording it."""


class MonitorScrapeError(ServingProbeError):
    """A serving deployment's /metrics could not be read (down, refused, not vLLM's): nothing is
    stored for that scrape."""
